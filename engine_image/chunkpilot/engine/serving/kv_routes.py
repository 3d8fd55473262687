"""The prefill role's endpoints, which decode pods call (kv_transfer/decode_side.py):

* POST /kv/prefill: compute a prompt, sample its first token, hold its blocks under a lease; answers a KVOffer;
* POST /kv/release: the decode pod is done with a transfer; answers whether the lease still held;
* GET /kv/agent: the transport's metadata (a NIXL agent's), fetched once per prefill process;
* GET /kv/load: how many requests wait and run here, for the decode pods' choice.

Under API keys they are guarded like /v1/* (auth.py): the prefill call carries the client's key, so the prompt is
salted for the same tenant as on the decode pod."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from chunkpilot.engine.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError
from chunkpilot.engine.execution.kv_blocks import block_checksums
from chunkpilot.engine.kv_transfer.leases import LeaseTable
from chunkpilot.engine.kv_transfer.transport import KVTransport
from chunkpilot.engine.kv_transfer.wire import KVOffer, PeerLoad, PrefillRequest, Release, ReleaseReply
from chunkpilot.engine.serving.api_error import ApiError, bad_request, unavailable

SWEEP_SECONDS = 0.25  # how late an expired lease may be given back


class DrainGate:
    """Whether a live-roles engine takes prompts for decode pods: in the prefill role, once the client streams it was
    serving when it switched have ended (the drain: their last tokens decode on steps of their own, not beside other
    pods' prompt chunks), or `max_wait` seconds after the switch, whichever comes first; open then until the role
    changes again (a client request that still reaches it afterwards does not close it)."""

    def __init__(self, role: Callable[[], str | None], client_requests: Callable[[], int], max_wait: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role, self.client_requests, self.max_wait, self.clock = role, client_requests, max_wait, clock
        self._since: float | None = None  # when it was first asked in the prefill role
        self._open = False

    def __call__(self) -> str | None:
        if self.role() != "prefill":
            self._since, self._open = None, False
            return ("this engine serves the decode role now (its role was switched): it prefills no prompt for "
                    "other pods")
        if not self._open:
            now = self.clock()
            self._since = now if self._since is None else self._since
            self._open = self.client_requests() == 0 or now - self._since >= self.max_wait
        if self._open:
            return None
        return (f"this engine switched to the prefill role and is finishing the {self.client_requests()} client "
                f"stream(s) it was serving (at most {self.max_wait:g} s): it takes prompts after")


@dataclasses.dataclass
class PrefillSide:
    """What the prefill role keeps beside its engine."""

    engine: AsyncEngine
    transport: KVTransport
    fingerprint: str
    lease_seconds: float
    leases: LeaseTable = dataclasses.field(default_factory=LeaseTable)
    # why it takes no new prompt now (None: it takes them): a live-roles engine's DrainGate; what it granted before
    # a switch to decode is still read (/kv/agent) and released (/kv/release), and its leases still expire
    refusal: Callable[[], str | None] = lambda: None

    async def sweep(self) -> None:
        """Give back the blocks of expired leases (a decode pod that died releases nothing), forever."""
        while True:
            for blocks in self.leases.expire():
                self.engine.release_held(blocks)
            self.engine.metrics.kv_leases_held.set(len(self.leases))
            await asyncio.sleep(SWEEP_SECONDS)


def add_kv_routes(app: FastAPI, side, salt_of) -> None:
    """`side()`: the PrefillSide once the model loaded (None before, and on engines of another role);
    `salt_of(request, body)`: the server's prefix-cache salt of a request."""

    def ready() -> PrefillSide:
        s = side()
        if s is None:
            raise ApiError(404, "this engine serves no prefill role (or is still loading): /kv/* is served by "
                                "engines started with --role prefill", "not_found_error", code=404)
        return s

    # pod-to-pod endpoints: kept out of the public OpenAPI schema (clients never call them)
    def taking() -> PrefillSide:
        s = ready()
        refusal = s.refusal()
        if refusal is not None:  # decode pods stop choosing it at their next poll; one that did falls back or retries
            raise unavailable(refusal)
        return s

    @app.get("/kv/load", include_in_schema=False)
    async def load() -> PeerLoad:
        s = taking()
        if s.engine.draining:  # shutting down: decode pods stop choosing it at their next poll
            raise unavailable("this prefill pod is draining for shutdown")
        return PeerLoad(num_waiting=s.engine.num_waiting, num_running=s.engine.num_running, agent=s.transport.name,
                        fingerprint=s.fingerprint)

    @app.get("/kv/agent", include_in_schema=False)
    async def agent():
        return Response(ready().transport.metadata(), media_type="application/octet-stream")

    @app.post("/kv/prefill", include_in_schema=False)
    async def prefill(body: PrefillRequest, request: Request) -> KVOffer:
        s = taking()
        if body.fingerprint != s.fingerprint:
            raise ApiError(409, f"this prefill pod's KV layout is {s.fingerprint}, the caller's {body.fingerprint}: "
                                "prefill and decode pods must run the same model, dtype, quantization and block size",
                           "invalid_request_error", code="kv_layout_mismatch")
        # one token, whatever ends it on the decode pod: that pod judges stops and lengths itself
        params = dataclasses.replace(body.params, max_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True)
        started = asyncio.get_running_loop().time()
        last = None
        try:
            async for out in s.engine.generate(f"prefill-{uuid.uuid4().hex}", body.token_ids, params,
                                               cache_salt=salt_of(request, body), hold_kv=True):
                last = out
        except ValueError as e:
            raise bad_request(str(e), "token_ids") from None
        except QueueFullError as e:
            raise ApiError(429, f"prefill pod overloaded: {e}", "rate_limit_error", code="engine_overloaded") from None
        except EngineUnavailableError as e:
            raise unavailable(str(e)) from None
        if last is None or not last.held_blocks or not last.new_token_ids:
            if last is not None and last.held_blocks:
                s.engine.release_held(last.held_blocks)
            raise unavailable("the prefill was aborted (the engine is shutting down)")
        # no await between the last output and the lease: a cancelled request cannot leave blocks held by nobody
        transfer_id = s.leases.grant(last.held_blocks, s.lease_seconds)
        pool, bs = s.engine.kv_pool, s.transport.block_size
        sums = await asyncio.get_running_loop().run_in_executor(None, block_checksums, pool, bs, last.held_blocks)
        s.engine.metrics.remote_prefills_served.inc()
        s.engine.metrics.kv_leases_held.set(len(s.leases))
        lp = last.new_logprobs[0] if last.new_logprobs else None
        return KVOffer(transfer_id=transfer_id, agent=s.transport.name, fingerprint=s.fingerprint,
                       layout=s.transport.layout, block_size=bs, blocks=last.held_blocks, checksums=sums,
                       first_token=last.new_token_ids[0], logprob=(lp.logprob, lp.top) if lp else None,
                       lease_seconds=s.lease_seconds,
                       prefill_seconds=asyncio.get_running_loop().time() - started)

    @app.post("/kv/release", include_in_schema=False)
    async def release(body: Release) -> ReleaseReply:
        s = ready()
        blocks = s.leases.settle(body.transfer_id)
        if blocks is not None:
            s.engine.release_held(blocks)
        s.engine.metrics.kv_leases_held.set(len(s.leases))
        return ReleaseReply(held=blocks is not None)
