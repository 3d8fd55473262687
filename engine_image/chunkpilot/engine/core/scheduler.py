"""Sarathi-Serve style stall-free scheduler.

Each step: one token for every running decode first, then the rest of `token_budget` on prefill chunks of at most
`max_chunk` tokens, first come first served; a prompt that does not fit continues next step. When KV blocks run
out, the newest running sequence is preempted and later recomputed (vLLM's recompute policy).

With speculative decoding on (speculation/speculative.py), a decode may carry draft tokens. The scheduler does not
draft: after a step the engine asks `draft_requests()` which decodes may draft next step and how many tokens each at
most, has the proposer guess them, and hands the guesses back with `update_draft_token_ids()` (as vLLM's scheduler
is handed its drafts). The next `schedule()` only budgets what it was handed: drafts come out of the budget left
after every decode has its one token and before any prompt chunk, so the stall-free rule holds (decodes first, each
at least one token, the step within its budget); a decode with k drafts costs 1 + k tokens, and its drafts are cut
to what the budget leaves. Drafts never preempt anyone: their KV blocks are taken last, after the prompts' chunks
have theirs, and a decode keeps only the drafts that fit in what is left. After the step the sequence keeps the
drafts the sampler accepted and one token of the model's own, and gives back the blocks only rejected drafts used.

With per-request SLO classes (config.classes, docs/slo-classes.md) the step is composed by class: decodes of the
higher classes get KV blocks first; the prompt chunks a step carries are cut so the step ends within a share of the
tightest ITL among the running decodes (the step clock's fit of this engine's own steps, attention included),
never above the knobs; prompt chunks, those running and those waiting alike, go by class priority, then the earliest TTFT deadline,
then the shortest remaining prefill, after each class's guaranteed share; a waiting prompt may preempt a running
sequence only of a strictly lower class (the lowest, the least KV sunk), so two classes never preempt each other
back and forth. With one class (or none) the step is exactly the first-come-first-served step above.

The scheduler never touches tensors nor runs a proposer. It hands the runner a `SchedulerOutput` and takes back a
`RunnerOutput`, so tests and the simulator drive it without a model.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from chunkpilot.contract.step_cost import kv_kilotokens
from chunkpilot.engine.config import SchedulerConfig
from chunkpilot.engine.core.block_manager import BlockManager
from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from chunkpilot.engine.core.step_clock import StepClock


# A verification token costs about a fifth of a batch-1 decode step on the CPU (measured: 5 tokens of SmolLM2
# at 1.75x one token's step time), so drafts pay while the model keeps more than that share of them. A sequence
# whose recent drafts fall below the step's threshold drafts nothing for a pause of decode steps, then tries again
# (its text may have reached a part that quotes the prompt); each failed try doubles the pause, a kept one resets
# it: a text that never repeats costs a few tries, one that starts repeating late is found again soon. The
# threshold is MIN_ACCEPTANCE or, where higher, the break-even acceptance of the step's batch that the engine
# measures (speculation/draft_cost.py; larger batches need more kept drafts to pay for their rows).
MIN_ACCEPTANCE = 0.3  # 0.25 and 0.4 measured alike at batch 1 (bench/speculative.py)
DRAFT_PAUSES = (4, 32)  # the first pause and the longest
ACCEPTANCE_WEIGHT = 0.5  # of the newest step in the moving average
# With SLO classes, a step may take this share of the tightest running decode's ITL threshold, as the step clock
# predicts it times the clock's overrun (how much longer than predicted recent prompt steps ran): the rest is the
# step loop's own time between steps. (At 0.8 alone, on the shared 2-core CPU, steps aimed at 0.4 s for a 0.5-s ITL
# overran it in ~1 request in 7 at 0.6/s; with twice the fit's residual spread subtracted, an absolute margin, steps
# 30-40 % over their prediction still missed.)
ITL_SHARE = 0.8
# Until the step clock has seen enough steps to fit (step_clock.MIN_STEPS), a step with a decode that has an ITL
# carries at most this many prompt tokens: small enough for any ITL a CPU keeps (about 0.12 s with SmolLM2), and
# prompt steps of some size for the fit. Without it the first seconds of a run missed (a 512-token chunk: 0.9 s).
COLD_PROMPT_TOKENS = 64
# With SLO classes, a step's prompt chunks end within this share of the tightest TTFT threshold among the
# non-sheddable classes, as the step clock predicts it times its overrun, even with no decode to protect (prompts
# keep at least half of it, whatever the decodes take): a request arriving mid-step waits for the step's end, and
# a 512-token chunk deep in a batch prompt took 1.3-1.7 s on the 2-core CPU, half of a 3-s TTFT gone before it was
# seen (one such request missed by 0.2 s). Two shorter steps cost one more step's overhead (~0.05 s here).
ARRIVAL_SHARE = 1 / 3


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step (= tokens already in the cache)
    num_tokens: int  # draft tokens included
    draft_token_ids: list[int] = field(default_factory=list)  # proposed to follow the sequence's last token

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == len(self.seq)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    knobs: SchedulerKnobs
    num_decodes: int = 0
    preempted: list[str] = field(default_factory=list)
    # the proposer's time for this step's drafts (a draft model's forwards, run after the step before): part of
    # what drafting costs this step
    draft_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft_token_ids) for c in self.chunks[: self.num_decodes])

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes - self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id -> new token, for every chunk that samples (without drafts)
    # request_id -> the accepted drafts and one token of the model's own, for every decode with drafts
    verified: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, knobs: KnobHolder,
                 num_speculative_tokens: int = 0, disable_drafts_above: int | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.now = now  # the clock of tokens' times (the simulator's is virtual)
        self.block_manager = block_manager
        self.knobs = knobs
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_drafts_above = disable_drafts_above
        # request_id -> the drafts handed in for the next step, and the proposer's time for them; one step's only
        self._drafts: dict[str, list[int]] = {}
        self._draft_seconds = 0.0
        # the share of a sequence's drafts that must be kept for it to go on drafting, for the step being
        # verified; the engine raises it to the step's measured break-even (speculation/draft_cost.py)
        self.min_acceptance = MIN_ACCEPTANCE
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self.num_preemptions = 0
        classes = config.classes
        self.by_class = classes is not None and not classes.is_implicit
        ttfts = [c.slo.ttft.threshold for c in classes.classes if not c.sheddable and c.slo.ttft is not None] \
            if self.by_class else []
        self.arrival_step = ARRIVAL_SHARE * min(ttfts) if ttfts else None  # seconds; None: no cap
        self.clock = StepClock()  # fed by the step loop (observe); read only with classes

    # ---- requests ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if not seq.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(seq.prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(seq.prompt_token_ids)} tokens but the model's max length is "
                f"{self.config.max_model_len} (prompt + at least one new token): shorten the prompt"
            )
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt another engine computed (disaggregation, decode role): it already holds blocks
        with every prompt token's K/V and its first token, so it joins the running decodes directly."""
        if seq.num_computed_tokens != len(seq.prompt_token_ids) or len(seq.output_token_ids) != 1:
            raise RuntimeError(f"sequence {seq.request_id} is not a prefilled prompt with its first token")
        self.block_manager.commit(seq)  # its full blocks are verified now: others may share them
        seq.status = SequenceStatus.RUNNING
        seq.last_token_time = self.now()  # its first token is here: its ITL slack runs from now
        self.running.append(seq)

    @property
    def has_room(self) -> bool:
        """Another sequence may run now (max_num_seqs)."""
        return len(self.running) < self.config.max_num_seqs

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                self._finish(seq, FinishReason.ABORT)
                return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a sequence for a reason found outside (a stop string seen by the detokenizer)."""
        if not seq.is_finished:
            self._finish(seq, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        knobs = self.knobs.get()  # one snapshot per step: a knob change lands exactly at a step boundary
        bm = self.block_manager
        budget = knobs.token_budget
        out = SchedulerOutput(chunks=[], knobs=knobs)
        scheduled: set[int] = set()

        if self.by_class:
            self._slot_for_a_higher_class(out)
        made_room = len(out.preempted)  # preempted for a higher class's admission, not for want of KV
        # 1. One token for every running decode, oldest first (with classes, the higher classes first); free blocks
        #    by preempting the newest (with classes, of the lowest class, never a higher one).
        # with classes, the prompt candidates once a step (relegation hashes a prompt near its deadline): the decodes
        # keep room for them, then they get the step's prompt chunks
        prompts = self._prompt_candidates() if self.by_class else []
        decoding = self._decodes_this_step(prompts, knobs) if self.by_class else list(self.running)
        for seq in decoding:
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            if not self._reserve(seq, 1, out, scheduled):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            scheduled.add(id(seq))
            budget -= 1
        drafts, self._drafts = self._drafts, {}
        out.draft_seconds, self._draft_seconds = self._draft_seconds, 0.0
        if self.num_speculative_tokens > 0 and budget > 0:
            budget -= self._take_drafts(out.chunks, budget, drafts)
        out.num_decodes = len(out.chunks)
        decodes = list(out.chunks)
        if self.by_class:
            time_left = self._prompt_time(decodes)
            if self.arrival_step is not None and self.clock.coefficients() is not None:
                base = self.clock.base_seconds(len(decodes), sum(kv_kilotokens(c.start, c.num_tokens)
                                                                 for c in decodes))
                # decodes are never cut for it: whatever they take, prompts keep at least half the cap
                cap = self.arrival_step / self.clock.overrun()  # as the clock predicts: steps may run longer
                arrival = max(cap - base, cap / 2)
                time_left = arrival if time_left is None else min(time_left, arrival)
            if time_left is not None and self.clock.coefficients() is None:  # a deadline, no clock yet
                budget, time_left = min(budget, COLD_PROMPT_TOKENS), None
            self._prompts_by_class(prompts, out, scheduled, budget, knobs, time_left,
                                   admitting=len(out.preempted) == made_room)
            if not out.chunks and self.running and len(self.running) > 1:
                self._preempt(self._victim(scheduled, None) or self.running[-1], out)
            if self.num_speculative_tokens > 0:
                self._place_drafts(decodes)
            return out

        # 2. Continue prompts already running (chunked), oldest first.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or id(seq) in scheduled:
                continue
            n = self._continue_chunk(seq, min(seq.num_uncomputed, knobs.max_chunk, budget), out, scheduled)
            if n <= 0:
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(id(seq))
            budget -= n

        # 3. Admit waiting prompts, first come first served; none after a preemption (the pool is tight).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, knobs.max_chunk, budget)
            if not bm.allocate_prompt(seq, n):
                break
            self.waiting.popleft()
            # The prefix cache may have covered part of the prompt: recompute the chunk from what is left.
            n = min(seq.num_uncomputed, knobs.max_chunk, budget)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(id(seq))
            budget -= n

        # 4. Nothing fit at all although sequences are running: the pool is full of partial prompts.
        #    Preempting the newest guarantees the oldest can finish (the pool holds one max-length sequence).
        if not out.chunks and self.running and len(self.running) > 1:
            self._preempt(self.running[-1], out)
        if self.num_speculative_tokens > 0:
            self._place_drafts(decodes)
        return out

    # ---- per-request SLO classes ---------------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's time, for the step clock (the step loop and the simulator call it after every step). Without
        classes nothing reads the clock, so it is not fed (the simulator replays thousands of steps a trial)."""
        if not self.by_class:
            return
        kv = sum(kv_kilotokens(c.start, c.num_tokens) for c in sched.chunks)
        self.clock.add(sched.num_prefill_tokens + sched.num_draft_tokens, sched.num_decodes, kv, seconds,
                       judged=sched.num_prefill_tokens > 0)  # its overrun: the steps sized for prompt chunks

    def _decodes_this_step(self, prompts: list[Sequence], knobs: SchedulerKnobs) -> list[Sequence]:
        """With classes, the running decodes this step carries, higher classes first: all of them while their
        step fits the tightest ITL with room for the prompt work of classes above theirs (`prompts`: the prompt
        candidates, relegated ones marked); else the tightest class's and every decode that cannot wait another
        step, then the others least slack first while the step still fits with that room. A batch decode with
        seconds of ITL slack skips a few steps rather than make every interactive gap long, or hold an interactive
        prompt to a few dozen tokens a step (13 decodes took 0.2 s of a 0.33-s step on the 2-core CPU; the
        interactive prompts behind them queued past their TTFT)."""
        decoding = sorted((s for s in self.running if s.status is SequenceStatus.RUNNING and s.is_decoding),
                          key=lambda q: -q.priority)
        itls = [(s, s.slo_class.slo.itl.threshold) for s in decoding
                if s.slo_class is not None and s.slo_class.slo.itl is not None]
        if not itls or self.clock.coefficients() is None:
            return decoding
        step = self._step_limit(min(t for _, t in itls))  # the longest step the tightest decode allows
        kv = {id(s): kv_kilotokens(s.num_computed_tokens, 1) for s in decoding}

        def base(seqs: list[Sequence]) -> float:
            return self.clock.base_seconds(len(seqs), sum(kv[id(x)] for x in seqs))

        room = self._prompt_room(prompts, {s.priority for s in decoding}, knobs)
        if base(decoding) + room[min(s.priority for s in decoding)] <= step:
            return decoding
        now = self.now()

        def slack(s: Sequence) -> float:
            """Seconds this decode may still wait for its next token (infinite without an ITL)."""
            c = s.slo_class
            if c is None or c.slo.itl is None or s.last_token_time is None:
                return math.inf
            return ITL_SHARE * c.slo.itl.threshold - (now - s.last_token_time)

        # a decode that could not wait two more steps runs: as they really take (the prediction times the overrun)
        must = [s for s in decoding if slack(s) < 2 * step * self.clock.overrun()]  # the tightest class always
        chosen, ids = list(must), {id(s) for s in must}
        # higher classes first, so a lower class's decode never takes the room kept for a middle class's prompts; a
        # decode without an ITL (or no token time yet) has no slack to run out, so it does not give way to prompts
        # (it would wait for as long as they keep coming), only to a step that does not fit
        for s in sorted((s for s in decoding if id(s) not in ids), key=lambda q: (-q.priority, slack(q))):
            if base([*chosen, s]) + (room[s.priority] if math.isfinite(slack(s)) else 0.0) <= step:
                chosen.append(s)
        return sorted(chosen, key=lambda q: -q.priority)

    def _prompt_candidates(self) -> list[Sequence]:
        """The prompts that may get a chunk this step (running ones without their first token, then the waiting),
        in prompt order (_order), with the hopeless ones relegated first. Taken before the decodes: one that a
        decode's preemption puts back in the queue this step is not among them, and waits for the next."""
        candidates = [s for s in self.running if s.status is SequenceStatus.RUNNING and not s.is_decoding] \
            + list(self.waiting)
        self._relegate(candidates)
        candidates.sort(key=self._order)
        return candidates

    def _prompt_room(self, prompts: list[Sequence], priorities: set[int], knobs: SchedulerKnobs
                     ) -> dict[int, float]:
        """For each decode priority, the seconds a step should keep for the prompt work of the classes above it
        that can still make their TTFT: one chunk each (max_chunk), at most the token budget in all."""
        room = {}
        promised = [q for q in prompts if not q.relegated and math.isfinite(q.ttft_deadline)]  # in _order already
        for p in priorities:
            tokens, seconds = knobs.token_budget, 0.0
            for seq in (q for q in promised if q.priority > p):
                n = min(seq.num_uncomputed, knobs.max_chunk, tokens)
                if n <= 0:
                    break
                seconds += self.clock.chunk_seconds(seq.num_computed_tokens, n)
                tokens -= n
            room[p] = seconds
        return room

    def _prompt_time(self, decodes: list[ScheduledChunk]) -> float | None:
        """Seconds this step may spend on prompt chunks so it ends within ITL_SHARE of the tightest ITL threshold
        among its decodes; None: no decode with an ITL."""
        itl = min((c.seq.slo_class.slo.itl.threshold for c in decodes
                   if c.seq.slo_class is not None and c.seq.slo_class.slo.itl is not None), default=None)
        if itl is None:
            return None
        base = self.clock.base_seconds(len(decodes), sum(kv_kilotokens(c.start, c.num_tokens) for c in decodes))
        if base is None:
            return ITL_SHARE * itl  # the clock does not know yet (schedule() caps the tokens instead)
        drafts = sum(self.clock.chunk_seconds(c.start + 1, len(c.draft_token_ids)) for c in decodes)
        return self._step_limit(itl) - base - drafts

    def _step_limit(self, itl: float) -> float:
        """The longest step a decode with ITL threshold `itl` allows, as the clock predicts steps (a step the clock
        predicts at this may run its overrun longer)."""
        return ITL_SHARE * itl / self.clock.overrun()

    @staticmethod
    def _order(seq: Sequence) -> tuple:
        """Prompt order with classes: by class, the sheddable ones last; within a class, the prompts that can still
        make their TTFT deadline, then the relegated ones (a late request must not make the ones behind it late
        too); then the TTFT deadline, the shortest remaining prefill, arrival. A relegated request still goes
        before the classes below its own: behind every batch prompt, an interactive one relegated at 1.2 req/s
        waited 116 s for its first token."""
        return (-seq.priority, int(seq.relegated), seq.ttft_deadline, seq.num_uncomputed, seq.arrival)

    def _relegate(self, candidates: list[Sequence]) -> None:
        """Relegate the non-sheddable prompts without a first token that cannot make their TTFT deadline even if
        their whole remaining prompt ran now, alone (the clock's cost of its chunks, no overhead, no decodes: an
        optimistic time, so a request is relegated only when it will surely miss). Earliest-deadline-first would
        otherwise serve the hopeless one first and make the ones behind it late too (Niyama's relegation)."""
        now = self.now()
        for seq in candidates:
            c = seq.slo_class
            if (seq.relegated or seq.output_token_ids or c is None or c.sheddable or c.slo.ttft is None):
                continue
            if now + self.clock.chunk_seconds(seq.num_computed_tokens, seq.num_uncomputed) <= seq.ttft_deadline:
                continue
            if now < seq.ttft_deadline and not seq.block_table:
                # a waiting prompt has computed nothing yet, but its prefix may be cached: only what is not counts
                # (looked up only here, for the few near their deadline: hashing every prompt each step would cost)
                cached = len(self.block_manager.match_prefix(seq.token_ids, seq.cache_salt))
                start = cached * self.block_manager.block_size
                if now + self.clock.chunk_seconds(start, len(seq) - start) <= seq.ttft_deadline:
                    continue
            seq.relegated = True

    def _prompts_by_class(self, candidates: list[Sequence], out: SchedulerOutput, scheduled: set[int], budget: int,
                          knobs: SchedulerKnobs, time_left: float | None, admitting: bool) -> None:
        """Steps 2 and 3 with classes: the prompt candidates (running and waiting, in _order); first each class's
        share of the step's prompt tokens is kept for it while it has prompt work, then what is left goes in order
        to anyone (work-conserving)."""
        if not candidates or budget <= 0:
            return
        reserved: dict[str, int] = {}
        for seq in candidates:
            c = seq.slo_class
            if c is not None and c.share > 0 and c.name not in reserved:
                reserved[c.name] = math.floor(budget * c.share)
        # admitting: False after a decode's preemption for KV this step (the pool is tight: no admissions)
        for keep_shares in (True, False):
            for seq in candidates:
                if budget <= 0:
                    return
                if id(seq) in scheduled or seq.request_id in out.preempted:
                    continue
                name = seq.slo_class.name if seq.slo_class is not None else ""
                room = budget - (sum(v for k, v in reserved.items() if k != name) if keep_shares else 0)
                if time_left is not None:  # within the tightest decode's ITL and the arrival cap
                    fits = self.clock.chunk_tokens_within(time_left, seq.num_computed_tokens)
                    room = room if fits is None else min(room, fits)
                if room <= 0:
                    continue
                if seq.status is SequenceStatus.WAITING:
                    if not admitting:
                        continue
                    n = self._admit_by_class(seq, min(seq.num_uncomputed, knobs.max_chunk, room), out, scheduled)
                    if n is None:
                        admitting = False  # nobody overtakes a prompt that did not fit, within its class or below
                        continue
                    n = min(seq.num_uncomputed, knobs.max_chunk, room)  # the prefix cache may have covered some
                else:
                    n = self._continue_chunk(seq, min(seq.num_uncomputed, knobs.max_chunk, room), out, scheduled)
                    if n <= 0:
                        continue
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                scheduled.add(id(seq))
                budget -= n
                if time_left is not None:
                    time_left -= self.clock.chunk_seconds(seq.num_computed_tokens, n)
                if name in reserved:
                    reserved[name] = max(0, reserved[name] - n)

    def _slot_for_a_higher_class(self, out: SchedulerOutput) -> None:
        """Every sequence slot is taken and the first waiting prompt's class is above a running one's: that one
        gives its slot (one a step; it waits with its own deadline, ahead of its class)."""
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        first = min(self.waiting, key=self._order)
        victim = self._victim(set(), first, strictly_lower=True)
        if victim is not None:
            self._preempt(victim, out)

    def _admit_by_class(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> int | None:
        """Admit a waiting prompt, preempting running sequences of strictly lower classes for a sequence slot and
        for KV blocks if need be; None when it does not fit."""
        while len(self.running) >= self.config.max_num_seqs or not self.block_manager.allocate_prompt(seq, n):
            victim = self._victim(scheduled, seq, strictly_lower=True)
            if victim is None:
                return None
            self._preempt(victim, out)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _victim(self, scheduled: set[int], for_seq: Sequence | None, strictly_lower: bool = False
                ) -> Sequence | None:
        """With classes, whom to preempt for `for_seq`: a running sequence not scheduled this step, of the lowest
        class, never of a class above `for_seq`'s (strictly below it when `strictly_lower`); below its class the
        one with the least KV sunk (cheapest to recompute), within its class the newest (as without classes)."""
        floor = for_seq.priority if for_seq is not None else math.inf
        pool = [s for s in self.running if id(s) not in scheduled
                and (s.priority < floor if strictly_lower else s.priority <= floor)]
        if not pool:
            return None
        lowest = min(s.priority for s in pool)
        pool = [s for s in pool if s.priority == lowest]
        if for_seq is not None and lowest < for_seq.priority:
            return min(pool, key=lambda s: (s.num_computed_tokens, -s.arrival))
        return max(pool, key=lambda s: s.arrival)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Apply a step's results. Returns the sequences that got a new token (finished ones included)."""
        touched: list[Sequence] = []
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            if chunk.draft_token_ids:
                self._verified(seq, result.verified[seq.request_id], len(chunk.draft_token_ids))
                touched.append(seq)
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.block_manager.commit(seq)
            if not chunk.samples:
                continue
            token = result.sampled[seq.request_id]
            seq.output_token_ids.append(token)
            seq.num_new_tokens = 1
            seq.last_token_time = self.now()
            touched.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
        return touched

    # ---- drafts, between steps -------------------------------------------------------------------------
    def draft_requests(self) -> list[tuple[Sequence, int]]:
        """The running decodes that may draft in the next step, oldest first, each with the most drafts it may take
        (the next step's budget may cut them further). None while speculative decoding is off or more decodes run
        than `disable_drafts_above`: the proposer's work would be thrown away. (A batch that an abort or a
        preemption shrinks to the bound before the next step drafts from the step after.) A paused sequence is
        left out; the next step counts its pause down."""
        if self.num_speculative_tokens <= 0:
            return []
        decodes = [s for s in self.running if s.status is SequenceStatus.RUNNING and s.is_decoding]
        if self.disable_drafts_above is not None and len(decodes) > self.disable_drafts_above:
            return []
        wanted = []
        for seq in decodes:
            if self._may_draft(seq) and seq.drafts_paused == 0:
                room = self._draft_room(seq)
                if room > 0:
                    wanted.append((seq, room))
        return wanted

    def update_draft_token_ids(self, drafts: Mapping[str, list[int]], seconds: float = 0.0) -> None:
        """Hand in the drafts for the next step (request_id -> draft ids), and the proposer's time for them (the
        step's `draft_seconds`). They hold for the next `schedule()` only."""
        self._drafts = {rid: list(ids) for rid, ids in drafts.items() if ids}
        self._draft_seconds = seconds

    def _may_draft(self, seq: Sequence) -> bool:
        if seq.params.logprobs is not None:  # per-token logprobs of verified runs are not reported yet
            return False
        # a seeded request's tokens must not depend on its batch; whether it gets drafts does (the budget and
        # blocks others leave), and verification draws from its generator differently
        return seq.params.seed is None or seq.params.greedy

    def _draft_room(self, seq: Sequence) -> int:
        return min(self.num_speculative_tokens,
                   seq.params.max_tokens - len(seq.output_token_ids) - 1,  # the model adds one of its own
                   self.config.max_model_len - len(seq) - 1)

    # ---- internals --------------------------------------------------------------------------------------
    def _take_drafts(self, decodes: list[ScheduledChunk], budget: int, drafts: Mapping[str, list[int]]) -> int:
        """Give this step's decodes the drafts handed in for them, oldest first, out of `budget`; returns the tokens
        used. Each decode that may draft sets aside its room (its most drafts, within what is left) whether or not
        it was handed that many: how the budget is split between the decodes depends on the batch alone, not on
        which of them the proposer had guesses for."""
        if self.disable_drafts_above is not None and len(decodes) > self.disable_drafts_above:
            return 0
        used, left = 0, budget
        for chunk in decodes:
            seq = chunk.seq
            if left <= 0:
                break
            if not self._may_draft(seq):
                continue
            if seq.drafts_paused > 0:
                seq.drafts_paused -= 1
                continue
            room = min(self._draft_room(seq), left)
            if room <= 0:
                continue
            left -= room
            taken = drafts.get(seq.request_id, [])[:room]
            if taken:
                chunk.draft_token_ids = list(taken)
                chunk.num_tokens += len(taken)
                used += len(taken)
        return used

    def _place_drafts(self, decodes: list[ScheduledChunk]) -> None:
        """KV slots for the drafts, once every prompt chunk of the step has its own: all of a decode's drafts where
        blocks are free, else those that fit in the blocks it holds (the budget they were given stays unused)."""
        bm = self.block_manager
        for chunk in decodes:
            drafts = chunk.draft_token_ids
            if not drafts or bm.ensure_slots(chunk.seq, 1 + len(drafts)):
                continue
            seq = chunk.seq
            fit = max(0, len(seq.block_table) * bm.block_size - seq.num_computed_tokens - 1)
            chunk.draft_token_ids = drafts[:fit]
            chunk.num_tokens = 1 + fit

    def _verified(self, seq: Sequence, tokens: list[int], drafted: int) -> None:
        """Append what the sampler kept of a decode's drafts (and its own token), up to the first stop; the KV of
        every kept token but the newest is in the cache; blocks only rejected drafts used go back to the pool."""
        kept = len(tokens) - 1
        seq.draft_acceptance += ACCEPTANCE_WEIGHT * (kept / drafted - seq.draft_acceptance)
        if seq.draft_acceptance < self.min_acceptance:
            seq.drafts_paused = seq.draft_pause or DRAFT_PAUSES[0]
            seq.draft_pause = min(2 * seq.drafts_paused, DRAFT_PAUSES[1])
        else:
            seq.draft_pause = 0
        seq.num_new_tokens = 0
        reason = None
        for token in tokens:
            seq.output_token_ids.append(token)
            seq.num_new_tokens += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                break
        seq.num_computed_tokens = len(seq) - 1
        seq.last_token_time = self.now()
        self.block_manager.commit(seq)
        self.block_manager.trim(seq)
        if reason is not None:
            self._finish(seq, reason)

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why appending `token` (already appended) ends the sequence, or None: also for a first token that a
        prefill pod sampled."""
        return self._stop_reason(seq, token)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if not p.ignore_eos and token in self.config.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or len(seq) >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Get blocks for `n` tokens of `seq`, preempting newer unscheduled sequences; False if `seq` itself
        had to go."""
        while not self.block_manager.ensure_slots(seq, n):
            victim = self._victim(scheduled, seq) if self.by_class else self._newest_unscheduled(scheduled)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _continue_chunk(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        """KV slots for the next `n` tokens of a running prompt (fewer if its blocks hold fewer and none can be
        freed); 0 when it gets none this step."""
        bm = self.block_manager
        n = min(n, bm.free_slots_for(seq)) or self._make_room(seq, n, out, scheduled)
        return n if n > 0 and bm.ensure_slots(seq, n) else 0

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        """A running prompt cannot take any token: preempt newer sequences until it can."""
        while self.block_manager.free_slots_for(seq) <= 0:
            if self.by_class:
                victim = self._victim(scheduled, seq)
                if victim is None or victim is seq or (victim.priority == seq.priority and victim.arrival < seq.arrival):
                    return 0
            else:
                victim = self._newest_unscheduled(scheduled)
                if victim is None or victim is seq or victim.arrival < seq.arrival:
                    return 0
            self._preempt(victim, out)
        return min(n, self.block_manager.free_slots_for(seq))

    def _newest_unscheduled(self, scheduled: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if id(seq) not in scheduled:
                return seq
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # it is older than everything still waiting
        out.preempted.append(seq.request_id)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.hold_kv and reason is not FinishReason.ABORT:
            seq.held_blocks = self.block_manager.hold(seq)
        else:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
