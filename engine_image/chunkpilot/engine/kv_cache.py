"""The paged KV pool: one tensor [layers, 2 (K, V), slots, kv_heads, head_dim], slots = blocks × block_size."""

from __future__ import annotations

import torch

from chunkpilot.engine.model_config import ModelConfig


def kv_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def pool_bytes(cfg: ModelConfig, dtype: torch.dtype, num_slots: int) -> int:
    """2 × layers × kv_heads × head_dim × dtype bytes × slots."""
    return kv_bytes_per_slot(cfg, dtype) * num_slots


def blocks_for_memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int) -> int:
    return memory_bytes // (kv_bytes_per_slot(cfg, dtype) * block_size)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.tensor = torch.zeros(
            cfg.num_hidden_layers, 2, self.num_slots, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device
        )
        self.expected_bytes = pool_bytes(cfg, dtype, self.num_slots)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()
