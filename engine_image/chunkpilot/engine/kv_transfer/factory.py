"""Which transport `--kv-transport` names (its own module: the backends import the interface)."""

from __future__ import annotations

import torch

from chunkpilot.engine.kv_transfer.transport import KVTransport


def make_transport(kind: str, name: str, pool: torch.Tensor, block_size: int) -> KVTransport:
    """The transport `--kv-transport` names, with the pool registered."""
    if kind == "nixl":
        from chunkpilot.engine.kv_transfer.nixl_transport import NixlTransport

        return NixlTransport(name, pool, block_size)
    raise ValueError(f"unknown KV transport {kind!r} (known: nixl)")
