"""The scheduler with per-request SLO classes (docs/slo-classes.md), on the CPU without a model: the order of
prompt chunks, the step's prompt tokens capped by the tightest ITL, the shares, preemption only for a strictly
higher class and never back, and the properties of the first-come-first-served scheduler kept (every output
exact, no block leaked, every decode its token each step)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkpilot.contract.slo import SLOClass, SLOClasses, SLOTargets
from chunkpilot.engine.core.block_manager import BlockManager
from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.scheduler import COLD_PROMPT_TOKENS, ITL_SHARE, Scheduler, SchedulerConfig
from chunkpilot.engine.core.sequence import Sequence
from chunkpilot.engine.core.step_clock import MIN_RATIOS, PRIOR_OVERRUN, RATIO_WINDOW, StepClock

from .fake_runner import FakeRunner, reference_output
from .test_scheduler import VOCAB, requests, run_to_end

CHAT = SLOClass("chat", 10, SLOTargets.p99(ttft=1.0, itl=0.1))
BATCH = SLOClass("batch", 0, SLOTargets.p99(ttft=60.0, itl=2.0))
SPARE = SLOClass("spare", -1, SLOTargets.p99(ttft=600.0), queue_limit=4)
CLASSES = SLOClasses((CHAT, BATCH, SPARE), "chat")


def make(classes=CLASSES, num_blocks=64, block_size=4, budget=16, max_chunk=8, max_num_seqs=4, prefix=False,
         max_model_len=512):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    knobs = KnobHolder(SchedulerKnobs(budget, max_chunk), min_token_budget=max_num_seqs)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_model_len, (), classes), bm, knobs)
    return sched, bm, knobs, FakeRunner(num_blocks * block_size, block_size, VOCAB)


def seq(rid, prompt, slo_class, max_tokens=5, arrival_time=0.0):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                    arrival_time=arrival_time, slo_class=slo_class)


def step(sched, runner):
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    return out


def train(sched, per_token=0.001, overhead=0.01, per_decode=0.002, per_kkey=0.0):
    """The step clock fed steps of a known cost: seconds = overhead + per_token x prompt tokens + per_decode x
    decodes + per_kkey x thousands of keys read; enough of them that it has measured its overrun (1: each step
    took what the fit predicts)."""
    for i in range(80):
        prompt, decodes, kv = (i % 5) * 40, i % 3, (i % 7) * 3.0
        sched.clock.add(prompt, decodes, kv, overhead + per_token * prompt + per_decode * decodes + per_kkey * kv)


def test_one_class_is_the_first_come_first_served_scheduler():
    sched, *_ = make(SLOClasses.implicit(SLOTargets.p99(ttft=1.0, itl=0.1)))
    assert not sched.by_class
    sched, *_ = make(None)
    assert not sched.by_class


def test_a_decode_without_an_itl_does_not_give_way_to_prompts():
    """A class with a TTFT and no ITL has no slack that runs out: were its decodes to wait while a higher class's
    prompts need the time, they would wait for as long as such prompts keep coming. They run while the step fits."""
    bulk = SLOClass("bulk", 0, SLOTargets.p99(ttft=60.0))
    bm = BlockManager(512, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(16, 2048, (), SLOClasses((CHAT, bulk), "chat")), bm,
                      KnobHolder(SchedulerKnobs(512, 512), min_token_budget=4), now=lambda: 0.0)
    runner = FakeRunner(512 * 4, 4, VOCAB)
    train(sched)
    ten = [seq(f"bulk{i}", range(10 + i, 14 + i), bulk, max_tokens=100) for i in range(10)]
    for s in (*ten, seq("chat", range(1, 4), CHAT, max_tokens=100)):
        sched.add(s)
    while not all(s.output_token_ids for s in ten):
        step(sched, runner)
    prompt = seq("chat-2", range(100, 400), CHAT)  # due at 1.0 on this clock: it can make it, it is not relegated
    sched.add(prompt)
    out = step(sched, runner)
    assert not prompt.relegated and out.num_decodes == 11 and out.num_prefill_tokens > 0
    run_to_end(sched, runner)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_higher_class_prompt_goes_first_then_the_earliest_deadline_then_the_shortest():
    sched, _, _, runner = make(budget=8, max_chunk=8, max_num_seqs=8)
    sched.add(seq("b-long", range(1, 30), BATCH, arrival_time=0.0))
    sched.add(seq("b-short", range(1, 6), BATCH, arrival_time=0.0))  # same deadline, shorter: first
    sched.add(seq("c-late", range(1, 10), CHAT, arrival_time=5.0))  # arrived last, its class first
    sched.add(seq("c-early", range(1, 10), CHAT, arrival_time=4.0))  # earlier deadline within chat
    out = step(sched, runner)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("c-early", 8)]
    out = step(sched, runner)
    assert [c.seq.request_id for c in out.chunks] == ["c-early", "c-late"]  # its last token, then the next
    run_to_end(sched, runner)


def test_the_tightest_running_itl_cuts_the_steps_prompt_chunks_and_then_the_arrival_cap_does():
    sched, _, _, runner = make(budget=512, max_chunk=512, max_num_seqs=8, num_blocks=512)
    train(sched)
    sched.add(seq("chat", range(1, 4), CHAT, max_tokens=50))
    step(sched, runner)  # chat's prompt: it decodes from now on
    sched.add(seq("batch", range(1, 400), BATCH))
    out = step(sched, runner)
    # 0.8 x 0.1 s = 0.08 s = 0.01 + 0.002 (one decode) + 0.001 x tokens -> 68 prompt tokens (the clock's overrun is
    # 1: the steps it was fed cost exactly what the model says)
    assert sched.clock.overrun() == pytest.approx(1.0, abs=1e-4)
    expected = int((ITL_SHARE * 0.1 / sched.clock.overrun() - 0.01 - 0.002) / 0.001 + 1e-9)
    assert out.num_decodes == 1 and out.num_prefill_tokens == expected, (out.num_prefill_tokens, expected)
    assert 67 <= expected <= 68  # (the fit's tiny ridge: a step predicted a few microseconds long)
    sched.abort("chat")
    out = step(sched, runner)  # no decode runs: the cap is a third of chat's 1-s TTFT
    arrival = int((1.0 / 3 / sched.clock.overrun() - 0.01) / 0.001 + 1e-9)
    assert out.num_prefill_tokens == min(512, 399 - expected, arrival) == arrival


def test_without_a_tight_decode_a_step_still_ends_within_a_third_of_the_tightest_ttft():
    """A chat request arriving mid-step waits for the step's end: with no decode to protect, a batch prompt's
    chunk is still cut to a third of the tightest non-sheddable TTFT (chat's 1 s), and without such a class not
    at all."""
    for classes, cap in ((CLASSES, 1.0 / 3), (SLOClasses((BATCH, SPARE), "batch"), 60.0 / 3),
                         (SLOClasses((SLOClass("a", 1, SLOTargets.p99(itl=2.0)), BATCH), "a"), 60.0 / 3),
                         (SLOClasses((SLOClass("a", 1, SLOTargets()), SPARE), "a"), None)):
        sched, _, _, runner = make(classes, budget=512, max_chunk=512, max_num_seqs=8, num_blocks=512,
                                   max_model_len=2048)
        train(sched)
        assert sched.arrival_step == cap
        sched.add(seq("long", range(1, 1000), classes.classes[0]))
        out = step(sched, runner)
        want = 512 if cap is None else min(512, int((cap - 0.01) / 0.001 + 1e-9))
        assert out.num_prefill_tokens == want, (classes.names, out.num_prefill_tokens, want)
    # decodes that take more than the cap leave the prompts half of it: sixty batch decodes at 5 ms (0.31 s with
    # the overhead) beside a third of a 1-s TTFT
    sched, _, _, runner = make(CLASSES, budget=512, max_chunk=512, max_num_seqs=80, num_blocks=1024,
                               max_model_len=2048)
    train(sched, per_decode=0.005)
    for i in range(60):
        sched.add(seq(f"b{i}", range(1 + i, 3 + i), BATCH, max_tokens=50))
    while sched.waiting or any(not s.is_decoding for s in sched.running):
        step(sched, runner)
    sched.add(seq("long", range(1, 1000), BATCH))
    out = step(sched, runner)
    assert out.num_decodes == 60 and out.num_prefill_tokens == int((1.0 / 3 / 2) / 0.001 + 1e-9)


def test_loose_decodes_wait_a_step_while_a_higher_classs_prompt_needs_the_time():
    """Chat decoding caps the step at 0.08 s; ten batch decodes would take 0.02 s of it and hold chat's next
    prompt to 48 tokens a step. They skip steps instead (their 2-s ITL allows it) until that prompt has its first
    token; one whose ITL slack runs out runs whatever the prompt needs. Without a chat prompt waiting they run."""
    now = [0.0]
    bm = BlockManager(512, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(16, 2048, (), CLASSES), bm,
                      KnobHolder(SchedulerKnobs(512, 512), min_token_budget=4), now=lambda: now[0])
    runner = FakeRunner(512 * 4, 4, VOCAB)
    train(sched)  # overhead 10 ms, a prompt token 1 ms, a decode 2 ms
    batch = [seq(f"b{i}", range(10 + i, 14 + i), BATCH, max_tokens=200) for i in range(10)]
    chat = seq("chat", range(1, 4), CHAT, max_tokens=200)
    for s in (*batch, chat):
        sched.add(s)
    while not all(s.output_token_ids for s in (*batch, chat)):
        step(sched, runner)
    out = step(sched, runner)  # nothing waits: every decode runs
    assert out.num_decodes == 11 and out.num_prefill_tokens == 0
    prompt = seq("chat-2", range(100, 400), CHAT, arrival_time=now[0])  # 300 tokens
    sched.add(prompt)
    out = step(sched, runner)
    ran = {c.seq.request_id for c in out.chunks[:out.num_decodes]}
    assert ran == {"chat"}, ran  # the batch decodes gave their time to chat's prompt
    assert out.num_prefill_tokens == int((ITL_SHARE * 0.1 / sched.clock.overrun() - 0.012) / 0.001
                                         + 1e-9)
    now[0] += ITL_SHARE * 2.0  # the batch decodes' ITL slack is gone: they run, and the prompt gets the rest
    out = step(sched, runner)
    assert out.num_decodes == 11
    assert out.num_prefill_tokens == int((ITL_SHARE * 0.1 / sched.clock.overrun() - 0.01 - 11 * 0.002)
                                         / 0.001 + 1e-9)
    while not prompt.output_token_ids:
        step(sched, runner)
    out = step(sched, runner)
    assert out.num_decodes == 12  # chat-2's prompt done: everyone runs again
    run_to_end(sched, runner)
    for s in (*batch, chat, prompt):
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens, VOCAB)
    assert bm.num_free_blocks == bm.num_blocks


def test_before_the_clock_knows_a_step_with_a_tight_decode_carries_few_prompt_tokens():
    sched, _, _, runner = make(budget=512, max_chunk=512, max_num_seqs=8, num_blocks=512)
    sched.add(seq("chat", range(1, 4), CHAT, max_tokens=50))
    step(sched, runner)
    sched.add(seq("batch", range(1, 400), BATCH))
    out = step(sched, runner)
    assert sched.clock.coefficients() is None and out.num_prefill_tokens == COLD_PROMPT_TOKENS
    for _ in range(3):
        sched.observe(out, 0.1)  # the step loop tells the clock what each step took
        out = step(sched, runner)
    assert out.num_prefill_tokens == COLD_PROMPT_TOKENS  # still too few steps to fit


def test_the_clock_knows_how_much_longer_than_predicted_its_prompt_steps_run():
    """Steps of a known cost, one prompt step in four running 1.5x long (a shared machine's hiccups grow with the
    step): the overrun is the ratio's upper quantile, 1.3-1.6 over a fit the long steps pull up by about a tenth; before
    MIN_RATIOS prompt steps it is the prior; once the long steps have left the window it is 1 again."""
    import random

    rng, clock = random.Random(0), StepClock()
    assert clock.overrun() == PRIOR_OVERRUN
    for i in range(400):
        p, d, kv = (i % 5) * 40, i % 3, (i % 7) * 3.0
        cost = 0.01 + 0.001 * p + 0.002 * d + 0.0005 * kv
        clock.add(p, d, kv, cost * (1.5 if p and rng.random() < 0.25 else 1.0))
    assert 1.3 < clock.overrun() < 1.6, clock.overrun()
    assert clock.coefficients()[1] == pytest.approx(0.001, rel=0.25)
    for i in range(RATIO_WINDOW * 2):  # the machine quiet again: the window forgets the long steps
        p, d, kv = (i % 5) * 40 + 40, i % 3, (i % 7) * 3.0
        clock.add(p, d, kv, 0.01 + 0.001 * p + 0.002 * d + 0.0005 * kv)
    assert clock.overrun() < 1.05
    assert MIN_RATIOS <= RATIO_WINDOW
    for i in range(MIN_RATIOS * 2):  # steps of drafts only (no prompt chunk the scheduler sized): not judged
        clock.add(4, 1, 0.0, 3 * (0.01 + 0.004 + 0.002), judged=False)
    assert clock.overrun() < 1.05


def test_a_clock_that_overruns_sizes_the_steps_prompt_chunk_shorter():
    """The same chat decode and batch prompt as above, the clock's steps having run 1.5x their prediction: the
    step's predicted time is 0.08 s / 1.5, so its chunk is about 41 tokens, not 68."""
    sched, _, _, runner = make(budget=512, max_chunk=512, max_num_seqs=8, num_blocks=512)
    for i in range(80):
        prompt, decodes = (i % 5) * 40, i % 3
        sched.clock.add(prompt, decodes, 0.0, (0.01 + 0.001 * prompt + 0.002 * decodes) * (1.5 if i >= 40 else 1.0))
    overrun = sched.clock.overrun()
    assert overrun > 1.2, overrun
    sched.add(seq("chat", range(1, 4), CHAT, max_tokens=50))
    step(sched, runner)
    sched.add(seq("batch", range(1, 400), BATCH))
    out = step(sched, runner)
    predicted = sched.clock.base_seconds(1, 0.0) + sched.clock.chunk_seconds(0, out.num_prefill_tokens)
    longer = sched.clock.base_seconds(1, 0.0) + sched.clock.chunk_seconds(0, out.num_prefill_tokens + 1)
    assert out.num_decodes == 1 and predicted * overrun <= ITL_SHARE * 0.1 + 1e-9 < longer * overrun, \
        (out.num_prefill_tokens, predicted, overrun)
    sched.abort("chat")
    out = step(sched, runner)  # no decode: the arrival cap, a third of chat's 1-s TTFT, over the overrun too
    (chunk,) = out.chunks
    cap, base = 1.0 / 3 / overrun, sched.clock.base_seconds(0, 0.0)
    assert chunk.num_tokens < 399 - chunk.start  # the cap cut it, not the prompt's end
    assert base + sched.clock.chunk_seconds(chunk.start, chunk.num_tokens) <= cap + 1e-9 \
        < base + sched.clock.chunk_seconds(chunk.start, chunk.num_tokens + 1), (chunk.num_tokens, overrun)


def test_without_classes_the_clock_is_not_fed():
    """Nothing reads the clock without classes (the simulator replays thousands of steps a trial without them)."""
    for classes in (None, SLOClasses.implicit(SLOTargets.p99(ttft=1.0, itl=0.1))):
        sched, _, _, runner = make(classes, budget=64, max_chunk=64)
        sched.add(seq("a", range(1, 100), None, max_tokens=3))
        for _ in range(4):
            sched.observe(step(sched, runner), 0.1)
        assert sched.clock.steps == 0
    sched, _, _, runner = make(budget=64, max_chunk=64)  # with classes it is
    sched.add(seq("a", range(1, 100), CHAT, max_tokens=3))
    sched.observe(step(sched, runner), 0.1)
    assert sched.clock.steps == 1


def test_a_chunk_deep_in_a_long_prompt_is_cut_for_the_keys_it_reads():
    """Attention: a chunk at position p reads p keys a token, so the same time holds fewer tokens deeper in."""
    sched, _, _, _ = make(budget=512, max_chunk=512, max_num_seqs=8, num_blocks=512)
    train(sched, per_kkey=0.0005)
    shallow, deep = sched.clock.chunk_tokens_within(0.05, 0), sched.clock.chunk_tokens_within(0.05, 2000)
    assert shallow > 0 and deep < shallow
    for start, n in ((0, shallow), (2000, deep)):  # the longest chunk within the time, one more is over it
        assert sched.clock.chunk_seconds(start, n) <= 0.05 + 1e-9 < sched.clock.chunk_seconds(start, n + 1)


def test_loose_decodes_skip_steps_the_tight_itl_cannot_afford_and_none_waits_past_its_own():
    """Twelve batch decodes (ITL 2 s) and one chat decode (ITL 0.1 s): a step with all of them would take
    0.01 + 13 x 0.01 = 0.14 s, over 0.8 x 0.1 s; so chat decodes every step and the batch decodes take turns, each
    at least once within its own ITL. The clock is virtual: each step takes what the step clock says."""
    t = [0.0]
    bm = BlockManager(512, 4, enable_prefix_caching=False)
    knobs = KnobHolder(SchedulerKnobs(64, 64), min_token_budget=16)
    sched = Scheduler(SchedulerConfig(16, 512, (), CLASSES), bm, knobs, now=lambda: t[0])
    runner = FakeRunner(512 * 4, 4, VOCAB)
    train(sched, per_decode=0.01)
    batch = [seq(f"b{i}", range(1 + i, 5 + i), BATCH, max_tokens=200) for i in range(12)]
    chat = seq("c", range(1, 5), CHAT, max_tokens=60)
    for s in [*batch, chat]:
        sched.add(s)
    last = {s.request_id: 0.0 for s in [*batch, chat]}
    longest = {s.request_id: 0.0 for s in [*batch, chat]}
    skipped = 0
    for _ in range(60):
        decoding = sum(1 for s in sched.running if s.is_decoding)
        out = sched.schedule()
        skipped += decoding - out.num_decodes
        took = sched.clock.base_seconds(out.num_decodes, 0.0) + sched.clock.chunk_seconds(0, out.num_prefill_tokens)
        t[0] += took
        for s in sched.update(out, runner.execute(out)):
            longest[s.request_id] = max(longest[s.request_id], t[0] - last[s.request_id])
            last[s.request_id] = t[0]
        if out.num_prefill_tokens == 0:  # every prompt done: from here every step is decodes alone
            assert took <= ITL_SHARE * 0.1 + 1e-9, took
            assert "c" in {c.seq.request_id for c in out.chunks}
    assert skipped > 0  # the batch decodes did take turns
    assert longest["c"] <= 0.1, longest["c"]
    assert max(v for k, v in longest.items() if k != "c") <= 2.0 * ITL_SHARE, longest
    for s in [*batch, chat]:  # skipping steps changes no output
        n = len(s.output_token_ids)
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens, VOCAB)[:n]


