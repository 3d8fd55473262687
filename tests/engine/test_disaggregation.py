"""Prefill/decode disaggregation in one process (disagg_harness.py): the output equals colocated output token for
token, and every fault (a corrupted block, a read that dies half way, a stale or expired lease, an unreachable prefill
pod, another KV layout) ends in a correct answer, a counted reason, and every pool back at its free-block
baseline; with a second prefill pod, a fault of the first is retried there when the rule allows (retry.py). The same
with real processes and NIXL: test_disaggregation_servers.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.kv_transfer.transport import InProcessTransport, TransferError
from chunkpilot.engine.metrics import (KV_FALLBACK_REASONS, KV_FALLBACKS, KV_RETRIES, KV_RETRY_REASONS, KV_TRANSFERS,
                                      REMOTE_PREFILLS_SERVED, TTFT_PHASE)
from chunkpilot.engine.serving.kv_routes import DrainGate
from tests.engine.disagg_harness import Pair

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7)


def prompt(n: int, salt: int) -> list[int]:
    """n token ids, different per salt (no two prompts share a block by chance)."""
    return [(salt * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    p = Pair(smollm2_dir, num_prefill=2)  # the second prefill engine serves only the tests of retries
    yield p
    p.close()


def colocated(pair, prompts, params):
    """The reference: the decode engine alone (threshold past every prompt: nothing goes remote)."""
    async def body(rig):
        return await asyncio.gather(*(rig.generate(p, params) for p in prompts))
    return pair.run(body, threshold=10**9)


def fallback_count(rig, reason: str) -> float:
    return rig.metric("decode", KV_FALLBACKS.removesuffix("_total") + "_total", reason=reason)


def retry_count(rig, reason: str) -> float:
    return rig.metric("decode", KV_RETRIES, reason=reason)


def test_greedy_and_seeded_outputs_equal_colocated_in_a_continuous_batch(pair):
    """Long prompts go remote, short ones stay; one long prompt shares its first blocks with another, so the
    decode pod pulls only the blocks its own cache lacks. All run at once, greedy and seeded sampling."""
    shared = prompt(64, 1)
    prompts = [prompt(100, 2), prompt(8, 3), shared + prompt(50, 4), prompt(37, 5), prompt(12, 6)]
    for params in (GREEDY, SEEDED):
        want = colocated(pair, [shared] + prompts, params)
        base = pair.free_blocks()

        async def body(rig):
            first = await rig.generate(shared, params)  # now in the decode pod's prefix cache
            got = await asyncio.gather(*(rig.generate(p, params) for p in prompts))
            await rig.settle()
            return [first] + got, rig

        got, rig = pair.run(body)
        assert got == want
        assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 4  # shared, 100, 64+50 and 37 tokens
        assert rig.metric("prefill", REMOTE_PREFILLS_SERVED) == 4
        assert rig.metric("decode", TTFT_PHASE + "_count", phase="transfer") == 4
        assert rig.metric("decode", TTFT_PHASE + "_count", phase="first_decode") == 4
        assert pair.free_blocks() == base


def test_a_first_token_that_ends_the_request_needs_no_transfer(pair):
    want = colocated(pair, [prompt(80, 9)], SamplingParams(max_tokens=1, temperature=0.0))

    async def body(rig):
        got = await rig.generate(prompt(80, 9), SamplingParams(max_tokens=1, temperature=0.0))
        await rig.settle()
        return got, rig

    got, rig = pair.run(body)
    assert [got] == want and got[1] == "length"
    assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 0
    assert not len(rig.side.leases)


class Corrupting(InProcessTransport):
    def read(self, *args, **kw):
        n = super().read(*args, **kw)
        block = args[4][0]  # the first local block
        self.pool[0, 0, block * 16] += 1.0
        return n


class DiesHalfWay(InProcessTransport):
    def read(self, agent, fetch, remote, remote_blocks, local_blocks, timeout):
        half = len(local_blocks) // 2
        super().read(agent, fetch, remote, remote_blocks[:half], local_blocks[:half], timeout)
        raise TransferError("the prefill pod's connection reset")


class StaleId(InProcessTransport):
    """The prefill pod forgets the transfer id before the read (as after a restart): its blocks are given back and
    overwritten, and the release says the lease did not hold."""

    def read(self, *args, **kw):
        side = self.rig.side_of(args[0])  # the prefill pod read from

        async def forget():  # on the event loop, which owns the lease table
            for tid in list(side.leases._leases):
                side.engine.release_held(side.leases.settle(tid))
            await asyncio.sleep(0.2)  # the prefill step loop gives them back
        asyncio.run_coroutine_threadsafe(forget(), self.rig.loop).result()
        return super().read(*args, **kw)


class Slow(InProcessTransport):
    def read(self, *args, **kw):
        import time
        time.sleep(0.6)  # past the 0.2 s lease: the sweep gives the blocks back meanwhile
        return super().read(*args, **kw)


@pytest.mark.parametrize("transport, reason, kw", [
    (Corrupting, "checksum", {}),
    (DiesHalfWay, "transfer", {}),
    (StaleId, "lease", {}),
    (Slow, "lease", {"lease_seconds": 0.2}),
])
def test_a_failed_transfer_prefills_locally_with_a_correct_answer_and_loses_no_block(pair, transport, reason, kw):
    prompts = [prompt(90, 11), prompt(70, 12)]
    want = colocated(pair, prompts, GREEDY)
    base = pair.free_blocks()

    async def body(rig):
        got = await asyncio.gather(*(rig.generate(p, GREEDY) for p in prompts))
        await rig.settle()
        # nothing unverified entered the decode pod's prefix cache: the same prompts again, prefilled here from
        # what its cache holds now, give the same answers
        rig.remote.threshold = 10**9
        again = await asyncio.gather(*(rig.generate(p, GREEDY) for p in prompts))
        await rig.settle()
        return got, again, rig

    got, again, rig = pair.run(body, transport_cls=transport, **kw)
    assert got == want and again == want
    assert fallback_count(rig, reason) == 2
    assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 0
    assert pair.free_blocks() == base


@pytest.mark.parametrize("breakage, reason", [("no_role", "unreachable"), ("layout", "fingerprint")])
def test_an_unusable_prefill_pod_means_local_prefill(pair, breakage, reason):
    want = colocated(pair, [prompt(60, 13)], GREEDY)
    base = pair.free_blocks()

    async def body(rig):
        if breakage == "no_role":
            rig.side = None
        else:
            rig.side.fingerprint = "another-model"
        got = await rig.generate(prompt(60, 13), GREEDY)
        rig.side = rig.side or _placeholder(rig)
        await rig.settle()
        return got, rig

    got, rig = pair.run(body)
    assert [got] == want
    assert fallback_count(rig, reason) == 1
    assert pair.free_blocks() == base


def _placeholder(rig):
    from chunkpilot.engine.kv_transfer.leases import LeaseTable

    class Side:  # what close() and settle() read of a prefill side
        leases = LeaseTable()
    return Side()


def test_checksums_see_every_byte_of_a_block():
    from chunkpilot.engine.execution.kv_blocks import block_checksums

    pool = torch.zeros(2, 2, 64, 1, 4)
    before = block_checksums(pool, 16, [0, 1, 2, 3])
    pool[1, 1, 31, 0, 3] = 1e-30  # the last value of block 1's last layer's V
    after = block_checksums(pool, 16, [0, 1, 2, 3])
    assert [a == b for a, b in zip(before, after)] == [True, False, True, True]


@pytest.mark.gpu
def test_nixl_reads_blocks_between_two_device_pools_and_the_checksums_agree():
    """The GPU step: NIXL registers device memory (VRAM) on both sides and reads only the blocks asked for, into
    other block ids, byte for byte; the checksums of the two sides agree."""
    from chunkpilot.engine.execution.kv_blocks import block_checksums
    from chunkpilot.engine.kv_transfer.nixl_transport import NixlTransport

    shape = (4, 2, 64 * 16, 2, 64)
    src_pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    dst_pool = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
    src, dst = NixlTransport("gpu-prefill", src_pool, 16), NixlTransport("gpu-decode", dst_pool, 16)
    try:
        moved = dst.read(src.name, src.metadata, src.layout, [3, 5, 7], [10, 11, 12], 30.0)
        torch.cuda.synchronize()
        assert moved == 3 * src_pool[:, :, :16].numel() * 2
        for s, d in zip([3, 5, 7], [10, 11, 12]):
            assert torch.equal(dst_pool[:, :, d * 16:(d + 1) * 16], src_pool[:, :, s * 16:(s + 1) * 16])
        assert block_checksums(dst_pool, 16, [10, 11, 12]) == block_checksums(src_pool, 16, [3, 5, 7])
        assert not dst_pool[:, :, :10 * 16].any()  # nothing else was written
    finally:
        src.close()
        dst.close()


def test_a_knobs_push_moves_the_threshold_while_serving(pair):
    """The threshold is a knob: a knobs file or an admin push with `disagg_threshold` moves it at once (as the
    tuner will in mode auto), without it the start-up setting holds again."""
    from chunkpilot.contract.knobs import SchedulerKnobs, dumps_knobs, parse_knobs

    holder = pair.decode_llm.knobs
    start = holder.get()

    async def body(rig):
        holder.set(parse_knobs(dumps_knobs(SchedulerKnobs(start.token_budget, start.max_chunk, 7, 10**6))))
        await rig.generate(prompt(80, 21), GREEDY)
        local = rig.metric("decode", KV_TRANSFERS, outcome="ok")
        holder.set(SchedulerKnobs(start.token_budget, start.max_chunk, 8))
        await rig.generate(prompt(80, 22), GREEDY)
        await rig.settle()
        return local, rig.metric("decode", KV_TRANSFERS, outcome="ok")

    try:
        assert pair.run(body) == (0, 1)
    finally:
        holder.set(start)


def test_the_knobs_file_carries_the_threshold_only_when_set():
    from chunkpilot.contract.knobs import SchedulerKnobs, dumps_knobs, parse_knobs

    assert "disagg_threshold" not in dumps_knobs(SchedulerKnobs(64, 32, 1))
    assert parse_knobs('{"token_budget": 64, "max_chunk": 32, "generation": 2, "disagg_threshold": 512}') \
        == SchedulerKnobs(64, 32, 2, 512)
    with pytest.raises(ValueError, match="disagg_threshold must be an integer >= 0"):
        SchedulerKnobs(64, 32, 2, -1).validated()


def test_the_knobs_carry_a_live_roles_engine_role_and_no_other_engine_takes_one():
    """--live-roles: the role rides in the knobs (file and push alike); knobs without one (the shared knobs file)
    keep the role; an engine started without --live-roles refuses a role and keeps its knobs."""
    from chunkpilot.contract.knobs import SchedulerKnobs, dumps_knobs, parse_knobs
    from chunkpilot.engine.core.knobs import KnobHolder

    assert parse_knobs('{"token_budget": 64, "max_chunk": 32, "generation": 2, "role": "prefill"}') \
        == SchedulerKnobs(64, 32, 2, role="prefill")
    assert "role" not in dumps_knobs(SchedulerKnobs(64, 32, 1))
    with pytest.raises(ValueError, match="role must be one of prefill, decode"):
        SchedulerKnobs(64, 32, 2, role="both").validated()
    fixed = KnobHolder(SchedulerKnobs(64, 32, 0))
    with pytest.raises(ValueError, match="--live-roles"):
        fixed.set(SchedulerKnobs(64, 32, 1, role="decode"))
    assert fixed.get() == SchedulerKnobs(64, 32, 0) and fixed.role is None
    live = KnobHolder(SchedulerKnobs(64, 32, 0))
    live.enable_roles("decode")
    assert live.set(SchedulerKnobs(64, 16, 1, role="prefill")).role == "prefill"
    assert live.set(SchedulerKnobs(128, 16, 2)) == SchedulerKnobs(128, 16, 2, role="prefill")
    assert live.update(max_chunk=8).role == "prefill"


def test_a_live_roles_engine_in_the_prefill_role_prefills_here_and_refuses_new_prompts_as_decode(pair):
    """Switched to prefill, a live-roles decode engine sends no prompt on (a client that still reaches it is served
    here); a prefill side that switched to decode answers the load poll and new prompts with 503, and still
    releases what it granted before."""
    from chunkpilot.engine.kv_transfer.wire import PrefillRequest

    holder = pair.decode_llm.knobs
    start = holder.get()
    base = pair.free_blocks()

    def ask(rig, salt: int) -> dict:
        return PrefillRequest(token_ids=prompt(60, salt), params=GREEDY,
                              fingerprint=pair.prefill_llm.kv_fingerprint()).model_dump(mode="json")

    async def body(rig):
        holder.enable_roles("decode")
        await rig.generate(prompt(60, 41), GREEDY)
        assert rig.metric("prefill", REMOTE_PREFILLS_SERVED) == 1
        holder.set(holder.get().with_role("prefill"))
        assert rig.remote.route(rig.decode.engine.make_sequence("x", prompt(60, 42), GREEDY)) is None
        await rig.generate(prompt(60, 42), GREEDY)
        assert rig.metric("prefill", REMOTE_PREFILLS_SERVED) == 1  # prefilled here
        granted = await rig.client.post("/kv/prefill", json=ask(rig, 43))
        assert granted.status_code == 200, granted.text
        gate = DrainGate(lambda: "decode", lambda: 0, 30.0)  # the prefill pod switched to decode
        rig.side = dataclasses.replace(rig.side, refusal=gate)
        for r in (await rig.client.get("/kv/load"), await rig.client.post("/kv/prefill", json=ask(rig, 44))):
            assert r.status_code == 503 and "decode role" in r.json()["error"]["message"], r.text
        released = await rig.client.post("/kv/release", json={"transfer_id": granted.json()["transfer_id"]})
        assert released.json() == {"held": True}
        await rig.settle()

    try:
        pair.run(body)
    finally:
        holder._knobs = start  # the module's engine: a fixed-role decode engine again for the other tests
    assert pair.free_blocks() == base


def test_the_kv_fingerprint_names_the_block_checksum(pair, monkeypatch):
    """Pods that checksum blocks differently (another version, during a rolling upgrade) must refuse each other at
    the fingerprint (409, prefilled locally), not fail every block as a checksum mismatch."""
    from chunkpilot.engine import llm_engine

    now = pair.decode_llm.kv_fingerprint()
    assert pair.prefill_llm.kv_fingerprint() == now
    monkeypatch.setattr(llm_engine, "CHECKSUM", "crc32")
    assert pair.decode_llm.kv_fingerprint() != now


def test_live_roles_are_refused_without_a_role_to_start_in_or_peers_and_allow_peers_on_a_prefill_engine():
    from chunkpilot.engine.config import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings

    engine = EngineConfig(model="unused")
    for kw in ({"role": "both", "prefill_peers": "p:1"}, {"role": "decode"}, {"role": "prefill"}):
        with pytest.raises(ValueError, match="--live-roles needs --role prefill or decode"):
            ServerSettings(engine, live_roles=True, **kw)
    # a fixed prefill engine sends nothing on; a live one starting as prefill needs its peers for when it decodes
    with pytest.raises(ValueError, match="drop --prefill-peers"):
        ServerSettings(engine, role="prefill", prefill_peers="p:1")
    assert ServerSettings(engine, role="prefill", prefill_peers="p:1", live_roles=True).live_roles


def test_a_pod_switched_to_prefill_takes_prompts_once_its_client_streams_ended_or_the_wait_ran_out():
    """The drain of a switch to prefill: closed while the client streams it was serving run, open when they ended
    (and open for good until the role changes), or after the longest wait; closed again in the decode role."""
    state = {"role": "decode", "clients": 2, "now": 0.0}
    gate = DrainGate(lambda: state["role"], lambda: state["clients"], 10.0, clock=lambda: state["now"])
    assert "decode role" in gate()
    state["role"] = "prefill"
    assert "finishing the 2 client stream(s)" in gate()
    state["clients"], state["now"] = 0, 3.0
    assert gate() is None
    state["clients"] = 1  # a client request that still reached it after the drain: it takes prompts all the same
    assert gate() is None
    state["role"] = "decode"
    assert gate() is not None
    state.update(role="prefill", now=100.0)
    assert gate() is not None  # a new switch, a new drain
    state["now"] = 110.0
    assert gate() is None  # the longest wait ran out


def test_a_draining_prefill_pod_stops_answering_the_load_poll(pair):
    """On SIGTERM a prefill pod answers GET /kv/load with 503, so decode pods drop it at their next poll."""
    async def body(rig):
        ok = (await rig.client.get("/kv/load")).status_code
        rig.prefill.draining = True
        try:
            return ok, (await rig.client.get("/kv/load")).status_code
        finally:
            rig.prefill.draining = False

    assert pair.run(body) == (200, 503)


class Gated(InProcessTransport):
    """A read that waits for the test to open the gate, saying when it started."""

    reading = None
    gate = None

    def read(self, *args, **kw):
        Gated.reading.set()
        assert Gated.gate.wait(30), "the test never opened the gate"
        return super().read(*args, **kw)


@pytest.mark.parametrize("with_kv", [False, True], ids=["early", "with-kv"])
def test_the_first_token_leaves_at_once_or_with_the_blocks(pair, with_kv):
    """--first-token early: the client has the first token while the blocks are still being read; with-kv: not
    until they are here (the first inter-token gap is then a decode step, not the pull). Same answer either way."""
    import threading

    want = colocated(pair, [prompt(90, 21)], GREEDY)
    base = pair.free_blocks()
    Gated.reading, Gated.gate = threading.Event(), threading.Event()

    async def body(rig):
        rig.remote.first_token_with_kv = with_kv
        tokens: list[int] = []

        async def consume():
            async for out in rig.decode.generate("gated", prompt(90, 21), GREEDY):
                tokens.extend(out.new_token_ids)

        task = asyncio.ensure_future(consume())
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, Gated.reading.wait, 30), "the pull never started"
        if with_kv:
            # An early token is handed to this loop before the pull even reserves blocks, so before the read began;
            # the executor's answer above came after it, and a few turns of the loop let the consumer take it.
            # Nothing arriving by then means none was sent before the read.
            for _ in range(5):
                await asyncio.sleep(0)
            seen = len(tokens)
        else:
            for _ in range(250):  # it is on its way (delivered before the read began)
                if tokens:
                    break
                await asyncio.sleep(0.02)
            seen = len(tokens)
        Gated.gate.set()
        await task
        await rig.settle()
        return seen, tokens, rig

    seen, tokens, rig = pair.run(body, transport_cls=Gated)
    assert seen == (0 if with_kv else 1)
    assert (tokens, "length") == want[0]
    assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 1
    assert pair.free_blocks() == base


def test_with_kv_a_failed_pull_still_sends_the_first_token_first(pair):
    """with-kv holds the first token for the blocks; a pull that fails (a corrupted block) sends it before the
    local prefill goes on from it: the same answer, and the block counts back at baseline."""
    want = colocated(pair, [prompt(90, 22)], GREEDY)
    base = pair.free_blocks()

    async def body(rig):
        rig.remote.first_token_with_kv = True
        got = await rig.generate(prompt(90, 22), GREEDY)
        await rig.settle()
        return got, rig

    got, rig = pair.run(body, transport_cls=Corrupting)
    assert [got] == want
    assert fallback_count(rig, "checksum") == 1
    assert pair.free_blocks() == base


def test_an_idle_decode_loop_is_woken_for_the_pulled_blocks(pair):
    """The reservation of blocks for a pull is queued for the step loop; an idle loop must be woken for it, not
    find it at its next heartbeat (0.5 s, inside the request's first inter-token gap: more than a tight ITL SLO).
    With the heartbeat stretched to a minute, a lone remote request ends only if the pull wakes the loop."""
    want = colocated(pair, [prompt(90, 23)], GREEDY)

    async def body(rig):
        rig.decode.idle_poll = 60.0
        rig.decode._wake.set()  # leave the current wait, so the next one is the long one
        got = await asyncio.wait_for(rig.generate(prompt(90, 23), GREEDY), 30)
        rig.decode.idle_poll = 0.5
        await rig.settle()
        return got, rig

    got, rig = pair.run(body)
    assert [got] == want
    assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 1


# ---- a second prefill pod (kv_transfer/retry.py) ----------------------------------------------------------------
def first_peer_only(fault):
    """`fault`, on reads from the first prefill pod only: the second serves correct blocks."""
    class OnTheFirstPeer(fault):
        def read(self, agent, *args, **kw):
            if agent == self.rig.prefill_transports[0].name:
                return super().read(agent, *args, **kw)
            return InProcessTransport.read(self, agent, *args, **kw)

    OnTheFirstPeer.__name__ = fault.__name__ + "OnTheFirstPeer"
    return OnTheFirstPeer


@contextlib.contextmanager
def first_peer_broken(rig, breakage: str | None):
    """The first prefill pod serves no prefill role ("no_role": HTTP 404) or runs another model ("layout": 409)
    while the block runs."""
    side, fp = rig.side, rig.side.fingerprint
    if breakage == "no_role":
        rig.side = None
    elif breakage == "layout":
        side.fingerprint = "another-model"
    try:
        yield
    finally:
        rig.side, side.fingerprint = side, fp


def slow_local_prefill(rig) -> None:
    """This decode engine measured a local prefill as slow as it gets: the slack allows a retry, whatever the
    attempt took."""
    rig.remote.local_cost.add(3600.0, 1)


# pull faults fail after the first token was streamed (the retry must not stream it again); the prefill call's
# before it
RETRY_FAULTS = [
    pytest.param(first_peer_only(Corrupting), "checksum", None, id="checksum"),
    pytest.param(first_peer_only(DiesHalfWay), "transfer", None, id="transfer"),
    pytest.param(first_peer_only(StaleId), "lease", None, id="stale-id"),
    pytest.param(InProcessTransport, "unreachable", "no_role", id="unreachable"),
    pytest.param(InProcessTransport, "fingerprint", "layout", id="fingerprint"),
]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("transport, reason, breakage", RETRY_FAULTS)
def test_a_prompt_the_first_prefill_pod_fails_is_served_by_the_second(pair, transport, reason, breakage, params):
    prompts = [prompt(90, 31), prompt(70, 32)]
    want = colocated(pair, prompts, params)
    base = pair.free_blocks()

    async def body(rig):
        slow_local_prefill(rig)
        with first_peer_broken(rig, breakage):
            got = await asyncio.gather(*(rig.generate(p, params) for p in prompts))
        await rig.settle()
        return got, rig

    got, rig = pair.run(body, transport_cls=transport, peers=2)
    # each first token streamed once, the second pod's equal to it (the seeded draw is keyed by position)
    assert got == want
    assert retry_count(rig, reason) == 2
    assert sum(fallback_count(rig, r) for r in KV_FALLBACK_REASONS) == 0  # served by a prefill pod after all
    assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 2
    assert rig.metric("decode", KV_TRANSFERS, outcome="fallback") == 0
    assert rig.metric("prefill2", REMOTE_PREFILLS_SERVED) == 2
    assert rig.metric("decode", TTFT_PHASE + "_count", phase="remote_prefill") == 2  # one first token each
    assert pair.free_blocks() == base  # both prefill pools and the decode pool


@pytest.mark.parametrize("transport, reason", [(Corrupting, "checksum"), (StaleId, "lease")])
def test_a_prompt_both_prefill_pods_fail_is_prefilled_here(pair, transport, reason):
    prompts = [prompt(90, 33), prompt(70, 34)]
    want = colocated(pair, prompts, SEEDED)
    base = pair.free_blocks()

    async def body(rig):
        slow_local_prefill(rig)
        got = await asyncio.gather(*(rig.generate(p, SEEDED) for p in prompts))
        await rig.settle()
        rig.remote.threshold = 10**9  # nothing unverified entered the prefix cache: the same answers from it
        again = await asyncio.gather(*(rig.generate(p, SEEDED) for p in prompts))
        await rig.settle()
        return got, again, rig

    got, again, rig = pair.run(body, transport_cls=transport, peers=2)
    assert got == want and again == want
    assert retry_count(rig, reason) == 2 and fallback_count(rig, reason) == 2  # the second pod's reason
    assert rig.metric("decode", KV_TRANSFERS, outcome="ok") == 0
    assert rig.metric("prefill", REMOTE_PREFILLS_SERVED) == 2 == rig.metric("prefill2", REMOTE_PREFILLS_SERVED)
    assert pair.free_blocks() == base


@pytest.mark.parametrize("forbid", ["slack", "no-retries"])
def test_a_prompt_is_prefilled_here_without_a_retry_the_rule_forbids(pair, forbid):
    want = colocated(pair, [prompt(90, 35)], GREEDY)
    base = pair.free_blocks()

    async def body(rig):
        if forbid == "slack":
            rig.remote.local_cost.add(0.0, 1)  # a local prefill measured as free: no second attempt beats it
        else:
            rig.remote.retries = 0  # --prefill-retries 0 (nothing measured here: the slack alone would allow it)
        got = await rig.generate(prompt(90, 35), GREEDY)
        await rig.settle()
        return got, rig

    got, rig = pair.run(body, transport_cls=first_peer_only(Corrupting), peers=2)
    assert [got] == want
    assert sum(retry_count(rig, r) for r in KV_RETRY_REASONS) == 0
    assert fallback_count(rig, "checksum") == 1
    assert rig.metric("prefill2", REMOTE_PREFILLS_SERVED) == 0
    assert pair.free_blocks() == base


def test_a_second_prefill_pod_whose_first_token_differs_is_refused(pair):
    """The client has the first token from the first attempt; a second pod that samples another one (its numerics
    differ) cannot be used: its offer is refused and released, and the request is prefilled here."""
    from chunkpilot.engine.kv_transfer.decode_side import PullFailed

    ((want, _),) = colocated(pair, [prompt(60, 36)], GREEDY)
    base = pair.free_blocks()

    async def body(rig):
        seq = rig.decode.engine.make_sequence("first-token", prompt(60, 36), GREEDY)
        seq.output_token_ids.append(want[0] + 1)  # as if an earlier attempt had streamed another token
        peer = rig.peers.peers[0]
        with pytest.raises(PullFailed) as refused:
            await rig.remote.prefill(peer, seq, auth=None, cache_salt=None)
        seq.output_token_ids[0] = want[0]
        offer = await rig.remote.prefill(peer, seq, auth=None, cache_salt=None)  # the same token passes
        await rig.remote.release(peer, offer)
        await rig.settle()
        return refused.value.reason, offer.first_token

    assert pair.run(body) == ("first_token", want[0])
    assert pair.free_blocks() == base


def test_the_retry_rule():
    from chunkpilot.engine.kv_transfer.retry import should_retry

    assert should_retry("checksum", 0, 1, spent=0.5, local_seconds=2.0)
    # the failed attempt took as long as a local prefill would: another one is not expected to be faster
    assert not should_retry("checksum", 0, 1, spent=2.0, local_seconds=2.0)
    assert not should_retry("checksum", 1, 1, spent=0.5, local_seconds=2.0)  # retried once already
    assert should_retry("checksum", 1, 2, spent=0.5, local_seconds=2.0)
    assert not should_retry("checksum", 0, 0, spent=0.5, local_seconds=2.0)  # --prefill-retries 0
    assert should_retry("unreachable", 0, 1, spent=30.0, local_seconds=None)  # nothing measured here yet
    # no_room is this pod's own shortage, and a first token that differed would differ again
    assert {r for r in KV_FALLBACK_REASONS if should_retry(r, 0, 1, 0.0, None)} == set(KV_RETRY_REASONS)
    assert set(KV_FALLBACK_REASONS) - set(KV_RETRY_REASONS) == {"no_room", "first_token"}


def test_the_local_prefill_cost_follows_the_recent_steps():
    from chunkpilot.engine.kv_transfer.retry import LocalPrefillCost

    cost = LocalPrefillCost(decay=0.5)
    assert cost.seconds(100) is None
    cost.add(1.0, 100)  # 10 ms a prompt token
    assert cost.seconds(50) == pytest.approx(0.5)
    for _ in range(20):
        cost.add(0.1, 100)  # the load fell: 1 ms a token
    assert cost.seconds(50) == pytest.approx(0.05, rel=1e-3)


def test_a_retry_never_goes_back_to_a_prefill_pod_that_failed():
    import random

    from chunkpilot.engine.kv_transfer.peers import Peer, choose
    from chunkpilot.engine.kv_transfer.wire import PeerLoad

    peers = [Peer(f"http://p{i}", PeerLoad(num_waiting=i, num_running=0, agent="a", fingerprint="f"))
             for i in range(3)]
    rng = random.Random(0)
    assert {choose(peers, 8, rng).url for _ in range(50)} == {"http://p0", "http://p1"}  # two at random, the lesser
    assert {choose(peers, 8, rng, exclude=["http://p0"]).url for _ in range(50)} == {"http://p1"}
    assert choose(peers, 8, rng, exclude=["http://p0", "http://p1"]).url == "http://p2"
    assert choose(peers, 8, rng, exclude=["http://p0", "http://p1", "http://p2"]) is None
