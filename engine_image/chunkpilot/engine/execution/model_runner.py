"""Runs one scheduler step on the model: flatten every scheduled chunk into one batch, build the paged-attention
metadata once, one forward, logits only at the positions that sample, then the sampler.

`execute` runs on rank 0 (it owns the scheduler and the sampler); `forward` runs on every rank from the step's
plan, which rank 0 broadcasts first under tensor parallelism."""

from __future__ import annotations

import logging
import time

import torch
from torch.nn.attention.bias import causal_lower_right

from chunkpilot.engine.core.scheduler import RunnerOutput, SchedulerOutput
from chunkpilot.engine.execution.compiled_forward import COMPILE_ROWS, CompiledForward
from chunkpilot.engine.execution.kv_cache import KVCache
from chunkpilot.engine.execution.sampler import Sampler
from chunkpilot.engine.model.attention import AttentionGroup, AttentionMetadata, VarlenMetadata
from chunkpilot.engine.model.forward_context import forward_context
from chunkpilot.engine.model.llama import LlamaModel
from chunkpilot.engine.model.rope import cos_sin_table
from chunkpilot.engine.parallel.step_plan import PlannedChunk, StepPlan, plan_of

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: KVCache, max_model_len: int, sampler: Sampler | None = None,
        backend: str = "sdpa", compile: bool = False,
    ) -> None:
        self.model = model
        self.group = model.group
        self.backend = backend
        self.kv_cache = kv_cache
        self.device = kv_cache.tensor.device
        self.dtype = kv_cache.tensor.dtype
        self.block_size = kv_cache.block_size
        cfg = model.config
        cos, sin = cos_sin_table(cfg.rope, cfg.head_dim, max_model_len)
        self.cos = cos.to(self.device, self.dtype)
        self.sin = sin.to(self.device, self.dtype)
        self.sampler = sampler
        self.compiled = CompiledForward(model) if compile else None
        if self.compiled is not None:
            self._warm_up()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if sched.is_empty:
            return RunnerOutput(sampled={})
        plan = plan_of(sched, self.block_size)
        self.group.broadcast(plan)
        logits = self.forward(plan)
        if logits is None:
            return RunnerOutput(sampled={})
        # logits rows in chunk order: one per sampling chunk, 1 + drafts for a decode with drafts
        plain, rows, verified, at = [], [], {}, 0
        for c in sched.chunks:
            if not c.samples:
                continue
            if c.draft_token_ids:
                n = 1 + len(c.draft_token_ids)
                verified[c.seq.request_id] = self.sampler.verify(logits[at : at + n], c.draft_token_ids,
                                                                 c.seq.request_id, c.seq.params,
                                                                 len(c.seq.output_token_ids))
                at += n
            else:
                plain.append(c)
                rows.append(at)
                at += 1
        out = RunnerOutput(sampled={}, verified=verified)
        if plain:
            ids = [c.seq.request_id for c in plain]
            picked = logits if len(rows) == len(logits) else logits[torch.tensor(rows, device=logits.device)]
            tokens, logprobs = self.sampler.sample(picked, ids, [c.seq.params for c in plain],
                                                   [len(c.seq.output_token_ids) for c in plain])
            out.sampled = dict(zip(ids, tokens))
            out.logprobs = {rid: lp for rid, lp in zip(ids, logprobs) if lp is not None}
        return out

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """The step's forward on this rank's shard. Returns the logits of the sampling positions on rank 0;
        None on the other ranks, and when no chunk samples."""
        chunks = plan.chunks
        input_ids, positions = self._flatten(chunks)
        meta = self._metadata(chunks, plan.num_decodes, positions)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        compiled = self.compiled is not None and self.compiled.covers(len(input_ids))
        with forward_context(self.kv_cache.tensor, meta):
            hidden = (self.compiled.forward if compiled else self.model)(input_ids, cos, sin)
        rows = plan.logit_rows
        if not rows:  # the same on every rank: the plan is the same
            return None
        logits = self.compiled.logits if self.compiled is not None and self.compiled.covers(len(rows)) \
            else self.model.logits
        return logits(hidden[torch.tensor(rows, device=self.device)])

    def _warm_up(self) -> None:
        """Compile the graphs now, not in front of the first requests: a step of one decode (the graphs for one
        row), then of COMPILE_ROWS / 2 (the graphs with a dynamic row count: inductor picks its GEMMs for the row
        count it first sees, so a middling one, not 2). The steps write keys and values into block 0, which nothing
        holds yet (every sequence writes a slot before it reads it)."""
        t0 = time.perf_counter()
        with self.compiled.compiling():
            for rows in (1, COMPILE_ROWS // 2):
                self.forward(StepPlan([PlannedChunk(0, [0], [0], samples=True)] * rows, num_decodes=rows))
        log.info("compiled the forward for steps of fewer than %d tokens in %.1f s", COMPILE_ROWS,
                 time.perf_counter() - t0)

    def _flatten(self, chunks: list[PlannedChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [t for c in chunks for t in c.token_ids]
        starts = torch.tensor([c.start for c in chunks])
        counts = torch.tensor([c.num_tokens for c in chunks])
        # positions = concatenated arange(start, start + n) for every chunk, without a Python loop per token
        base = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
        positions = base + torch.arange(int(counts.sum()))
        return (
            torch.tensor(ids, dtype=torch.long, device=self.device),
            positions.to(self.device),
        )

    def _metadata(self, chunks: list[PlannedChunk], num_decodes: int, positions: torch.Tensor) -> AttentionMetadata:
        if self.backend == "varlen":
            return self._varlen_metadata(chunks, positions)
        counts = torch.tensor([c.num_tokens for c in chunks], device=self.device)
        ctx_lens = [c.start + c.num_tokens for c in chunks]
        table = self._block_table(chunks, max(ctx_lens))
        slot_mapping = self._slot_mapping(table, counts, positions)
        row_starts = torch.cumsum(counts, 0) - counts
        # Decodes in groups of similar context length (each group pads to its longest context). A prefill chunk
        # of SOLO_CHUNK tokens or more is a group of its own (no padding and no mask tensor: SDPA's fused causal
        # path); shorter chunks share one padded group, where a group per chunk would cost more than it saves.
        parts = split_by_context(ctx_lens[:num_decodes], self.block_size, GROUP_COST_SLOTS) if num_decodes else []
        prefills = range(num_decodes, len(chunks))
        parts += [[i] for i in prefills if chunks[i].num_tokens >= SOLO_CHUNK]
        short = [i for i in prefills if chunks[i].num_tokens < SOLO_CHUNK]
        if short:
            parts.append(short)
        groups = []
        for idx in parts:
            sel = torch.tensor(idx, device=self.device)
            groups.append(self._group([chunks[i] for i in idx], row_starts[sel], table[sel]))
        # the only group, rows in step order and no padding (all decodes, or chunks of one length): the
        # group's rows are the step's rows
        groups[0].covers_all = len(parts) == 1 and len({c.num_tokens for c in chunks}) == 1
        return AttentionMetadata(slot_mapping=slot_mapping, groups=groups, block_size=self.block_size)

    def _block_table(self, chunks: list[PlannedChunk], ctx_max: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.zeros(len(chunks), -(-ctx_max // bs), dtype=torch.long)
        for i, c in enumerate(chunks):  # one row per sequence, one entry per block (not per token)
            table[i, : len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.long)
        return table.to(self.device)

    def _slot_mapping(self, table: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool slot of every new token: its sequence's block at (position // bs), plus position % bs."""
        rows = torch.repeat_interleave(torch.arange(len(table), device=self.device), counts)
        return table[rows, positions // self.block_size] * self.block_size + positions % self.block_size

    def _varlen_metadata(self, chunks: list[PlannedChunk], positions: torch.Tensor) -> AttentionMetadata:
        dev, bs = self.device, self.block_size
        starts = torch.tensor([c.start for c in chunks], device=dev)
        counts = torch.tensor([c.num_tokens for c in chunks], device=dev)
        ctx_lens = starts + counts
        table = self._block_table(chunks, int(ctx_lens.max()))
        slot_mapping = self._slot_mapping(table, counts, positions)
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        varlen = VarlenMetadata(
            cu_seq_q=torch.cat([zero, torch.cumsum(counts, 0).to(torch.int32)]),
            cu_seq_k=torch.cat([zero, torch.cumsum(ctx_lens, 0).to(torch.int32)]),
            seqused_k=ctx_lens.to(torch.int32),
            block_table=table.to(torch.int32),
            max_q=int(counts.max()),
            max_k=int(ctx_lens.max()),
        )
        return AttentionMetadata(slot_mapping, [], varlen, bs)

    def _group(self, part: list[PlannedChunk], row_starts: torch.Tensor, table: torch.Tensor) -> AttentionGroup:
        """One padded batch: `row_starts` are the step rows of each chunk's first token, `table` the chunks'
        rows of the step's block table."""
        dev, bs = self.device, self.block_size
        b = len(part)
        starts = torch.tensor([c.start for c in part], device=dev)
        counts = torch.tensor([c.num_tokens for c in part], device=dev)
        ctx_lens = starts + counts
        q_max, ctx_max = int(counts.max()), int(ctx_lens.max())
        table = table[:, : -(-ctx_max // bs)]

        q_pos = torch.arange(q_max, device=dev)
        query_valid = q_pos[None, :] < counts[:, None]  # [B, Q]
        query_index = row_starts[:, None] + torch.where(query_valid, q_pos[None, :], 0)
        abs_q = starts[:, None] + q_pos[None, :]  # absolute position of each query
        if b == 1:
            # One sequence: no padding, so no explicit mask. SDPA then takes its fused causal path (bottom-right
            # aligned: the chunk sees its cached prefix), about 2x faster than a [Q, L] boolean mask on a long
            # prompt. A lone decode attends to every key.
            mask = causal_lower_right(q_max, ctx_max) if q_max > 1 else None
            group = AttentionGroup(query_index, query_valid, table, ctx_max, mask)
            blocks = part[0].block_table[: -(-ctx_max // bs)]
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                group.contiguous_from = blocks[0]
            return group
        k_pos = torch.arange(ctx_max, device=dev)
        mask = (k_pos[None, None, :] <= abs_q[:, :, None]) & (k_pos[None, None, :] < ctx_lens[:, None, None])
        # Padded query rows would attend to nothing (NaN in SDPA): let them see key 0; their output is dropped.
        mask = mask | (~query_valid[:, :, None] & (k_pos[None, None, :] == 0))
        return AttentionGroup(query_index, query_valid, table, ctx_max, mask[:, None, :, :])


# What one more attention group costs, in padded key slots. A split group needs its own query gather, output
# scatter, mask and SDPA call in every layer: ~2-5 ms per step on the 2-core CPU, against ~4 us per padded key
# slot (gather + attention over 30 layers). Measured: 48 decodes with contexts of 84-528 tokens, step 240 -> 214
# ms; 8 decodes of 32-300 tokens stay one group (splitting them was slower). On CUDA the varlen backend needs no
# groups; sdpa on CUDA would want a larger value (each group is more kernel launches).
GROUP_COST_SLOTS = 1024
SOLO_CHUNK = 64


def split_by_context(ctx_lens: list[int], block_size: int, group_cost: int = GROUP_COST_SLOTS) -> list[list[int]]:
    """Partition decodes into groups that each pad to their own longest context, minimising the padded key
    slots read plus `group_cost` per group (exact dynamic programme over the contexts sorted by length;
    lengths count whole blocks, as the gather reads them). Returns index lists (step order inside each
    group), the group of the longest contexts first.

    One group for every decode pads a 20-token context to the longest one in the batch; with contexts spread
    from 20 to 560 tokens that is half the attention work of a large decode batch wasted."""
    if not ctx_lens:
        return []
    order = sorted(range(len(ctx_lens)), key=lambda i: ctx_lens[i])
    slots = [-(-ctx_lens[i] // block_size) * block_size for i in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of grouping the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = slots[j - 1]  # a group ending at j pads to its last (longest) member
        for i in range(j):
            if i > 0 and slots[i] == slots[i - 1]:
                continue  # never cut between equal lengths
            cost = best[i] + group_cost + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))  # step order inside a group
        j = cut[j]
    return groups
