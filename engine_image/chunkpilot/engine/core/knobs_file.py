"""The watcher that applies a valid knobs file at the next step boundary (the file's reader and writer are the
contract's, chunkpilot.contract.knobs, re-exported here for the engine).

In a pod the file is a ConfigMap volume: the kubelet writes a new timestamped folder and swaps the `..data`
symlink, so the path's inode and mtime may not change the way an editor's save does, and inotify on the file
itself misses the swap. Polling the *content* (resolving symlinks on each read) sees every update, costs one
small read per interval and is what config reloaders fall back to; the kubelet's own propagation delay (up to a
minute) dwarfs a 0.2 s poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from chunkpilot.contract.knobs import SchedulerKnobs, dumps_knobs, parse_knobs, write_knobs  # noqa: F401
from chunkpilot.engine.core.knobs import KnobHolder

log = logging.getLogger(__name__)


class KnobsFileWatcher:
    def __init__(
        self,
        path: str | Path,
        holder: KnobHolder,
        *,
        poll_interval: float = 0.2,
        on_error: Callable[[str], None] | None = None,
        on_apply: Callable[[SchedulerKnobs], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.holder = holder
        self.poll_interval = poll_interval
        self.on_error = on_error
        self.on_apply = on_apply
        self._last: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="knobs-file-watcher", daemon=True)
        self.last_error: str | None = None

    def start(self) -> None:
        self.check()  # apply a file that exists at start-up before serving the first request
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.check()
            except Exception as e:  # never let the watcher die silently: later changes would be ignored
                log.exception("knobs file watcher error")
                self._refuse(f"knobs file watcher error: {type(e).__name__}: {e}", None)

    def check(self) -> bool:
        """Read the file once; apply it if its content changed and is valid. Returns True when applied."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False  # no file yet (or mid-swap): keep the current knobs, nothing to report
        except OSError as e:
            return self._refuse(f"cannot read knobs file {self.path}: {e}", None)
        if data == self._last:
            return False
        try:
            knobs = parse_knobs(data)
            if knobs == self.holder.get():
                self._last = data
                return False
            self.holder.set(knobs)
        except (ValueError, RecursionError) as e:
            return self._refuse(f"refused knobs file {self.path}: {e}; keeping {self.holder.get()}", data)
        self._last = data
        self.last_error = None
        log.info("applied knobs %s from %s", knobs, self.path)
        if self.on_apply:
            self.on_apply(knobs)
        return True

    def _refuse(self, message: str, data: bytes | None) -> bool:
        # Remember the bad content so it is counted and logged once, not at every poll.
        self._last = data
        self.last_error = message
        log.warning("%s", message)
        if self.on_error:
            self.on_error(message)
        return False
