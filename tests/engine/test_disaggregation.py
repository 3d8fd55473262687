"""Prefill/decode disaggregation in one process (disagg_harness.py): the output equals colocated output token for
token, and every fault (a corrupted block, a read that dies half way, a stale or expired lease, an unreachable prefill
pod, another KV layout) ends in a correct answer, a counted reason, and both pools back at their free-block
baseline. The same with real processes and NIXL: test_disaggregation_servers.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.kv_transfer.transport import InProcessTransport, TransferError
from chunkpilot.engine.metrics import KV_FALLBACKS, KV_TRANSFERS, REMOTE_PREFILLS_SERVED, TTFT_PHASE
from tests.engine.disagg_harness import Pair

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7)


def prompt(n: int, salt: int) -> list[int]:
    """n token ids, different per salt (no two prompts share a block by chance)."""
    return [(salt * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    p = Pair(smollm2_dir)
    yield p
    p.close()


def colocated(pair, prompts, params):
    """The reference: the decode engine alone (threshold past every prompt: nothing goes remote)."""
    async def body(rig):
        return await asyncio.gather(*(rig.generate(p, params) for p in prompts))
    return pair.run(body, threshold=10**9)


def fallback_count(rig, reason: str) -> float:
    return rig.metric("decode", KV_FALLBACKS.removesuffix("_total") + "_total", reason=reason)


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
        side = self.rig.side

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
            await asyncio.sleep(0.2)  # room for a wrongly early token to arrive; the right code cannot send one
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
