"""A keyed work queue for level-triggered controllers, with client-go's workqueue semantics: what the operator's
passes (and any controller on this ground floor) run through.

* A key added while it waits is merged: ten events for one object are one pass.
* One pass at a time per key: a key added while its pass runs is queued again for after it, never run beside it.
* The pass reads the object fresh (it gets a key, not an event's copy), so the last pass always sees the last state.
* A pass that asks for it is retried with a per-key backoff (rate-limited requeue); a pass that succeeds resets it.
* Every `resync` seconds every known key is queued again, so drift in children nobody watches is repaired.
* `gate()` is asked before every pass: False holds all passes (a paused peering replica must not act). It is asked
  outside the queue's lock (it may read the API), and a gate that raises keeps its last answer.
* A worker or the clock thread that dies is logged and started again: a queue never loses a thread.
* `health()` says why the queue is stuck, for the liveness probe: work ready that no worker took, a pass running
  past its bound, or a clock thread that stopped ticking. An idle queue, or a standby one, is healthy.

Why our own and not kopf's handlers: kopf runs one handler call per event in its thread pool, with no merging and
no per-object exclusion across triggers (the resource's own events, its Deployments', a resync); the operator held a
lock per object (never pruned), a resync thread of its own and timers for retries. One queue does all of it.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

# process(key) -> True to retry the key after a backoff (e.g. a push failed), False when done
Process = Callable[[Hashable], bool]


class WorkQueue:
    def __init__(self, process: Process, *, workers: int = 4, resync: float = 300.0, backoff: float = 1.0,
                 max_backoff: float = 30.0, gate: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] = time.monotonic, name: str = "work", stall_after: float = 180.0) -> None:
        self.process, self.workers, self.resync_seconds = process, workers, resync
        self.backoff, self.max_backoff, self.gate, self.clock, self.name = backoff, max_backoff, gate, clock, name
        # how long ready work may wait untaken, or one pass run, before health() calls the queue stuck: a pass is
        # bounded by its API calls' timeouts and its pushes' deadlines, far below this
        self.stall_after = stall_after
        self._cv = threading.Condition()
        self._queue: list[Hashable] = []  # FIFO of keys ready to run (each at most once)
        self._queued: set[Hashable] = set()
        self._running: set[Hashable] = set()
        self._again: set[Hashable] = set()  # added while running: queue after the pass
        self._delayed: list[tuple[float, int, Hashable]] = []  # (due, seq, key) heap of rate-limited requeues
        self._seq = 0
        self._failures: dict[Hashable, int] = {}
        self._known: set[Hashable] = set()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._gate_open = False  # the gate's last answer (a gate that raises keeps it)
        self._gate_lock = threading.Lock()  # one gate call at a time: it caches, and its read may be slow
        now = clock()
        self._took = now  # when a worker last took a key, or last found nothing it could take
        self._ticked = now  # when the clock thread last went round
        self._since: dict[Hashable, float] = {}  # running key -> when its pass started
        self.restarts = 0  # threads that died and were started again (the probe reports it)

    # -- producers ----------------------------------------------------------------------------------------
    def add(self, key: Hashable) -> None:
        with self._cv:
            self._known.add(key)
            self._add_locked(key)

    def forget(self, key: Hashable) -> None:
        """The object is gone: no more resyncs or retries for it (a pass already queued still runs and finds it
        gone)."""
        with self._cv:
            self._known.discard(key)
            self._failures.pop(key, None)
            self._delayed = [d for d in self._delayed if d[2] != key]
            heapq.heapify(self._delayed)

    def add_after(self, key: Hashable, delay: float) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._delayed, (self.clock() + delay, self._seq, key))
            self._cv.notify_all()

    def _add_locked(self, key: Hashable) -> None:
        if key in self._running:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.append(key)
            # all: the clock thread waits on the same condition, and a notify() that woke only it would leave the
            # key waiting for a worker's 1 s timeout (measured: knob pushes took 1.0 s instead of 0.1 s)
            self._cv.notify_all()

    def known(self) -> set[Hashable]:
        with self._cv:
            return set(self._known)

    def pending(self) -> int:
        """Keys waiting, running or due later (for tests and the liveness of an idle queue)."""
        with self._cv:
            return len(self._queue) + len(self._running) + len(self._again) + len(self._delayed)

    # -- running ------------------------------------------------------------------------------------------
    def start(self) -> None:
        targets = [(self._work, f"{self.name}-{i}") for i in range(self.workers)]
        for target, name in targets + [(self._clockwork, f"{self.name}-resync")]:
            t = threading.Thread(target=self._supervised, args=(target,), name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        """Queued passes are dropped (they are idempotent and the next process redoes them); running ones finish."""
        self._stopping.set()
        with self._cv:
            self._queue.clear()
            self._queued.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def health(self) -> str | None:
        """None while the queue makes progress; else why not (the liveness probe fails with it, and the kubelet
        restarts the process: a stuck controller that says it is healthy is worse than a restart)."""
        with self._cv:
            now = self.clock()
            if self._queue and now - self._took > self.stall_after:
                return (f"{len(self._queue)} keys ready and no {self.name} worker took one for "
                        f"{now - self._took:.0f} s")
            stuck = [(since, key) for key, since in self._since.items() if now - since > self.stall_after]
            if stuck:
                since, key = min(stuck, key=lambda s: s[0])
                return f"the {self.name} pass for {key} has run for {now - since:.0f} s"
            if self._threads and now - self._ticked > self.stall_after:
                return f"the {self.name} clock thread has not run for {now - self._ticked:.0f} s"
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self._stopping.is_set():
            return f"{self.name} threads ended: {', '.join(dead)}"
        return None

    def _supervised(self, target: Callable[[], None]) -> None:
        """Runs `target` until the queue stops; if it raises, logs it and runs it again after a second, so no
        failure (an API error escaping a gate, a bug in the bookkeeping) ends a worker or the clock for good."""
        while not self._stopping.is_set():
            try:
                target()
            except BaseException:  # noqa: BLE001 - a thread of the queue must outlive any failure
                with self._cv:
                    self.restarts += 1
                log.exception("%s: thread %s failed; starting it again", self.name, threading.current_thread().name)
                self._stopping.wait(1.0)

    def _gate(self) -> bool:
        """The gate's answer, asked outside the queue's lock (it may read the API); a gate that raises keeps the
        last answer."""
        with self._gate_lock:
            try:
                self._gate_open = bool(self.gate())
            except Exception:  # noqa: BLE001 - the peering read failing must not end a thread
                log.warning("%s: the gate failed; keeping its last answer (%s)", self.name,
                            "open" if self._gate_open else "closed", exc_info=True)
            return self._gate_open

    def _next(self) -> Hashable | None:
        while not self._stopping.is_set():
            open_ = self._gate()
            with self._cv:
                now = self.clock()
                if self._queue and open_:
                    key = self._queue.pop(0)
                    self._queued.discard(key)
                    self._running.add(key)
                    self._took = self._since[key] = now
                    return key
                self._took = now  # nothing this worker could take: idle or standing by, not stuck
                self._cv.wait(1.0)  # the gate may open with no one notifying
        return None

    def _work(self) -> None:
        while (key := self._next()) is not None:
            retry = True
            try:
                retry = bool(self.process(key))
            except Exception:  # noqa: BLE001 - one object's failure must not end the worker
                log.exception("%s pass for %s failed; retried after a backoff", self.name, key)
            finally:  # even when the pass ended in a BaseException: the key must not stay "running" for ever
                self._finished(key, retry)

    def _finished(self, key: Hashable, retry: bool) -> None:
        with self._cv:
            self._running.discard(key)
            self._since.pop(key, None)
            if retry and key in self._known and not self._stopping.is_set():
                n = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(self.max_backoff, self.backoff * 2 ** (n - 1))
                self._seq += 1
                heapq.heappush(self._delayed, (self.clock() + delay, self._seq, key))
            elif not retry:
                self._failures.pop(key, None)
            if key in self._again:
                self._again.discard(key)
                self._add_locked(key)
            self._cv.notify_all()

    def _clockwork(self) -> None:
        """Due retries into the queue; every `resync` seconds, every known key (if the gate is open)."""
        next_resync = self.clock() + self.resync_seconds
        while not self._stopping.is_set():
            resync = self.clock() >= next_resync and self._gate()  # asked outside the lock
            with self._cv:
                now = self._ticked = self.clock()
                while self._delayed and self._delayed[0][0] <= now:
                    _, _, key = heapq.heappop(self._delayed)
                    if key in self._known:
                        self._add_locked(key)
                if now >= next_resync:
                    next_resync = now + self.resync_seconds
                    if resync:
                        for key in sorted(self._known, key=str):
                            self._add_locked(key)
                due = [next_resync - now] + ([self._delayed[0][0] - now] if self._delayed else [])
                self._cv.wait(max(0.01, min(min(due), 1.0)))
