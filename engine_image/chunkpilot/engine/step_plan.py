"""What one forward pass needs to know of a step, and nothing of the requests behind it.

Rank 0 builds it from the scheduler's `SchedulerOutput` and, under tensor parallelism, broadcasts it; every rank
runs the same forward from it. It carries only this step's token ids and block tables (a decode sends one token
and its blocks, never its whole context), so a broadcast per step stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class PlannedChunk:
    start: int  # first position computed (= tokens already in the cache)
    token_ids: list[int]  # the tokens at positions start .. start + len - 1
    block_table: list[int]  # KV blocks of positions 0 .. start + len - 1, in order
    samples: bool  # the chunk ends at the sequence's last token: its logits give the next token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    chunks: list[PlannedChunk]  # decodes first, then prefill chunks
    num_decodes: int


def plan_of(sched: SchedulerOutput, block_size: int) -> StepPlan:
    chunks = []
    for c in sched.chunks:
        seq = c.seq
        n_prompt = len(seq.prompt_token_ids)
        lo, hi = c.start, c.start + c.num_tokens
        # Slice prompt and output separately: building seq.token_ids would copy the whole context.
        ids = seq.prompt_token_ids[lo : min(hi, n_prompt)] if lo < n_prompt else []
        if hi > n_prompt:
            ids = ids + seq.output_token_ids[max(lo, n_prompt) - n_prompt : hi - n_prompt]
        chunks.append(PlannedChunk(c.start, ids, seq.block_table[: -(-hi // block_size)], c.samples))
    return StepPlan(chunks, sched.num_decodes)
