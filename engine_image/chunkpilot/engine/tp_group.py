"""The collectives one tensor-parallel engine needs, behind one small object.

`TPGroup.solo()` is the single-rank engine: every method is a no-op or an identity, so the model and runner have
no `if world > 1` of their own. A distributed group uses NCCL on CUDA for the tensors (one all-reduce after
each row-parallel layer, a gather of the vocabulary slices of the logits) and a gloo group for the step plan,
which is a Python object built on rank 0's CPU.

Every collective has the group's timeout: a rank that hangs turns into an exception on rank 0 within it, never
into a silent stall (llm_engine turns that exception into a non-zero exit, so Kubernetes restarts the pod). An
idle engine sends no plans, so rank 0 sends KEEPALIVE in their place (llm_engine's keep-alive thread): the
workers' wait for the next plan never times out on an engine that merely has no requests, and a worker that hangs
while it is idle is found by the next keep-alive's timeout.
"""

from __future__ import annotations

import datetime
import logging
import time

import torch

log = logging.getLogger(__name__)

# Broadcast in place of a plan while the engine is idle; the workers wait for the next one.
KEEPALIVE = "keepalive"


class TPGroup:
    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.world = world
        self._control = None  # gloo group for Python objects (plans, KV blocks, memory); None = the default group

    @classmethod
    def solo(cls) -> "TPGroup":
        return cls()

    @staticmethod
    def host_store(world: int, join_timeout_s: float):
        """Rank 0's rendezvous store on a free loopback port (all ranks live in one pod); `.port` tells the
        workers where it is."""
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=join_timeout_s),
                             wait_for_workers=False)

    @staticmethod
    def worker_store(port: int, world: int, join_timeout_s: float):
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=join_timeout_s))

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
        """Rank 0 sends `obj` (a step plan, KEEPALIVE, or None to stop); every rank returns it. Gloo's send waits
        for the receiver to be ready, so a hung worker times rank 0 out here."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks that fit everywhere, a backend all can use)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control)
        return int(t.item())

    def gather_objects(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere): each rank's memory, for the metrics."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._control)
        return out

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