def test_a_class_share_is_kept_under_contention_and_the_rest_is_not_wasted():
    shared = SLOClasses((CHAT, SLOClass("batch", 0, SLOTargets.p99(ttft=60.0), share=0.25)), "chat")
    sched, _, _, runner = make(shared, budget=16, max_chunk=16, max_num_seqs=8, num_blocks=256)
    sched.add(seq("c", range(1, 100), CHAT))
    sched.add(seq("b", range(1, 100), shared.get("batch")))
    out = step(sched, runner)
    got = {c.seq.request_id: c.num_tokens for c in out.chunks}
    assert got == {"c": 12, "b": 4}  # a quarter kept for batch, chat first in the rest
    sched.abort("c")
    out = step(sched, runner)
    assert {c.seq.request_id: c.num_tokens for c in out.chunks} == {"b": 16}  # alone: the whole budget


def test_a_full_engine_makes_room_for_a_higher_class_and_the_victim_never_preempts_back():
    sched, bm, _, runner = make(budget=16, max_chunk=8, max_num_seqs=2, num_blocks=64)
    batch = [seq(f"b{i}", range(1 + i, 9 + i), BATCH, max_tokens=40) for i in range(2)]
    for s in batch:
        sched.add(s)
    for _ in range(6):
        step(sched, runner)  # both decoding, every slot taken
    # b0 and b1 have the same KV sunk: the newest of the lowest class goes
    chat = seq("c", range(1, 9), CHAT, max_tokens=20, arrival_time=1.0)
    sched.add(chat)
    out = step(sched, runner)
    assert out.preempted == ["b1"] and chat in sched.running
    run_to_end(sched, runner)
    assert chat.num_preemptions == 0 and sched.num_preemptions == 1  # no ping-pong
    for s in [*batch, chat]:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens, VOCAB)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_lower_class_never_preempts_a_higher_one_for_kv():
    # 10 blocks of 4: a chat sequence and a batch sequence growing to 36 tokens each cannot both fit
    sched, bm, _, runner = make(budget=8, max_chunk=8, max_num_seqs=2, num_blocks=10)
    chat = seq("c", range(1, 9), CHAT, max_tokens=28, arrival_time=1.0)
    batch = seq("b", range(2, 10), BATCH, max_tokens=28, arrival_time=0.0)  # older: FCFS would keep it
    sched.add(batch)
    sched.add(chat)
    run_to_end(sched, runner)
    assert chat.num_preemptions == 0 and batch.num_preemptions > 0
    for s in (chat, batch):
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 28, VOCAB)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_prompt_that_cannot_make_its_deadline_is_relegated_behind_those_that_can():
    """Earliest deadline first would serve the hopeless request first and make the ones behind it late too: a
    prompt that cannot make its TTFT deadline even if it ran now, alone, goes after every one of its class that
    still can, and is relegated for good, but before the classes below (behind every batch prompt, a relegated
    interactive one waited 116 s); a sheddable one never is (it has no deadline to protect)."""
    now = [100.0]
    bm = BlockManager(512, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(8, 2048, (), CLASSES), bm, KnobHolder(SchedulerKnobs(8, 8), min_token_budget=4),
                      now=lambda: now[0])
    runner = FakeRunner(512 * 4, 4, VOCAB)
    train(sched)  # a prompt token costs 1 ms
    late = seq("late", range(1, 10), CHAT, arrival_time=98.5)  # due at 99.5: past
    hopeless = seq("hopeless", range(2, 1002), CHAT, arrival_time=99.5)  # due at 100.5; its 1,000 tokens: 1 s
    fresh = seq("fresh", range(3, 12), CHAT, arrival_time=99.9)  # due at 100.9
    batch = seq("batch", range(4, 13), BATCH, arrival_time=50.0)  # due at 110
    spare = seq("spare", range(5, 14), SPARE, arrival_time=-900.0)  # past its 600 s: sheddable, never relegated
    for s in (late, hopeless, fresh, batch, spare):
        sched.add(s)
    order = []  # in the order their first tokens came
    while len(order) < 5:
        step(sched, runner)
        order += [s.request_id for s in (late, hopeless, fresh, batch, spare)
                  if s.output_token_ids and s.request_id not in order]
    assert order == ["fresh", "late", "hopeless", "batch", "spare"], order  # sheddable work was promised nothing
    assert late.relegated and hopeless.relegated
    assert not any(s.relegated for s in (fresh, batch, spare))
    run_to_end(sched, runner)
    for s in (late, hopeless, fresh, batch, spare):  # outputs exact, nothing leaked
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens, VOCAB)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_prompt_whose_prefix_is_cached_is_judged_by_what_is_left_to_compute():
    now = [100.0]
    bm = BlockManager(512, 4)
    sched = Scheduler(SchedulerConfig(8, 2048, (), CLASSES), bm, KnobHolder(SchedulerKnobs(64, 64), min_token_budget=4),
                      now=lambda: now[0])
    runner = FakeRunner(512 * 4, 4, VOCAB)
    train(sched)  # a prompt token costs 1 ms: 1,000 tokens 1 s
    sched.add(seq("first", range(1, 1001), BATCH, max_tokens=1, arrival_time=99.0))
    run_to_end(sched, runner)  # its blocks stay in the prefix cache
    again = seq("again", [*range(1, 1001), 7, 8], CHAT, arrival_time=99.6)  # due at 100.6: 0.6 s for 2 new tokens
    cold = seq("cold", range(3, 1003), CHAT, arrival_time=99.6)  # the same 0.6 s for 1,000 tokens: a sure miss
    sched.add(again)
    sched.add(cold)
    step(sched, runner)
    assert not again.relegated and cold.relegated
    run_to_end(sched, runner)


