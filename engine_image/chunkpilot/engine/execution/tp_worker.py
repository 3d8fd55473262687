"""The engine's own tensor-parallel worker processes: rank 0 (the engine) starts ranks 1..N-1 inside the same
container, so a pod needs no launcher (no torchrun, no LeaderWorkerSet).

Each worker loads its shard, joins the group, then runs the forward of every plan rank 0 broadcasts until it
receives None. Failure is never silent:
* a worker that dies (OOM-killed, segfault, kill -9) is seen by rank 0's watchdog within a second, and the engine
  exits non-zero, so Kubernetes restarts the pod;
* a worker that hangs makes rank 0's next collective time out (`tensor_parallel_timeout`), which exits the same
  way;
* if rank 0 dies, its workers notice within a second (they are re-parented) and exit; their collectives would
  fail anyway.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

# The status an engine exits with when a rank failed: restart the pod.
RANK_FAILED_EXIT = 1


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or hung: this engine cannot step any more (offline use; a server exits)."""


class WorkerProcesses:
    """Ranks 1..N-1 of one engine, as child processes of rank 0.

    A rank that fails while the engine is built only marks the group failed: rank 0 then raises (its own error, or
    RankFailedError), so a clear start-up error (a KV cache too small, on every rank at once) reaches /ready and
    the log instead of "rank 1 exited". Once `arm()`ed, with `exit_on_failure` a failure ends the whole process
    (the server: Kubernetes restarts the pod); without it the engine's next step raises RankFailedError (the
    offline `LLM`, which must not take its caller's process down)."""

    def __init__(self, config, world: int, rendezvous, *, exit_on_failure: bool = True) -> None:
        """`rendezvous`: rank 0's tp_group.Rendezvous; its directory goes once the workers are reaped."""
        self.exit_on_failure = exit_on_failure
        self._rendezvous = rendezvous
        self.failure: str | None = None
        self._armed = False
        self._stopping = threading.Event()
        self._reaped = False
        payload = json.dumps(dataclasses.asdict(config))
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, world):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "chunkpilot.engine.execution.tp_worker",
                                                    str(rank), str(world), rendezvous.path, payload]))
        except BaseException:  # the ones already started must not outlive this
            self.kill()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def arm(self) -> None:
        """The engine is built: from now on a failed rank is handled as `exit_on_failure` says."""
        self._armed = True

    def check(self) -> None:
        """Raise RankFailedError when a rank has failed (while rank 0 waits for the others to load)."""
        if self.failure:
            raise RankFailedError(self.failure)

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None and not self._stopping.is_set():
                    self.fail(f"tensor-parallel rank {rank} (pid {p.pid}) exited with status {code}")

    def begin_stop(self) -> None:
        """Before rank 0 broadcasts the stop: the workers' exits from here on are expected."""
        self._stopping.set()

    def stop(self, timeout: float = 10.0) -> None:
        """After rank 0 broadcast the stop (None): wait for the workers, then kill whoever is left."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._reaped = True
        self._rendezvous.close()

    def kill(self) -> None:
        """Kill every worker still running and reap them all (no zombies). Idempotent."""
        self._stopping.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self._reaped = True
        self._rendezvous.close()

    @property
    def reaped(self) -> bool:
        return self._reaped

    def fail(self, reason: str) -> None:
        """A rank died or hung: the group cannot go on and no request can finish. Kill the other workers, then
        exit non-zero at once (from any thread: a dead collective may never return), so Kubernetes restarts
        the pod; or, offline or while the engine is still being built, remember why for rank 0 to raise."""
        self.failure = self.failure or reason
        self.kill()
        if not (self.exit_on_failure and self._armed):
            log.error("%s: the engine cannot step any more", reason)
            return
        log.critical("%s: the engine exits (status %d) so that the pod restarts", reason, RANK_FAILED_EXIT)
        logging.shutdown()
        os._exit(RANK_FAILED_EXIT)


def _die_with_parent(parent: int) -> None:
    """Exit once rank 0 is gone (this process is re-parented). Not PR_SET_PDEATHSIG: that fires when the
    *thread* that started the worker ends, and the server starts them from its model-loading thread."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(RANK_FAILED_EXIT)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    rank, world, store_path = int(argv[0]), int(argv[1]), argv[2]
    _die_with_parent(os.getppid())
    # Shutdown is rank 0's: it stops the workers after draining. A terminal's Ctrl-C (SIGINT to the whole process
    # group) or a SIGTERM sent to every process must not kill a worker under a step that is still running.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    import torch

    from chunkpilot.engine.config import EngineConfig
    from chunkpilot.engine.model.model_config import ModelConfig
    from chunkpilot.engine.parallel.tp_group import KEEPALIVE, TPGroup, open_store
    from chunkpilot.engine.execution.worker import Worker

    config = EngineConfig(**json.loads(argv[3]))
    if config.threads:
        torch.set_num_threads(config.threads)
    group = TPGroup(rank, world)
    store = open_store(store_path, world, config.tensor_parallel_join_timeout)
    try:
        worker = Worker(config, ModelConfig.from_dir(config.model), group, store)
        group.gather_ints(worker.memory.values())
        while (plan := group.broadcast()) is not None:
            if plan != KEEPALIVE:
                worker.runner.forward(plan)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        return RANK_FAILED_EXIT
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
