"""What one forward pass needs to know of a step, and nothing of the requests behind it.

Rank 0 builds it from the scheduler's `SchedulerOutput` and, under tensor parallelism, broadcasts it; every rank
runs the same forward from it. It carries only this step's token ids and block tables (a decode sends one token
and its blocks, never its whole context), so a broadcast per step stays small.

On the wire (tensor parallelism) a plan is a flat tensor of integers (`encode_message`), never a pickle: the
workers decode it with checked code, so a message is data whatever its bytes are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkpilot.engine.core.scheduler import SchedulerOutput

# Broadcast in place of a plan while the engine is idle; the workers wait for the next one.
KEEPALIVE = "keepalive"
# The first integer of a message: what follows.
_STOP, _KEEPALIVE, _PLAN = 0, 1, 2


@dataclass(slots=True)
class PlannedChunk:
    start: int  # first position computed (= tokens already in the cache)
    token_ids: list[int]  # the tokens at positions start .. start + len - 1
    block_table: list[int]  # KV blocks of positions 0 .. start + len - 1, in order
    samples: bool  # the chunk ends at the sequence's last token: its logits give the next token
    drafts: int = 0  # of token_ids, the last ones are draft tokens to verify: logits at each, and before them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    chunks: list[PlannedChunk]  # decodes first (with or without drafts, in the scheduler's order), then prefills
    # Decodes, drafts or not: attention groups them by context length; a group holding a decode with k drafts
    # pads its queries to 1 + k (a group of its own would cost more: model_runner.GROUP_COST_SLOTS)
    num_decodes: int

    @property
    def logit_rows(self) -> list[int]:
        """Rows of the step's flattened tokens whose logits are sampled: a sampling chunk's last token, and with
        drafts its last 1 + drafts tokens."""
        rows, offset = [], 0
        for c in self.chunks:
            offset += c.num_tokens
            if c.samples:
                rows.extend(range(offset - 1 - c.drafts, offset))
        return rows


def plan_of(sched: SchedulerOutput, block_size: int) -> StepPlan:
    chunks = []
    for c in sched.chunks:
        seq = c.seq
        n_prompt = len(seq.prompt_token_ids)
        lo, hi = c.start, c.start + c.num_tokens
        # Slice prompt and output separately: building seq.token_ids would copy the whole context.
        ids = seq.prompt_token_ids[lo : min(hi, n_prompt)] if lo < n_prompt else []
        drafts = c.draft_token_ids
        hi -= len(drafts)
        if hi > n_prompt:
            ids = ids + seq.output_token_ids[max(lo, n_prompt) - n_prompt : hi - n_prompt]
        ids = ids + drafts
        chunks.append(PlannedChunk(c.start, ids, seq.block_table[: -(-(hi + len(drafts)) // block_size)], c.samples,
                                   len(drafts)))
    return StepPlan(chunks, sched.num_decodes)


def encode_message(message: "StepPlan | str | None") -> torch.Tensor:
    """A StepPlan, KEEPALIVE or None (stop) as int64: [kind], or [2, num_decodes, chunks, then per chunk start,
    samples, drafts, n_tokens, n_blocks, the tokens, the blocks]."""
    if message is None:
        return torch.tensor([_STOP], dtype=torch.long)
    if message == KEEPALIVE:
        return torch.tensor([_KEEPALIVE], dtype=torch.long)
    out = [_PLAN, message.num_decodes, len(message.chunks)]
    for c in message.chunks:
        out += [c.start, int(c.samples), c.drafts, len(c.token_ids), len(c.block_table)]
        out += c.token_ids
        out += c.block_table
    return torch.tensor(out, dtype=torch.long)


def decode_message(payload: torch.Tensor) -> "StepPlan | str | None":
    """The inverse of encode_message; ValueError on anything it did not make (the worker then exits)."""
    v = payload.tolist()
    if not v or v[0] not in (_STOP, _KEEPALIVE, _PLAN) or (v[0] != _PLAN and len(v) != 1):
        raise ValueError("not a step-plan message")
    if v[0] == _STOP:
        return None
    if v[0] == _KEEPALIVE:
        return KEEPALIVE
    if len(v) < 3 or min(v) < 0:
        raise ValueError("malformed step plan: negative or missing fields")
    num_decodes, n, i, chunks = v[1], v[2], 3, []
    for _ in range(n):
        if i + 5 > len(v) or v[i + 1] > 1:
            raise ValueError("malformed step plan: truncated chunk header")
        start, samples, drafts, nt, nb = v[i : i + 5]
        i += 5
        if i + nt + nb > len(v) or drafts >= max(nt, 1):
            raise ValueError("malformed step plan: truncated chunk, or more drafts than tokens")
        chunks.append(PlannedChunk(start, v[i : i + nt], v[i + nt : i + nt + nb], bool(samples), drafts))
        i += nt + nb
    if i != len(v) or num_decodes > n:
        raise ValueError("malformed step plan: trailing data or more decodes than chunks")
    return StepPlan(chunks, num_decodes)
