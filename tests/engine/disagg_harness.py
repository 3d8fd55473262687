"""A prefill engine and a decode engine in one process, wired as pods are but for two stand-ins: the HTTP calls go
to the prefill side's real routes through httpx's ASGI transport, and the blocks move through the in-process
transport (a subclass of which injects faults). Everything else is the code pods run: the routes, the leases, the
decode side's routing, pull, checksums and fallbacks, and both step loops."""

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


def engine_config(model: str, **kw) -> EngineConfig:
    base = dict(model=model, dtype="float32", max_model_len=512, num_kv_blocks=128, block_size=16, max_num_seqs=8,
                token_budget=128, max_chunk=64)
    return EngineConfig(**{**base, **kw})


class Pair:
    """One prefill and one decode engine (LLMEngines made once per module), the async layers around them made
    fresh per test inside its own event loop (`run`)."""

    def __init__(self, model: str, *, prefill_kw: dict | None = None, decode_kw: dict | None = None) -> None:
        self.prefill_llm = LLMEngine(engine_config(model, **(prefill_kw or {})))
        self.decode_llm = LLMEngine(engine_config(model, **(decode_kw or {})))
        self._n = 0

    def close(self) -> None:
        self.prefill_llm.close()
        self.decode_llm.close()

    def free_blocks(self) -> tuple[int, int]:
        return self.prefill_llm.block_manager.num_free_blocks, self.decode_llm.block_manager.num_free_blocks

    def run(self, body, *, transport_cls=InProcessTransport, threshold: int = 16, lease_seconds: float = 10.0):
        """asyncio.run(body(rig)) with a fresh Rig; the engines' step loops stop after it."""
        self._n += 1

        async def main():
            rig = Rig(self, transport_cls, threshold, lease_seconds, self._n)
            try:
                return await body(rig)
            finally:
                await rig.close()

        return asyncio.run(main())


class Rig:
    def __init__(self, pair: Pair, transport_cls, threshold: int, lease_seconds: float, n: int) -> None:
        p, d = pair.prefill_llm, pair.decode_llm
        self.loop = asyncio.get_running_loop()
        for llm in (p, d):  # each test decides from empty caches how much of a prompt is uncached
            llm.block_manager.reset_prefix_cache()
        self.prefill = AsyncEngine(p, EngineMetrics("m", p.max_model_len))
        self.prefill_transport = InProcessTransport(f"prefill-{n}", p.kv_pool, p.config.block_size)
        self.side = PrefillSide(self.prefill, self.prefill_transport, p.kv_fingerprint(), lease_seconds)
        app = FastAPI()
        app.add_exception_handler(ApiError, lambda _request, exc: exc.response())  # as the server's app does
        add_kv_routes(app, lambda: self.side, lambda request, body: (body.cache_salt or "").encode())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=PREFILL_URL)
        fp = d.kv_fingerprint()
        self.peers = PrefillPeers("prefill.test:80", self.client, fingerprint=fp, max_waiting=8,
                                  rng=random.Random(0))
        self.peers.peers = [Peer(PREFILL_URL, PeerLoad(num_waiting=0, num_running=0, agent="x", fingerprint=fp))]
        self.decode_transport = transport_cls(f"decode-{n}", d.kv_pool, d.config.block_size)
        self.decode_transport.rig = self
        self.remote = RemotePrefill(d, self.decode_transport, self.peers, self.client, threshold=threshold,
                                    fingerprint=fp, timeout=30.0)
        self.decode = AsyncEngine(d, EngineMetrics("m", d.max_model_len), remote=self.remote)
        self.prefill.start()
        self.decode.start()
        self._sweep = asyncio.ensure_future(self.side.sweep())

    async def generate(self, prompt, params, **kw):
        """The whole output of one request through the decode engine: (token ids, finish reason)."""
        tokens, reason = [], None
        async for out in self.decode.generate(f"r{threading.get_ident()}-{random.random()}", prompt, params, **kw):
            tokens += out.new_token_ids
            reason = out.finish_reason
        return tokens, reason

    def metric(self, engine: str, name: str, **labels) -> float:
        registry = (self.prefill if engine == "prefill" else self.decode).metrics.registry
        return registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0

    async def settle(self, timeout: float = 10.0) -> None:
        """Until no lease is held and both step loops have applied every queued release."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if (not len(self.side.leases) and self.prefill.engine._pending.empty()
                    and self.decode.engine._pending.empty()):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # a drained queue's last item is applied within the step that drained it

    async def close(self) -> None:
        self._sweep.cancel()
        await asyncio.gather(self._sweep, return_exceptions=True)
        for blocks in self.side.leases.drain():
            self.prefill.release_held(blocks)
        await self.settle()
        for eng in (self.prefill, self.decode):
            eng._stop.set()
            eng._wake.set()
            eng._thread.join(timeout=10)
        self.remote._pool.shutdown(wait=True)
        self.prefill_transport.close()
        self.decode_transport.close()
        await self.client.aclose()
