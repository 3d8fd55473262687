"""How KV blocks move from a prefill pod's pool into a decode pod's, shaped like vLLM's KV connector: each process
registers its pool once at start-up, publishes its metadata, and the decode side reads the blocks it lacks straight
into blocks it reserved (a one-sided read: the prefill pod's step loop is not involved). The in-process backend
here is for tests; nixl_transport.py is the one pods use."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from chunkpilot.engine.execution.kv_blocks import copy_blocks, pool_layout
from chunkpilot.engine.kv_transfer.wire import PoolLayout


class TransferError(RuntimeError):
    """A read failed or timed out: the peer died, the connection broke, the blocks were not where it said.
    `unsafe`: the read could not be stopped, so its destination blocks may still be written and must never be
    reused."""

    def __init__(self, message: str, *, unsafe: bool = False) -> None:
        super().__init__(message)
        self.unsafe = unsafe


class KVTransport(ABC):
    def __init__(self, name: str, pool: torch.Tensor, block_size: int) -> None:
        self.name = name
        self.pool = pool
        self.block_size = block_size

    @property
    def layout(self) -> PoolLayout:
        address, num_slots, layers, row_bytes = pool_layout(self.pool)
        return PoolLayout(address=address, num_slots=num_slots, layers=layers, row_bytes=row_bytes)

    @abstractmethod
    def metadata(self) -> bytes:
        """What a reader needs to reach this process's pool (served at GET /kv/agent)."""

    @abstractmethod
    def read(self, agent: str, fetch_metadata: Callable[[], bytes], remote: PoolLayout, remote_blocks: Sequence[int],
             local_blocks: Sequence[int], timeout: float) -> int:
        """Copy `remote_blocks` of `agent`'s pool into `local_blocks` of ours; returns the bytes moved. Blocking
        (run it off the event loop); raises TransferError. `fetch_metadata` is called the first time an agent is
        met (a prefill pod that restarted has a new name)."""

    def close(self) -> None:
        pass


class InProcessTransport(KVTransport):
    """Engines in one process (tests): the 'agent' is a name in a process-wide table of pools."""

    _pools: dict[str, torch.Tensor] = {}
    _lock = threading.Lock()

    def __init__(self, name: str, pool: torch.Tensor, block_size: int) -> None:
        super().__init__(name, pool, block_size)
        with self._lock:
            self._pools[name] = pool

    def metadata(self) -> bytes:
        return self.name.encode()

    def read(self, agent, fetch_metadata, remote, remote_blocks, local_blocks, timeout) -> int:
        with self._lock:
            src = self._pools.get(agent)
        if src is None:
            raise TransferError(f"no pool named {agent!r} in this process (its engine closed)")
        copy_blocks(src, self.pool, self.block_size, remote_blocks, local_blocks)
        return len(local_blocks) * self.pool[:, :, :self.block_size].numel() * self.pool.element_size()

    def close(self) -> None:
        with self._lock:
            self._pools.pop(self.name, None)

