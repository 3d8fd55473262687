"""The collectives one tensor-parallel engine needs, behind one small object.

`TPGroup.solo()` is the single-rank engine: every method is a no-op or an identity, so the model and runner have
no `if world > 1` of their own. A distributed group uses NCCL on CUDA for the tensors (one all-reduce after
each row-parallel layer, a gather of the vocabulary slices of the logits) and a gloo group for the step plan,
which rank 0 builds on its CPU and sends as a tensor of integers (step_plan.encode_plan).

Nothing of the group is reachable from outside the pod, and nothing a peer sends is unpickled:
* the rendezvous is a FileStore in a fresh 0700 directory of rank 0 (`Rendezvous`), not a TCP store (whose
  listening socket is on every interface whatever host it is given): only this user's processes can join;
* gloo's and NCCL's own sockets are pinned to the loopback interface (`pin_to_loopback`): every rank is in the pod;
* plans, keep-alives and memory figures travel as integer tensors and are decoded by checked code, never by
  `pickle` (`broadcast_object_list` and `gather_object` would run whatever a peer's bytes say).

Every collective has the group's timeout: a rank that hangs turns into an exception on rank 0 within it, never
into a silent stall (llm_engine turns that exception into a non-zero exit, so Kubernetes restarts the pod). An
idle engine sends no plans, so rank 0 sends KEEPALIVE in their place (llm_engine's keep-alive thread): the
workers' wait for the next plan never times out on an engine that merely has no requests, and a worker that hangs
while it is idle is found by the next keep-alive's timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile
import time
import weakref

import torch

from chunkpilot.engine.parallel.step_plan import KEEPALIVE, decode_message, encode_message

log = logging.getLogger(__name__)

# The network interface of every socket the group opens: all ranks run in one pod.
LOOPBACK_INTERFACE = "lo"


def pin_to_loopback(environ=os.environ) -> None:
    """Gloo and NCCL listen on the interface these name (by default the one the host name resolves to, reachable
    from the pod network). Set in each rank's own environment before its process group is made."""
    environ["GLOO_SOCKET_IFNAME"] = LOOPBACK_INTERFACE
    environ["NCCL_SOCKET_IFNAME"] = LOOPBACK_INTERFACE


class Rendezvous:
    """Rank 0's rendezvous store: a FileStore in a fresh directory only this user can enter (mkdtemp: 0700), so a
    process that can reach the pod's network, or another user's process, cannot set the `loaded/N` keys and join
    as a rank. `path` is what the workers open; `close()` (or collection) removes the directory."""

    def __init__(self, world: int, join_timeout_s: float) -> None:
        self.directory = tempfile.mkdtemp(prefix="chunkpilot-tp-")
        self.path = os.path.join(self.directory, "store")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self.store = open_store(self.path, world, join_timeout_s)

    def close(self) -> None:
        self._cleanup()


def open_store(path: str, world: int, join_timeout_s: float):
    """A rank's handle on the rendezvous at `path` (a worker's: the path rank 0 gave it)."""
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    store.set_timeout(datetime.timedelta(seconds=join_timeout_s))
    return store


class TPGroup:
    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.world = world
        self._control = None  # gloo group for Python objects (plans, KV blocks, memory); None = the default group

    @classmethod
    def solo(cls) -> "TPGroup":
        return cls()

    def join(self, store, device: torch.device, timeout_s: float, join_timeout_s: float, check=None) -> None:
        """Wait (up to `join_timeout_s`: loading a large checkpoint takes minutes) until every rank has loaded its
        weights, then form the group, whose collectives time out after `timeout_s`. `check()` runs every second
        of the wait and may raise (rank 0: a worker already died, so nobody is coming)."""
        import torch.distributed as dist

        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError("another tensor-parallel engine is running in this process: close() it first")
        store.set(f"loaded/{self.rank}", "1")
        keys = [f"loaded/{r}" for r in range(self.world)]
        deadline = time.monotonic() + join_timeout_s
        while not store.check(keys):  # polled: a timed-out wait logs a c10d warning every second
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not all load their weights within "
                                   f"{join_timeout_s:.0f} s")
            time.sleep(0.2)
        timeout = datetime.timedelta(seconds=timeout_s)
        pin_to_loopback()
        if device.type == "cuda":
            dist.init_process_group("nccl", store=store, rank=self.rank, world_size=self.world, timeout=timeout,
                                    device_id=device)
            self._control = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        log.info("tensor-parallel rank %d of %d joined (%s)", self.rank, self.world, dist.get_backend())

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs of a row-parallel layer, in place."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[S, vocab_rows] slices of the logits -> [S, vocab_size] on rank 0 (None elsewhere)."""
        if self.world == 1:
            return local[:, :vocab_size]
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None

    def broadcast(self, obj=None):
        """Rank 0 sends `obj` (a StepPlan, KEEPALIVE, or None to stop); every rank returns it. Its length, then
        its integers (step_plan.encode_message), never a pickle. Gloo's send waits for the receiver to be ready,
        so a hung worker times rank 0 out here."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.long)
        if self.rank == 0:
            payload = encode_message(obj)
            size[0] = payload.numel()
        dist.broadcast(size, src=0, group=self._control)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.long)
        dist.broadcast(payload, src=0, group=self._control)
        return obj if self.rank == 0 else decode_message(payload)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks that fit everywhere, a backend all can use)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control)
        return int(t.item())

    def gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's `values` (the same count on each) on rank 0, None elsewhere: each rank's memory, for the
        metrics. Integers, so that what a worker sends is data to rank 0, never code."""
        if self.world == 1:
            return [list(values)]
        import torch.distributed as dist

        local = torch.tensor(values, dtype=torch.long)
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self._control)
        return [[int(v) for v in p] for p in parts] if parts is not None else None

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
