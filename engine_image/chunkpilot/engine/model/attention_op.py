"""The attention of one layer as one opaque operator, `chunkpilot::attention(q, k, v, layer, scale)`: it writes
the step's new keys and values into the pool and attends, finding the pool and the step's metadata in the
forward context (forward_context.py). Eager forwards call it like any op (about 2 us of dispatch); a compiled
forward keeps it as a call between its fused kernels, which is what lets the whole model compile (a paged
attention's metadata is a Python structure, and a pool written inside the graph would be copied)."""

from __future__ import annotations

import torch

from chunkpilot.engine.model import forward_context
from chunkpilot.engine.model.attention import paged_attention, write_kv

_LIBRARY = torch.library.Library("chunkpilot", "DEF")
_LIBRARY.define("attention(Tensor q, Tensor k, Tensor v, int layer, float scale) -> Tensor")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] → [T, heads, head_dim]."""
    context = forward_context.current()
    cache = context.kv_caches[layer]
    write_kv(cache, k, v, context.meta.slot_mapping)
    return paged_attention(q, cache, context.meta, scale)


_LIBRARY.impl("attention", _attention, "CompositeExplicitAutograd")


@torch.library.register_fake("chunkpilot::attention")
def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return torch.ops.chunkpilot.attention(q, k, v, layer, scale)
