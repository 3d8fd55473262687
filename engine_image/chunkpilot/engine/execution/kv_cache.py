"""The paged KV pool: one tensor [layers, 2 (K, V), slots, kv_heads, head_dim], slots = blocks × block_size.

Under tensor parallelism each rank's pool holds only its own KV heads (TPShard.kv_heads: kv_heads / N, or 1 when
they are replicated), for the same slots on every rank: rank 0's block manager hands out slots for all of them."""

from __future__ import annotations

import torch

from chunkpilot.engine.model.model_config import ModelConfig


def kv_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    """K and V of one token across all layers, for `kv_heads` heads (default: all of the model's)."""
    heads = cfg.num_key_value_heads if kv_heads is None else kv_heads
    return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def pool_bytes(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, kv_heads: int | None = None) -> int:
    """2 × layers × kv_heads × head_dim × dtype bytes × slots (kv_heads: this rank's)."""
    return kv_bytes_per_slot(cfg, dtype, kv_heads) * num_slots


def blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int,
                      kv_heads: int | None = None) -> int:
    return memory_bytes // (kv_bytes_per_slot(cfg, dtype, kv_heads) * block_size)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_heads: int | None = None):
        heads = cfg.num_key_value_heads if kv_heads is None else kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.tensor = torch.zeros(
            cfg.num_hidden_layers, 2, self.num_slots, heads, cfg.head_dim, dtype=dtype, device=device
        )
        self.expected_bytes = pool_bytes(cfg, dtype, self.num_slots, heads)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
