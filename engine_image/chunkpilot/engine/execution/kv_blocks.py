"""Whole KV blocks of the pool as memory: where each block's bytes lie, a checksum per block, a copy between pools.

The pool is [layers, 2, slots, kv_heads, head_dim] (kv_cache.py), so one block is 2 × layers regions of
block_size × kv_heads × head_dim values each, one per (layer, K or V). A transport moves those regions (NIXL takes
them as descriptors); the checksum covers exactly them, so what a decode pod received is checked byte for byte
against what the prefill pod computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

# The checksum's name, part of the KV fingerprint (LLMEngine.kv_fingerprint): pods that compute it differently
# refuse each other's offers at the fingerprint (HTTP 409, prefilled locally) instead of failing every block.
CHECKSUM = "xxh3_64"


def pool_layout(pool: torch.Tensor) -> tuple[int, int, int, int]:
    """(address, slots, layers, bytes of one slot of one layer's K or V): what a reader needs of a pool."""
    layers, _, num_slots = pool.shape[:3]
    return pool.data_ptr(), num_slots, layers, pool[0, 0, 0].numel() * pool.element_size()


def block_regions(address: int, num_slots: int, layers: int, row_bytes: int, block_size: int,
                  blocks: Sequence[int]) -> list[tuple[int, int]]:
    """(address, bytes) of every region of `blocks` in a pool laid out as `pool_layout` says: block by block, then
    layer, then K before V, the same order on both sides of a transfer, so region i of one list lands on region i
    of the other."""
    length = block_size * row_bytes
    return [(address + ((layer * 2 + k) * num_slots + b * block_size) * row_bytes, length)
            for b in blocks for layer in range(layers) for k in range(2)]


def block_bytes(pool: torch.Tensor, block_size: int) -> int:
    layers, kv = pool.shape[:2]
    return layers * kv * block_size * pool[0, 0, 0].numel() * pool.element_size()


def block_checksums(pool: torch.Tensor, block_size: int, blocks: Sequence[int]) -> list[int]:
    """XXH3-64 of each block's bytes (all its layers, K and V). Not a defence against an attacker (the pods trust
    each other on the cluster network): it catches a block that changed or was overwritten on the way, which
    without it becomes another prompt's answer under HTTP 200 (vllm#52234). XXH3 rather than zlib's CRC-32: both
    sides hash every block of every pull, and on the CPU that was a third of a pull's time (1024 tokens of SmolLM2:
    19 ms with CRC-32, 6.5 ms with XXH3, one core). On the CPU it runs over the block's regions in place (no
    copy); a GPU pool's blocks are copied to the host first."""
    if pool.device.type != "cpu":
        return [xxhash.xxh3_64_intdigest(pool[:, :, b * block_size:(b + 1) * block_size].contiguous().cpu()
                                         .view(torch.uint8).numpy()) for b in blocks]
    flat = pool.view(-1).view(torch.uint8).numpy()
    base = pool.data_ptr()
    _, num_slots, layers, row_bytes = pool_layout(pool)
    out = []
    for b in blocks:
        h = xxhash.xxh3_64()
        for address, length in block_regions(base, num_slots, layers, row_bytes, block_size, [b]):
            h.update(flat[address - base:address - base + length])
        out.append(h.intdigest())
    return out


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, block_size: int, src_blocks: Sequence[int],
                dst_blocks: Sequence[int]) -> None:
    """Copy whole blocks from one pool to another of the same layout (the in-process transport)."""
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst[:, :, d * block_size:(d + 1) * block_size].copy_(src[:, :, s * block_size:(s + 1) * block_size])
