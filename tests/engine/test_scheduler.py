"""Scheduler and block manager on the CPU without a model: unit tests and hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkpilot.engine.core.block_manager import BlockManager
from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.scheduler import Scheduler, SchedulerConfig
from chunkpilot.engine.core.sequence import Sequence

from .fake_runner import FakeRunner, reference_output

VOCAB = 50


def make(num_blocks=64, block_size=4, budget=16, max_chunk=8, max_num_seqs=4, prefix=True, max_model_len=512):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    knobs = KnobHolder(SchedulerKnobs(budget, max_chunk), min_token_budget=max_num_seqs)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_model_len, ()), bm, knobs)
    return sched, bm, knobs, FakeRunner(num_blocks * block_size, block_size, VOCAB)


def seq(rid, prompt, max_tokens=5):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def run_to_end(sched, runner, check=None, max_steps=10_000, on_step=None):
    steps = 0
    while sched.has_work:
        before = [s for s in sched.running if s.is_decoding]
        out = sched.schedule()
        if check:
            check(out, before)
        sched.update(out, runner.execute(out))
        steps += 1
        if on_step:
            on_step(steps)
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_decodes_first_then_chunks_within_budget():
    sched, bm, knobs, runner = make(budget=10, max_chunk=6, max_num_seqs=4)
    a = seq("a", range(1, 4), max_tokens=20)
    sched.add(a)
    out = sched.schedule()
    sched.update(out, runner.execute(out))  # a: 3-token prompt done, decoding from now on
    sched.add(seq("b", range(1, 30)))
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 6)]
    assert out.num_decodes == 1
    knobs.update(token_budget=5, max_chunk=5)
    sched.update(out, runner.execute(out))
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 4)]
    assert out.knobs.generation == 1


def test_prompt_longer_than_max_len_is_refused():
    sched, *_ = make(max_model_len=16)
    with pytest.raises(ValueError, match="max length is 16"):
        sched.add(seq("x", range(16)))
    with pytest.raises(ValueError, match="at least one token"):
        sched.add(seq("y", []))


def test_prefix_cache_reuses_blocks_and_counts_hits():
    sched, bm, _, runner = make(block_size=4)
    shared = list(range(1, 14))  # 3 full blocks + 1 token
    sched.add(seq("a", shared + [20, 21]))
    run_to_end(sched, runner)
    b = seq("b", shared + [30, 31, 32])
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 12
    assert out.chunks[0].start == 12
    sched.update(out, runner.execute(out))
    run_to_end(sched, runner)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 5, VOCAB)
    assert bm.prefix_hits == 12


def test_prefix_cache_never_covers_the_last_token():
    sched, bm, _, runner = make(block_size=4)
    prompt = list(range(1, 9))  # exactly two blocks
    sched.add(seq("a", prompt))
    run_to_end(sched, runner)
    b = seq("b", prompt)
    sched.add(b)
    out = sched.schedule()
    assert out.chunks[0].start == 4 and out.chunks[0].num_tokens == 4
    sched.update(out, runner.execute(out))
    run_to_end(sched, runner)
    assert b.output_token_ids == reference_output(prompt, 5, VOCAB)


def test_preemption_recomputes_newest_and_output_is_unchanged():
    # 12 blocks of 4 = 48 slots; three sequences growing to 40 tokens each cannot all fit.
    sched, bm, _, runner = make(num_blocks=12, block_size=4, budget=8, max_chunk=8, max_num_seqs=3, prefix=False)
    seqs = [seq(f"s{i}", range(1 + i, 11 + i), max_tokens=30) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_to_end(sched, runner)
    assert sched.num_preemptions > 0
    assert seqs[0].num_preemptions == 0  # the oldest is never the victim while newer ones run
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 30, VOCAB)
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_frees_blocks_at_once():
    sched, bm, _, runner = make()
    sched.add(seq("a", range(1, 30), max_tokens=50))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    assert bm.num_free_blocks < bm.num_blocks
    sched.abort("a")
    assert bm.num_free_blocks == bm.num_blocks
    assert not sched.has_work


def test_knob_holder_rejects_bad_values_and_keeps_last_good():
    holder = KnobHolder(SchedulerKnobs(64, 32, 1), min_token_budget=8)
    for bad, field in [
        (SchedulerKnobs(4, 4, 2), "token_budget"),
        (SchedulerKnobs(64, 128, 2), "max_chunk"),
        (SchedulerKnobs(64, 0, 2), "max_chunk"),
        (SchedulerKnobs(64, 32, -1), "generation"),
        (SchedulerKnobs("64", 32, 2), "token_budget"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ValueError, match=field):
            holder.set(bad)
        assert holder.get() == SchedulerKnobs(64, 32, 1)


# ---- properties ---------------------------------------------------------------------------------------------

# Prompts glued from a few pieces: equal blocks behind different prefixes (and shared prefixes) happen often,
# which is what the prefix cache's chained hashes must tell apart.
PIECES = [[1, 2, 3, 4], [1, 2], [3, 4], [5], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9]]
prompts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=8).map(lambda ps: [t for p in ps for t in p][:40])

requests = st.lists(
    st.tuples(
        prompts,
        st.integers(1, 12),  # max_tokens
        st.integers(0, 6),  # arrival step
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    block_size=st.integers(1, 8),
    num_blocks=st.integers(24, 80),
    max_num_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 24),
    chunk_frac=st.floats(0.05, 1.0),
    prefix=st.booleans(),
    knob_changes=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 24), st.floats(0.05, 1.0)), max_size=4),
    abort_at=st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(1, 30))),
)
def test_scheduler_properties(reqs, block_size, num_blocks, max_num_seqs, budget_extra, chunk_frac, prefix,
                              knob_changes, abort_at):
    num_blocks = max(num_blocks, -(-64 // block_size))  # the pool holds one max-length sequence
    budget = max_num_seqs + budget_extra
    sched, bm, knobs, runner = make(
        num_blocks=num_blocks, block_size=block_size, budget=budget, max_chunk=max(1, int(budget * chunk_frac)),
        max_num_seqs=max_num_seqs, prefix=prefix, max_model_len=64,
    )
    seqs = [seq(f"r{i}", p, max_tokens=m) for i, (p, m, _) in enumerate(reqs)]
    arrivals = {i: a for i, (_, _, a) in enumerate(reqs)}
    changes = {step: (max_num_seqs + extra, frac) for step, extra, frac in knob_changes}
    aborted = set()

    def check(out, decoding_before):
        k = out.knobs
        assert out.num_tokens <= k.token_budget
        assert all(c.num_tokens <= k.max_chunk for c in out.chunks)
        assert len(sched.running) <= max_num_seqs
        scheduled = {c.seq.request_id for c in out.chunks}
        for s in decoding_before:  # every decode gets its token unless it was preempted this step
            assert s.request_id in scheduled or s.request_id in out.preempted
        for c in out.chunks[: out.num_decodes]:
            assert c.num_tokens == 1

    def on_step(step):
        for i, s in enumerate(seqs):
            if arrivals[i] == step:
                sched.add(s)
        if step in changes:
            b, frac = changes[step]
            knobs.update(token_budget=b, max_chunk=max(1, int(b * frac)))
        if abort_at and step == abort_at[1] and abort_at[0] < len(seqs):
            victim = seqs[abort_at[0]]
            if not victim.is_finished and sched.abort(victim.request_id):
                aborted.add(victim.request_id)

    for i, s in enumerate(seqs):
        if arrivals[i] == 0:
            sched.add(s)
    run_to_end(sched, runner, check=check, on_step=on_step)
    # late arrivals after the queue drained
    for i, s in enumerate(seqs):
        if s.status.value == "waiting" and not s.block_table and s.request_id not in aborted and not s.output_token_ids:
            if s not in sched.waiting:
                sched.add(s)
    run_to_end(sched, runner, check=check)

    for s in seqs:
        if s.request_id in aborted:
            continue
        ref = reference_output(s.prompt_token_ids, s.params.max_tokens, VOCAB)
        ref = ref[: 64 - len(s.prompt_token_ids)]  # max_model_len cuts it
        assert s.output_token_ids == ref, s.request_id
    assert bm.num_free_blocks == bm.num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)
