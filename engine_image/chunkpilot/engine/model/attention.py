"""Paged attention over the flattened tokens of one step, with two backends chosen at start-up.

The runner builds an `AttentionMetadata` once per step; every layer reuses it, so the layers contain no Python
loop over sequences.

* `sdpa` (everywhere, the CPU path): a few batched calls of torch's scaled_dot_product_attention over K/V gathered
  from the paged pool, with padding masked out: decodes (one query each) in groups of similar context length,
  each long prefill chunk (many queries, attending causally to its own cached prefix) alone, short chunks
  together. The runner decides the groups (execution/model_runner.py).
* `varlen` (CUDA, torch >= 2.10): one call of torch's `varlen_attn` (FlashAttention) reading K/V straight from
  the pool through the block table, no gather and no padding. Causal masking is bottom-right aligned, which is
  exactly "a chunk attends to its cached prefix and causally to itself".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class AttentionGroup:
    """A batch of sequences padded to the same query and context length."""

    query_index: torch.Tensor  # [B, Q] rows of the flattened step tokens (padding repeats a valid row)
    query_valid: torch.Tensor  # [B, Q] bool
    block_table: torch.Tensor  # [B, blocks] pool blocks holding each sequence's keys/values, in order
    context_len: int  # L: keys attended to (the longest context in the group)
    mask: object  # [B, 1, Q, L] bool tensor (True = may attend), a CausalBias, or None (attend to all keys)
    # The group is every row of the step in order with no padding (a decode-only step, or one prefill chunk
    # alone): queries need no gather and outputs no scatter.
    covers_all: bool = False
    # One sequence whose blocks sit back to back in the pool from this block on: its keys are a plain slice of
    # the pool (a view, no copy). Fresh sequences usually get consecutive blocks from the free list.
    contiguous_from: int | None = None


@dataclass
class VarlenMetadata:
    cu_seq_q: torch.Tensor  # [N+1] int32 query offsets of each sequence in the flattened step
    cu_seq_k: torch.Tensor  # [N+1] int32 cumulative context lengths
    seqused_k: torch.Tensor  # [N] int32 context length of each sequence (cached prefix + this chunk)
    block_table: torch.Tensor  # [N, max_blocks] int32
    max_q: int
    max_k: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups: list[AttentionGroup]  # sdpa: a few per step (decodes by context length, prefill chunks)
    varlen: VarlenMetadata | None = None  # varlen backend
    block_size: int = 16


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [2, slots, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    cache[0].index_copy_(0, slot_mapping, k)
    cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] → [T, heads, head_dim]; keys/values come from `cache` (already holding this
    step's tokens)."""
    gqa = q.shape[1] != cache.shape[2]
    if meta.varlen is not None:
        return _varlen(q, cache, meta.varlen, meta.block_size, scale, gqa)
    out = torch.empty_like(q)
    for g in meta.groups:  # a few groups per step, not one per sequence
        b, q_len = g.query_index.shape
        qg = (q.view(b, q_len, *q.shape[1:]) if g.covers_all else q[g.query_index]).transpose(1, 2)  # [B, H, Q, D]
        # Gather whole blocks as rows of a [blocks, block_size*heads*dim] table (an embedding lookup: one
        # contiguous copy per block, ~3x faster on the CPU than advanced indexing per slot), then view each
        # sequence's blocks as one run of keys and cut it at the longest context.
        k = _gather_blocks(cache[0], g, meta.block_size).transpose(1, 2)  # [B, KVH, L, D]
        v = _gather_blocks(cache[1], g, meta.block_size).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        o = o.transpose(1, 2)  # [B, Q, H, D]
        if g.covers_all:
            return o.reshape(q.shape)
        out[g.query_index[g.query_valid]] = o[g.query_valid]
    return out


