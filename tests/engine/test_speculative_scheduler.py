"""Speculative decoding in the step loop without a model: the scheduler, the block manager and the fake runner
(which checks every position it reads back from its simulated KV pool). Drafts are guessed after each step, as
the engine guesses them (`propose_drafts`), by a proposer that is right, partly right or wrong at random, so every mix of accepts and rejects, stops, preemptions and prefix-cache hits
occurs; greedy output must equal the output without drafts, and the pool's accounting must stay exact."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkpilot.engine.core.block_manager import BlockManager
from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.scheduler import Scheduler, SchedulerConfig
from chunkpilot.engine.core.sequence import Sequence
from chunkpilot.engine.speculation.proposers import propose_drafts

from .fake_runner import FakeRunner, next_token, reference_output

VOCAB = 50


class PerSequence:
    """The proposers' batch interface over a per-sequence `propose`, as NgramProposer has it."""

    def propose_batch(self, requests):
        return [self.propose(ids, k) for ids, k in requests]


class RandomProposer(PerSequence):
    """The true continuation (as the fake model would write it), cut short, with a wrong token somewhere, or
    nothing but wrong tokens; each at random."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def propose(self, token_ids, k):
        rng, history, out = self.rng, list(token_ids), []
        for _ in range(rng.randint(0, k)):
            t = next_token(history, VOCAB)
            history.append(t)
            out.append(t)
        if out and rng.random() < 0.4:
            out[rng.randrange(len(out))] = rng.randrange(VOCAB)  # a wrong draft: the rest is rejected
        return out


def held_blocks(sched) -> dict[int, int]:
    held: dict[int, int] = {}
    for s in sched.running:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    return held


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 24),
    k=st.integers(1, 6),
    prompts=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20), min_size=1, max_size=5),
    max_tokens=st.integers(1, 24),
)
def test_any_mix_of_accepts_and_rejects_keeps_output_and_kv_accounting_exact(
    seed, num_blocks, block_size, budget, k, prompts, max_tokens
):
    max_num_seqs = 4
    budget = max(budget, max_num_seqs)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    knobs = KnobHolder(SchedulerKnobs(budget, min(8, budget)), min_token_budget=max_num_seqs)
    sched = Scheduler(SchedulerConfig(max_num_seqs, num_blocks * block_size, (7,)), bm, knobs, k)  # EOS 7
    proposer = RandomProposer(random.Random(seed))
    runner = FakeRunner(num_blocks * block_size, block_size, VOCAB)
    # a repeated prompt shares prefix blocks with the first
    prompts = prompts + [prompts[0]]
    seqs = [Sequence(f"s{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    drafted = 0
    for _ in range(5000):
        if not sched.has_work:
            break
        decoding = [s for s in sched.running if s.is_decoding]
        out = sched.schedule()
        # within the budget; every decode that was running got a step (or was preempted), drafts on decodes only
        assert out.num_tokens <= budget
        assert {id(c.seq) for c in out.chunks[: out.num_decodes]} | {id(s) for s in decoding
                                                                      if s.request_id in out.preempted} >= {
            id(s) for s in decoding if s in sched.running}
        assert all(not c.draft_token_ids for c in out.chunks[out.num_decodes:])
        drafted += out.num_draft_tokens
        sched.update(out, runner.execute(out))
        propose_drafts(sched, proposer)
        # the pool's accounting: every block held is counted once per holder, free ones by nobody
        held = held_blocks(sched)
        assert all(bm.ref_counts[b] >= n for b, n in held.items())
        assert bm.num_free_blocks + sum(1 for c in bm.ref_counts if c > 0) == num_blocks
        for s in sched.running:  # no sequence keeps blocks past its tokens after a verification
            assert len(s.block_table) <= -(-(len(s) + k + 1) // block_size)
    else:
        raise AssertionError("no progress")
    max_len = num_blocks * block_size  # the pool holds one max-length sequence; longer ones stop there
    for s in seqs:
        want = reference_output(s.prompt_token_ids, max_tokens, VOCAB, (7,))[: max_len - len(s.prompt_token_ids)]
        assert s.output_token_ids == want, s.request_id
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


def test_drafts_come_out_of_the_budget_left_after_decodes_and_before_prompts():
    bm = BlockManager(64, 4)
    knobs = KnobHolder(SchedulerKnobs(8, 8), min_token_budget=2)

    class Always(PerSequence):
        def propose(self, token_ids, k):
            return [1] * k

    sched = Scheduler(SchedulerConfig(2, 256, ()), bm, knobs, 4)
    runner = FakeRunner(256, 4, VOCAB)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0))
    sched.add(a)
    out = sched.schedule()
    sched.update(out, runner.execute(out))  # a's prompt done
    propose_drafts(sched, Always())
    sched.add(Sequence("b", list(range(1, 20)), SamplingParams(max_tokens=5, temperature=0.0)))
    out = sched.schedule()
    # a: 1 + 4 drafts = 5 of the 8; b's prompt chunk gets the 3 left
    assert [(c.seq.request_id, c.num_tokens, len(c.draft_token_ids)) for c in out.chunks] == [("a", 5, 4), ("b", 3, 0)]
    assert out.num_decodes == 1 and out.num_draft_tokens == 4 and out.num_prefill_tokens == 3


def test_the_scheduler_budgets_the_drafts_it_is_handed_for_one_step():
    """Drafting is beside the scheduler, not in it: `draft_requests` names the decodes that may draft next step and
    the most each may take, and `schedule` budgets what it was handed, cut to the budget, for that step only."""
    bm = BlockManager(64, 4)
    knobs = KnobHolder(SchedulerKnobs(4, 4), min_token_budget=2)
    sched = Scheduler(SchedulerConfig(2, 256, ()), bm, knobs, 4)
    runner = FakeRunner(256, 4, VOCAB)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0))
    b = Sequence("b", [4], SamplingParams(max_tokens=50, temperature=0.0, logprobs=1))
    sched.add(a)
    sched.add(b)
    assert sched.draft_requests() == []  # prompts: nobody decodes yet
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert sched.draft_requests() == [(a, 4)]  # b asks for logprobs: no drafts
    right = reference_output([1, 2, 3], 5, VOCAB)[1:]
    sched.update_draft_token_ids({"a": right[:4], "b": [9]}, seconds=0.25)
    out = sched.schedule()
    # a: 1 + the 2 drafts the budget leaves after b's decode; b's handed drafts are not its to take
    assert [(c.seq.request_id, len(c.draft_token_ids)) for c in out.chunks] == [("a", 2), ("b", 0)]
    assert out.num_tokens == 4 and out.draft_seconds == 0.25
    sched.update(out, runner.execute(out))
    out = sched.schedule()  # nothing handed for this step: none left over from the last
    assert out.num_draft_tokens == 0 and out.draft_seconds == 0.0
    assert a.output_token_ids[:4] == reference_output([1, 2, 3], 4, VOCAB)


def drafting_calls(propose, max_tokens: int, k: int, threshold: float | None = None) -> int:
    """Run one greedy sequence to its end with drafts from `propose(token_ids, k)`; its output must be the model's
    own whatever was drafted. Returns how often the proposer was asked."""
    calls = []

    class Counted(PerSequence):
        def propose(self, token_ids, room):
            calls.append(room)
            return propose(token_ids, room)

    sched = Scheduler(SchedulerConfig(1, 512, ()), BlockManager(64, 4), KnobHolder(SchedulerKnobs(16, 8),
                                                                                    min_token_budget=1), k)
    if threshold is not None:
        sched.min_acceptance = threshold
    runner = FakeRunner(256, 4, VOCAB)
    s = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    sched.add(s)
    while sched.has_work:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        propose_drafts(sched, Counted())
    assert s.output_token_ids == reference_output([1, 2, 3], max_tokens, VOCAB)
    return len(calls)


def test_a_sequence_whose_drafts_are_rejected_stops_drafting_for_a_while():
    def wrong(token_ids, k):
        return [(next_token(list(token_ids), VOCAB) + 1) % VOCAB] * k  # never the model's token

    # 59 decode steps: pauses of 4, 8, 16, 32 after each rejected try leave 5 tries, not 59
    assert drafting_calls(wrong, 60, 3) <= 6


def test_drafts_take_blocks_last_and_never_preempt():
    """Three blocks of 4: a decode that would draft into the last free block, and a running prompt whose next
    chunk needs that block. The prompt gets it; the decode keeps only the drafts its own block holds (none here);
    nobody is preempted."""
    bm = BlockManager(3, 4)
    knobs = KnobHolder(SchedulerKnobs(16, 4), min_token_budget=2)

    class Always(PerSequence):
        def propose(self, token_ids, k):
            return [1] * k

    sched = Scheduler(SchedulerConfig(2, 64, ()), bm, knobs, 4)
    proposer = Always()
    runner = FakeRunner(12, 4, VOCAB)
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=4, temperature=0.0))
    sched.add(a)
    out = sched.schedule()
    sched.update(out, runner.execute(out))  # a: decoding, one block
    propose_drafts(sched, proposer)
    b = Sequence("b", list(range(3, 11)), SamplingParams(max_tokens=1, temperature=0.0))
    sched.add(b)
    out = sched.schedule()  # b's first 4 tokens take a block; a's drafts the last one, taken after b's
    sched.update(out, runner.execute(out))  # a's drafts (never the model's) rejected: their block given back
    propose_drafts(sched, proposer)
    out = sched.schedule()  # b's next 4 tokens need the one free block, which a's drafts would want too
    chunks = {c.seq.request_id: c for c in out.chunks}
    assert not out.preempted and chunks["b"].num_tokens == 4
    assert chunks["a"].draft_token_ids == [] and chunks["a"].num_tokens == 1
    sched.update(out, runner.execute(out))
    propose_drafts(sched, proposer)
    while sched.has_work:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        propose_drafts(sched, proposer)
    assert a.output_token_ids == reference_output([1, 2], 4, VOCAB)
    assert b.output_token_ids == reference_output(list(range(3, 11)), 1, VOCAB)
    assert bm.num_free_blocks == 3


def test_blocks_given_back_after_a_verification_are_reused_first():
    """They hold nothing a prefix-cache lookup could hit: the free list hands them out before any named block."""
    bm = BlockManager(8, 2)
    s = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.0))
    assert bm.allocate_prompt(s, 3)
    s.num_computed_tokens = 3
    assert bm.ensure_slots(s, 5)  # a decode and 4 drafts: blocks up to position 7
    spare = s.block_table[2:]
    bm.trim(s)  # no draft kept: back to the blocks of its 3 tokens
    assert len(s.block_table) == 2 and list(bm._free)[: len(spare)] == spare


def test_the_break_even_acceptance_is_measured_per_batch_size():
    """Decode-only steps as this CPU ran them: batch 1 costs 33 ms with or without 2 drafts (rows 1-3 cost alike),
    batch 8 costs 73 ms and 88 ms with 2 drafts (7.5 ms a draft): drafts must be kept 8 x 7.5 / 73 = 82 % of the
    time to pay at batch 8, hardly at all at batch 1. A batch size not seen borrows the nearest one's costs;
    until one has been seen with and without drafts, nothing is asked beyond the scheduler's floor."""
    import pytest

    from chunkpilot.engine.speculation.draft_cost import MIN_SAMPLES, RowCost

    cost = RowCost()
    assert cost.break_even(8) == 0.0
    for _ in range(MIN_SAMPLES - 1):
        cost.add(8, 0, 0.073)
        cost.add(8, 2, 0.088)
    assert cost.break_even(8) == 0.0  # too few steps
    for _ in range(20):
        cost.add(8, 0, 0.073)
        cost.add(8, 2, 0.088)
        cost.add(1, 0, 0.033)
        cost.add(1, 2, 0.033)
    assert cost.break_even(8) == pytest.approx(8 * 0.0075 / 0.073)
    assert cost.break_even(1) == 0.0  # free rows
    assert cost.break_even(7) == pytest.approx(7 * 0.0075 / 0.073)  # not seen yet: batch 8's costs, for 7
    for _ in range(40):  # eight decodes drafting 16 tokens at 3 ms each: the share needed falls to a third
        cost.add(8, 16, 0.073 + 16 * 0.003)
    assert cost.break_even(8) == pytest.approx(8 * 0.003 / 0.073, rel=0.05)


def test_a_sequence_pauses_below_the_threshold_the_engine_sets():
    """The same drafts, kept half the time: under the floor (30 %) the sequence goes on drafting; with the
    threshold a batch of 8 measures (62 %), it pauses."""
    def half_right(token_ids, k):
        right = next_token(list(token_ids), VOCAB)
        return [right, (right + 1) % VOCAB]

    assert drafting_calls(half_right, 40, 2, 0.3) > 15 and drafting_calls(half_right, 40, 2, 0.62) <= 6
