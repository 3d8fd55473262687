"""One tuning thread per InferenceDeployment whose tuning mode is on, started and stopped from watch events.

Not kopf daemons, on purpose: kopf puts a finalizer on every resource a daemon runs for, so deleting a tuned
resource hung whenever the tuner was down, scaled to zero or uninstalled, and its GPU pods kept running.
Correctness needs no finalizer: the tuner only writes the resource's status, and its loop reads the resource every
window and ends when it is gone. A DELETED event, a deletion timestamp or tuning switched off stops the thread.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from chunkpilot.kube.object_key import ObjectKey

log = logging.getLogger(__name__)

# (namespace, name, uid, stop) -> returns when the resource (that uid) is gone or `stop` is set; retries its own
# failures (daemon.tune_one, retry.py), so whatever escapes it is a bug, not weather
TuneOne = Callable[[str, str, str, threading.Event], None]


def tuning_on(obj: dict) -> bool:
    return ((obj.get("spec") or {}).get("tuning") or {}).get("mode", "off") in ("auto", "advisory")


@dataclass
class _Worker:
    thread: threading.Thread
    stop: threading.Event
    uid: str


class Supervisor:
    def __init__(self, tune_one: TuneOne) -> None:
        self.tune_one = tune_one
        self._workers: dict[ObjectKey, _Worker] = {}
        self._lock = threading.Lock()

    def observe(self, event_type: str | None, obj: dict) -> None:
        """Called for every watch event (and the initial listing, type None) of an InferenceDeployment."""
        meta = obj.get("metadata") or {}
        key, uid = ObjectKey.from_meta(meta), meta.get("uid", "")
        want = event_type != "DELETED" and not meta.get("deletionTimestamp") and tuning_on(obj)
        with self._lock:
            worker = self._workers.get(key)
            if worker is not None and worker.uid != uid:  # deleted and made again (a missed DELETED event)
                worker.stop.set()
                del self._workers[key]
                worker = None
            if want and (worker is None or not worker.thread.is_alive()):
                stop = threading.Event()
                # kopf.event() (the tuner's Events) reads kopf's context variables: the thread takes the
                # handler's context with it, as kopf does for its own sync handlers.
                context = contextvars.copy_context()
                thread = threading.Thread(target=context.run, args=(self._run, key, uid, stop),
                                          name=f"tune-{key}", daemon=True)
                self._workers[key] = _Worker(thread, stop, uid)
                thread.start()
            elif not want and worker is not None:
                worker.stop.set()
                del self._workers[key]

    def running(self) -> set[ObjectKey]:
        with self._lock:
            return {k for k, w in self._workers.items() if w.thread.is_alive()}

    def stop_all(self, timeout: float = 30.0) -> None:
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for w in workers:
            w.stop.set()
        for w in workers:
            w.thread.join(timeout)

    def _run(self, key: ObjectKey, uid: str, stop: threading.Event) -> None:
        """Runs tune_one once: it returns when the resource is gone or `stop` is set, and retries its own failures
        (retry.py, the one retry layer). A second layer here would restart a loop that is meant to go on."""
        try:
            self.tune_one(key.namespace, key.name, uid, stop)
        except Exception:  # noqa: BLE001 - a bug in one resource's thread must not end the others' tuning
            log.exception("tuning %s ended by an unexpected error; the next event for it starts a fresh thread", key)
        with self._lock:  # a finished thread leaves, so a later event can start a fresh one
            if self._workers.get(key) is not None and self._workers[key].stop is stop:
                del self._workers[key]