def _gather_blocks(pool: torch.Tensor, g: AttentionGroup, block_size: int) -> torch.Tensor:
    slots, kv_heads, dim = pool.shape
    if g.contiguous_from is not None:
        start = g.contiguous_from * block_size
        return pool[start : start + g.context_len].unsqueeze(0)
    rows = F.embedding(g.block_table, pool.view(slots // block_size, block_size * kv_heads * dim))
    b, n = g.block_table.shape
    return rows.view(b, n * block_size, kv_heads, dim)[:, : g.context_len]


def _varlen(q: torch.Tensor, cache: torch.Tensor, m: VarlenMetadata, block_size: int, scale: float, gqa: bool):
    from torch.nn.attention.varlen import varlen_attn

    slots, kv_heads, head_dim = cache.shape[1:]
    pages = (slots // block_size, block_size, kv_heads, head_dim)
    return varlen_attn(
        q, cache[0].view(pages), cache[1].view(pages), m.cu_seq_q, m.cu_seq_k, m.max_q, m.max_k,
        scale=scale, window_size=(-1, 0), enable_gqa=gqa, seqused_k=m.seqused_k, block_table=m.block_table,
    )


def configure_cuda_sdpa() -> None:
    """No cuDNN kernels behind scaled_dot_product_attention. Profiled on an H200 (bench/gpu_profile.py, Llama-3-8B
    size, bfloat16): torch picked cuDNN attention for our masked calls, and each call spent about 1 ms of CPU at
    batch 1 and 6 ms at batch 32 (plan building: the key length changes every decode step), 64 % and 89 % of the
    step, while the GPU worked 6-7 ms a step. The memory-efficient and math kernels take the same masks with no
    per-shape plan. Process-wide, as torch's switch is: the engine owns its process."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """`auto`: varlen on CUDA when this torch has it *and* it agrees with sdpa on a small paged problem at the
    engine's block size and dtype (FlashAttention kernels restrict page sizes and dtypes); else sdpa."""
    if requested == "sdpa":
        return "sdpa"
    reason = _varlen_unusable(device, dtype, block_size)
    if reason is None:
        return "varlen"
    if requested == "varlen":
        raise ValueError(f"attention backend varlen is not usable here: {reason}; use --attention-backend sdpa")
    log.info("attention backend sdpa (varlen not usable: %s)", reason)
    return "sdpa"


def _varlen_unusable(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    if device.type != "cuda":
        return "it needs a CUDA device"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    try:
        return None if _self_check(device, dtype, block_size) else "its output differs from sdpa"
    except Exception as e:  # a kernel that refuses this page size or dtype
        return f"{type(e).__name__}: {e}"


def _self_check(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    """Two sequences, one decoding with 2 blocks of context and one prefilling a chunk after a cached prefix,
    through both backends."""
    g = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, dim, num_blocks = 4, 2, 64, 8
    cache = torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=g).to(device, dtype)
    starts, counts = [2 * block_size - 1, block_size + 1], [1, block_size]
    tables = [[5, 2], [7, 1, 3]]
    q = torch.randn(sum(counts), heads, dim, generator=g).to(device, dtype)
    meta_sdpa, meta_varlen = _check_metadata(starts, counts, tables, block_size, device)
    a = paged_attention(q, cache, meta_sdpa, dim**-0.5)
    b = paged_attention(q, cache, meta_varlen, dim**-0.5)
    return bool(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2))


def _check_metadata(starts, counts, tables, block_size, device):
    groups = []
    row = 0
    for start, n, table in zip(starts, counts, tables):
        ctx = start + n
        q_pos = torch.arange(n, device=device)
        k_pos = torch.arange(ctx, device=device)
        mask = (k_pos[None, :] <= (start + q_pos)[:, None])[None, None]
        blocks = torch.tensor(table[: -(-ctx // block_size)], device=device)[None]
        groups.append(AttentionGroup((row + q_pos)[None], torch.ones(1, n, dtype=torch.bool, device=device),
                                     blocks, ctx, mask))
        row += n
    width = max(len(t) for t in tables)
    varlen = VarlenMetadata(
        cu_seq_q=torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32, device=device),
        cu_seq_k=torch.tensor([0, starts[0] + counts[0], sum(starts) + sum(counts)], dtype=torch.int32, device=device),
        seqused_k=torch.tensor([s + n for s, n in zip(starts, counts)], dtype=torch.int32, device=device),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        max_q=max(counts), max_k=max(s + n for s, n in zip(starts, counts)),
    )
    empty = torch.empty(0, dtype=torch.long, device=device)
    return (AttentionMetadata(empty, groups, None, block_size), AttentionMetadata(empty, [], varlen, block_size))
