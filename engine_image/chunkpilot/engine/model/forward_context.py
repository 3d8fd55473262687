"""What one step's attention needs besides its own tensors: the KV cache pool and the step's attention metadata,
set by the runner around the model's forward and read by every layer's attention (vLLM's forward context).

Why not arguments: the model's forward is compiled whole (execution/compiled_forward.py), and a cache passed through the
graph would be copied by the compiler whenever a layer writes into it (functionalisation: the whole pool per
layer). The attention is an opaque operator (attention_op.py's `chunkpilot::attention`) that finds the pool and the
metadata here, so the compiled graph sees only q, k and v go in and the output come out.

Per thread: engines in one process (tests, a draft model inside its target) each run their steps in their own
thread or one after the other, never interleaved within a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from chunkpilot.engine.model.attention import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    kv_caches: torch.Tensor  # [layers, 2, slots, kv_heads, head_dim]
    meta: AttentionMetadata


_local = threading.local()


@contextmanager
def forward_context(kv_caches: torch.Tensor, meta: AttentionMetadata) -> Iterator[None]:
    """The step's context for the forward inside the block; the one before it comes back after."""
    before = getattr(_local, "context", None)
    _local.context = ForwardContext(kv_caches, meta)
    try:
        yield
    finally:
        _local.context = before


def current() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("attention ran outside a step: the runner sets the forward context around the forward")
    return context
