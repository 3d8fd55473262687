"""Prefill engines and a decode engine in one process, wired as pods are but for two stand-ins: the HTTP calls go
to each prefill side's real routes through httpx's ASGI transport (one per prefill pod's address), and the blocks
move through the in-process transport (a subclass of which injects faults). Everything else is the code pods run:
the routes, the leases, the decode side's routing, pull, checksums, retries and fallbacks, and every step loop."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
from fastapi import FastAPI

from chunkpilot.engine.async_engine import AsyncEngine
from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.kv_transfer.decode_side import RemotePrefill
from chunkpilot.engine.kv_transfer.peers import Peer, PrefillPeers
from chunkpilot.engine.kv_transfer.transport import InProcessTransport
from chunkpilot.engine.kv_transfer.wire import PeerLoad
from chunkpilot.engine.llm_engine import LLMEngine
from chunkpilot.engine.metrics import EngineMetrics
from chunkpilot.engine.serving.api_error import ApiError
from chunkpilot.engine.serving.kv_routes import PrefillSide, add_kv_routes

PREFILL_URL = "http://prefill.test"


def prefill_url(i: int) -> str:
    """The address of prefill pod i (0: PREFILL_URL)."""
    return PREFILL_URL if i == 0 else f"http://prefill-{i + 1}.test"


def engine_config(model: str, **kw) -> EngineConfig:
    base = dict(model=model, dtype="float32", max_model_len=512, num_kv_blocks=128, block_size=16, max_num_seqs=8,
                token_budget=128, max_chunk=64)
    return EngineConfig(**{**base, **kw})


class Pair:
    """`num_prefill` prefill engines and one decode engine (LLMEngines made once per module), the async layers
    around them made fresh per test inside its own event loop (`run`)."""

    def __init__(self, model: str, *, prefill_kw: dict | None = None, decode_kw: dict | None = None,
                 num_prefill: int = 1) -> None:
        self.prefill_llms = [LLMEngine(engine_config(model, **(prefill_kw or {}))) for _ in range(num_prefill)]
        self.prefill_llm = self.prefill_llms[0]
        self.decode_llm = LLMEngine(engine_config(model, **(decode_kw or {})))
        self._n = 0

    def close(self) -> None:
        for llm in self.prefill_llms:
            llm.close()
        self.decode_llm.close()

    def free_blocks(self) -> tuple[int, ...]:
        """Every prefill engine's free blocks, then the decode engine's."""
        return tuple(llm.block_manager.num_free_blocks for llm in (*self.prefill_llms, self.decode_llm))

    def run(self, body, *, transport_cls=InProcessTransport, threshold: int = 16, lease_seconds: float = 10.0,
            peers: int = 1):
        """asyncio.run(body(rig)) with a fresh Rig whose decode engine sees the first `peers` prefill engines; the
        engines' step loops stop after it."""
        if peers > len(self.prefill_llms):
            raise ValueError(f"{peers} prefill peers asked for, this pair has {len(self.prefill_llms)}")
        self._n += 1

        async def main():
            rig = Rig(self, transport_cls, threshold, lease_seconds, self._n, peers)
            try:
                return await body(rig)
            finally:
                await rig.close()

        return asyncio.run(main())