CLASS_LIST = [CHAT, BATCH, SPARE, SLOClass("bulk", 0, SLOTargets(), share=0.3)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    classes=st.lists(st.integers(0, 3), min_size=16, max_size=16),
    block_size=st.integers(1, 8),
    num_blocks=st.integers(24, 80),
    max_num_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 24),
    chunk_frac=st.floats(0.05, 1.0),
    prefix=st.booleans(),
    clock=st.booleans(),
)
def test_properties_with_classes(reqs, classes, block_size, num_blocks, max_num_seqs, budget_extra, chunk_frac,
                                 prefix, clock):
    """The first-come-first-served scheduler's properties hold with classes: within the budget and the chunk,
    every decode its token each step (unless preempted), every output exact, nothing leaked; and no sequence is
    preempted by one of a lower class."""
    num_blocks = max(num_blocks, -(-64 // block_size))  # the pool holds one max-length sequence
    budget = max_num_seqs + budget_extra
    all_classes = SLOClasses(tuple(CLASS_LIST), "chat")
    sched, bm, _, runner = make(all_classes, num_blocks=num_blocks, block_size=block_size, budget=budget,
                                max_chunk=max(1, int(budget * chunk_frac)), max_num_seqs=max_num_seqs,
                                prefix=prefix, max_model_len=64)
    if clock:
        train(sched, per_token=0.004)  # the chat ITL allows about 15 prompt tokens a step
    seqs = [seq(f"r{i}", p, CLASS_LIST[classes[i % len(classes)]], max_tokens=m, arrival_time=float(a))
            for i, (p, m, a) in enumerate(reqs)]
    arrivals = {i: a for i, (_, _, a) in enumerate(reqs)}

    def check(out, decoding_before):
        k = out.knobs
        assert out.num_tokens <= k.token_budget
        assert all(c.num_tokens <= k.max_chunk for c in out.chunks)
        assert len(sched.running) <= max_num_seqs
        scheduled = {c.seq.request_id for c in out.chunks}
        for s in decoding_before:
            assert s.request_id in scheduled or s.request_id in out.preempted
        for c in out.chunks[: out.num_decodes]:
            assert c.num_tokens == 1
        top = max((s.priority for s in sched.running), default=None)
        for rid in out.preempted:  # a victim is never above everyone still running
            victim = next(s for s in seqs if s.request_id == rid)
            assert top is None or victim.priority <= top

    def on_step(n):
        for i, s in enumerate(seqs):
            if arrivals[i] == n:
                sched.add(s)

    for i, s in enumerate(seqs):
        if arrivals[i] == 0:
            sched.add(s)
    run_to_end(sched, runner, check=check, on_step=on_step)
    for i, s in enumerate(seqs):
        if not s.output_token_ids and s not in sched.waiting and not s.is_finished:
            sched.add(s)
    run_to_end(sched, runner, check=check)
    for s in seqs:
        ref = reference_output(s.prompt_token_ids, s.params.max_tokens, VOCAB)[: 64 - len(s.prompt_token_ids)]
        assert s.output_token_ids == ref, s.request_id
    assert bm.num_free_blocks == bm.num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)
