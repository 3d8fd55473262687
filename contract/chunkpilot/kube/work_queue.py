"""A keyed work queue for level-triggered controllers, with client-go's workqueue semantics: what the operator's
passes (and any controller on this ground floor) run through.

* A key added while it waits is merged: ten events for one object are one pass.
* One pass at a time per key: a key added while its pass runs is queued again for after it, never run beside it.
* The pass reads the object fresh (it gets a key, not an event's copy), so the last pass always sees the last state.
* A pass that asks for it is retried with a per-key backoff (rate-limited requeue); a pass that succeeds resets it.
* Every `resync` seconds every known key is queued again, so drift in children nobody watches is repaired.
* `gate()` is asked before every pass: False holds all passes (a paused peering replica must not act).

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
                 clock: Callable[[], float] = time.monotonic, name: str = "work") -> None:
        self.process, self.workers, self.resync_seconds = process, workers, resync
        self.backoff, self.max_backoff, self.gate, self.clock, self.name = backoff, max_backoff, gate, clock, name
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
            t = threading.Thread(target=target, name=name, daemon=True)
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

    def _next(self) -> Hashable | None:
        with self._cv:
            while not self._stopping.is_set():
                if self._queue and self.gate():
                    key = self._queue.pop(0)
                    self._queued.discard(key)
                    self._running.add(key)
                    return key
                self._cv.wait(1.0)  # the gate may open with no one notifying
            return None

    def _work(self) -> None:
        while (key := self._next()) is not None:
            retry = False
            try:
                retry = bool(self.process(key))
            except Exception:  # noqa: BLE001 - one object's failure must not end the worker
                log.exception("%s pass for %s failed; retried after a backoff", self.name, key)
                retry = True
            with self._cv:
                self._running.discard(key)
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
        """Due retries into the queue; every `resync` seconds, every known key."""
        next_resync = self.clock() + self.resync_seconds
        while not self._stopping.is_set():
            with self._cv:
                now = self.clock()
                while self._delayed and self._delayed[0][0] <= now:
                    _, _, key = heapq.heappop(self._delayed)
                    if key in self._known:
                        self._add_locked(key)
                if now >= next_resync:
                    next_resync = now + self.resync_seconds
                    if self.gate():
                        for key in sorted(self._known, key=str):
                            self._add_locked(key)
                due = [next_resync - now] + ([self._delayed[0][0] - now] if self._delayed else [])
                self._cv.wait(max(0.01, min(min(due), 1.0)))
