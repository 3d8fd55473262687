"""Paged attention over the flattened tokens of one step.

The runner builds an `AttentionMetadata` once per step; every layer reuses it, so the layers contain no Python
loop over sequences. Decodes (one query each) and prefill chunks (many queries, attending causally to their own
cached prefix) are two batched calls of torch's scaled_dot_product_attention over K/V gathered from the paged
pool, with padding masked out. SDPA picks its fused kernel per device (flash/mem-efficient on CUDA, the
flash-style CPU kernel on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """A batch of sequences padded to the same query and context length."""

    query_index: torch.Tensor  # [B, Q] rows of the flattened step tokens (padding repeats a valid row)
    query_valid: torch.Tensor  # [B, Q] bool
    context_slots: torch.Tensor  # [B, L] slots of the paged pool holding each sequence's keys/values
    mask: torch.Tensor  # [B, 1, Q, L] bool: True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    groups: list[AttentionGroup]  # at most two: decodes, prefill chunks


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [2, slots, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]."""
    cache[0].index_copy_(0, slot_mapping, k)
    cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] → [T, heads, head_dim]; keys/values come from `cache` (already holding this
    step's tokens)."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != cache.shape[2]
    for g in meta.groups:  # at most two groups, not one per sequence
        qg = q[g.query_index].transpose(1, 2)  # [B, H, Q, D]
        k = cache[0][g.context_slots].transpose(1, 2)  # [B, KVH, L, D]
        v = cache[1][g.context_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        o = o.transpose(1, 2)  # [B, Q, H, D]
        out[g.query_index[g.query_valid]] = o[g.query_valid]
    return out
