"""Sarathi-Serve style stall-free scheduler.

Each step: one token for every running decode first, then the rest of `token_budget` on prefill chunks of at most
`max_chunk` tokens, first come first served; a prompt that does not fit continues next step. When KV blocks run
out, the newest running sequence is preempted and later recomputed (vLLM's recompute policy).

The scheduler never touches tensors. It hands the runner a `SchedulerOutput` and takes back a `RunnerOutput`, so
tests and the simulator drive it without a model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from chunkpilot.engine.block_manager import BlockManager
from chunkpilot.engine.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step (= tokens already in the cache)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decodes first, then prefill chunks
    knobs: SchedulerKnobs
    num_decodes: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id -> new token, for every chunk that samples
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_model_len: int = 2048
    eos_token_ids: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, knobs: KnobHolder) -> None:
        self.config = config
        self.block_manager = block_manager
        self.knobs = knobs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self.num_preemptions = 0

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

        # 1. One token for every running decode, oldest first; free blocks by preempting the newest.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            if not self._reserve(seq, 1, out, scheduled):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
            scheduled.add(id(seq))
            budget -= 1
        out.num_decodes = len(out.chunks)

        # 2. Continue prompts already running (chunked), oldest first.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or id(seq) in scheduled:
                continue
            n = min(seq.num_uncomputed, knobs.max_chunk, budget)
            n = min(n, bm.free_slots_for(seq)) or self._make_room(seq, n, out, scheduled)
            if n <= 0 or not bm.ensure_slots(seq, n):
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
        return out

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Apply a step's results. Returns the sequences that got a new token (finished ones included)."""
        touched: list[Sequence] = []
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.block_manager.commit(seq)
            if not chunk.samples:
                continue
            token = result.sampled[seq.request_id]
            seq.output_token_ids.append(token)
            touched.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
        return touched

    # ---- internals --------------------------------------------------------------------------------------
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
            victim = self._newest_unscheduled(scheduled)
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> int:
        """A running prompt cannot take any token: preempt newer sequences until it can."""
        while self.block_manager.free_slots_for(seq) <= 0:
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
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