class Rig:
    def __init__(self, pair: Pair, transport_cls, threshold: int, lease_seconds: float, n: int, peers: int) -> None:
        prefill_llms, d = pair.prefill_llms[:peers], pair.decode_llm
        self.loop = asyncio.get_running_loop()
        for llm in (*prefill_llms, d):  # each test decides from empty caches how much of a prompt is uncached
            llm.block_manager.reset_prefix_cache()
        self.prefills = [AsyncEngine(p, EngineMetrics("m", p.max_model_len)) for p in prefill_llms]
        self.prefill = self.prefills[0]
        self.prefill_transports = [InProcessTransport(f"prefill{i + 1}-{n}", p.kv_pool, p.config.block_size)
                                   for i, p in enumerate(prefill_llms)]
        self.prefill_transport = self.prefill_transports[0]
        self.sides: list = [PrefillSide(e, t, p.kv_fingerprint(), lease_seconds)
                            for e, t, p in zip(self.prefills, self.prefill_transports, prefill_llms)]
        self.client = httpx.AsyncClient(mounts={prefill_url(i): httpx.ASGITransport(app=self._app(i))
                                                for i in range(peers)}, base_url=PREFILL_URL)
        fp = d.kv_fingerprint()
        self.peers = PrefillPeers("prefill.test:80", self.client, fingerprint=fp, max_waiting=8,
                                  rng=random.Random(0))
        # prefill pod i reports i requests waiting: the power-of-two choice takes the first, a retry the second
        self.peers.peers = [Peer(prefill_url(i), PeerLoad(num_waiting=i, num_running=0, agent="x", fingerprint=fp))
                            for i in range(peers)]
        self.decode_transport = transport_cls(f"decode-{n}", d.kv_pool, d.config.block_size)
        self.decode_transport.rig = self
        self.remote = RemotePrefill(d, self.decode_transport, self.peers, self.client, threshold=threshold,
                                    fingerprint=fp, timeout=30.0)
        self.decode = AsyncEngine(d, EngineMetrics("m", d.max_model_len), remote=self.remote)
        for eng in (*self.prefills, self.decode):
            eng.start()
        self._sweeps = [asyncio.ensure_future(side.sweep()) for side in self.sides]

    def _app(self, i: int) -> FastAPI:
        """Prefill pod i's /kv/* routes, serving whatever `sides[i]` is when called (a test may replace it)."""
        app = FastAPI()
        app.add_exception_handler(ApiError, lambda _request, exc: exc.response())  # as the server's app does
        add_kv_routes(app, lambda: self.sides[i], lambda request, body: (body.cache_salt or "").encode())
        return app

    @property
    def side(self):
        """The first prefill pod's side (None: it serves no prefill role)."""
        return self.sides[0]

    @side.setter
    def side(self, value) -> None:
        self.sides[0] = value

    def side_of(self, agent: str) -> PrefillSide:
        """The prefill side whose transport is `agent`."""
        return next(s for s in self.sides if s.transport.name == agent)

    async def generate(self, prompt, params, **kw):
        """The whole output of one request through the decode engine: (token ids, finish reason)."""
        tokens, reason = [], None
        async for out in self.decode.generate(f"r{threading.get_ident()}-{random.random()}", prompt, params, **kw):
            tokens += out.new_token_ids
            reason = out.finish_reason
        return tokens, reason

    def metric(self, engine: str, name: str, **labels) -> float:
        """`engine`: "decode", "prefill" (the first prefill engine) or "prefill2" (the second)."""
        eng = self.decode if engine == "decode" else self.prefills[int(engine.removeprefix("prefill") or 1) - 1]
        return eng.metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0

    async def settle(self, timeout: float = 10.0) -> None:
        """Until no lease is held and both step loops have applied every queued release."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if (not any(len(s.leases) for s in self.sides)
                    and all(e.engine._pending.empty() for e in (*self.prefills, self.decode))):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # a drained queue's last item is applied within the step that drained it

    async def close(self) -> None:
        for sweep in self._sweeps:
            sweep.cancel()
        await asyncio.gather(*self._sweeps, return_exceptions=True)
        for side, eng in zip(self.sides, self.prefills):
            for blocks in side.leases.drain():
                eng.release_held(blocks)
        await self.settle()
        for eng in (*self.prefills, self.decode):
            eng._stop.set()
            eng._wake.set()
            eng._thread.join(timeout=10)
        self.remote._pool.shutdown(wait=True)
        for t in (*self.prefill_transports, self.decode_transport):
            t.close()
        await self.client.aclose()
