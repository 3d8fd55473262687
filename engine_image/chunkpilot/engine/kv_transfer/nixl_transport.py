"""The NIXL backend of the KV transport: NVIDIA's transfer library over UCX (shared memory, TCP or RDMA on the CPU,
GPU memory on a GPU, whatever UCX finds; UCX_TLS narrows it). The pool is registered once; a read is one READ
request of 2 × layers descriptors per block, posted and polled to completion or to its deadline."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np

from chunkpilot.engine.execution.kv_blocks import block_regions
from chunkpilot.engine.kv_transfer.transport import KVTransport, TransferError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.0002  # between state checks of a posted read: a block moves in well under a millisecond
# NIXL's progress thread loops with no pause by default (its Python API fixes the delay at 0): a whole core spun on
# every pod, which on a decode pod pinned to one core tripled the inter-token latency (measured: 75 ms alone, 210 ms
# beside the spinning thread). The side that is read from needs the thread over TCP (UCX serves remote reads there as
# messages, which someone must progress: without it reads hang); a reader kept it too, because a reader without it
# lost its pod when its prefill pod was killed mid-read on the real cluster. A pause of 1 ms between rounds costs 8 %
# of a core instead of 100 %, at the same read times (45-50 ms for 45 MiB, measured).
PROGRESS_DELAY_US = 1000
_construct = threading.Lock()


class NixlTransport(KVTransport):
    def __init__(self, name_prefix: str, pool, block_size: int) -> None:
        # unique per process start: a restarted prefill pod is a new agent, and readers fetch its metadata again
        super().__init__(f"{name_prefix}-{uuid.uuid4().hex[:12]}", pool, block_size)
        self._agent = _paced_agent(self.name)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here: the nixl wheel's UCX plug-in failed to load")
        self._mem = "VRAM" if pool.device.type == "cuda" else "DRAM"
        self._device = pool.device.index or 0 if pool.device.type == "cuda" else 0
        self._registered = self._agent.register_memory(pool)
        self._remotes: set[str] = set()
        self._lock = threading.Lock()  # readers run on several executor threads; agent calls are not re-entrant

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def read(self, agent, fetch_metadata, remote, remote_blocks, local_blocks, timeout) -> int:
        if len(remote_blocks) != len(local_blocks):
            raise ValueError("remote and local block lists differ in length")
        if not local_blocks:
            return 0
        with self._lock:
            if agent not in self._remotes:
                try:
                    added = self._agent.add_remote_agent(fetch_metadata())
                except Exception as e:  # noqa: BLE001 - unreachable peer, bad metadata
                    raise TransferError(f"could not load prefill agent {agent!r}: {e}") from e
                name = added.decode() if isinstance(added, bytes) else str(added)
                if name != agent:
                    raise TransferError(f"prefill pod's agent is {name!r}, the offer named {agent!r}")
                self._remotes.add(agent)
            local = self.layout
            src = block_regions(remote.address, remote.num_slots, remote.layers, remote.row_bytes, self.block_size,
                                remote_blocks)
            dst = block_regions(local.address, local.num_slots, local.layers, local.row_bytes, self.block_size,
                                local_blocks)
            remote_descs = self._agent.get_xfer_descs(_descs(src, self._device), self._mem)
            local_descs = self._agent.get_xfer_descs(_descs(dst, self._device), self._mem)
            try:
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, agent)
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"NIXL could not prepare the read from {agent!r}: {e}") from e
        deadline = time.monotonic() + timeout
        try:
            state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"the read from {agent!r} took over {timeout:.1f} s")
                time.sleep(POLL_SECONDS)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL read from {agent!r} failed ({state})")
        finally:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as e:  # noqa: BLE001 - a read still in flight cannot be released
                # Its destination blocks may still be written: the caller must not reuse them (decode_side keeps
                # them out of the pool for good), so this leaks blocks rather than corrupting other prompts.
                log.error("could not release a NIXL read from %s: %s", agent, e)
                raise TransferError(f"NIXL read from {agent!r} could not be stopped: {e}", unsafe=True) from e
        return sum(length for _, length in dst)

    def forget(self, agent: str) -> None:
        """A prefill pod is gone: drop its metadata (its successor has a new name)."""
        with self._lock:
            if agent in self._remotes:
                self._remotes.discard(agent)
                try:
                    self._agent.remove_remote_agent(agent)
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001 - at shutdown
            pass


def _paced_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config, nixlBind

    config = nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
    # the wrapper builds the binding's config and sets its thread delay to 0 itself: hand it one with ours instead
    with _construct:
        make = nixlBind.nixlAgent

        def paced(agent_name, agent_config):
            agent_config.pthrDelay = PROGRESS_DELAY_US
            return make(agent_name, agent_config)

        nixlBind.nixlAgent = paced
        try:
            return nixl_agent(name, config)
        finally:
            nixlBind.nixlAgent = make


def _descs(regions, device: int) -> np.ndarray:
    out = np.empty((len(regions), 3), dtype=np.uint64)
    for i, (address, length) in enumerate(regions):
        out[i] = (address, length, device)
    return out
