"""Child processes on loopback (engines, Prometheus) for the demo, local mode and the tests: a free port, waiting
until an HTTP endpoint answers 200 (failing at once, with the log's tail, when the process dies), and stopping
with a grace period. Standard library only: the tuner image, the demo and the tests all use it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when the thread that started it ends (Linux), so a demo or
    a pytest killed outright (no clean-up) leaves no Prometheus, etcd, API server or controller behind."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def wait_http_ready(proc: subprocess.Popen, url: str, what: str, log_path: Path, timeout: float,
                    poll: float = 0.2) -> None:
    """Return when GET `url` answers 200; RuntimeError when `proc` exits first, TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or not ready (503)
        time.sleep(poll)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s:\n{log_tail(log_path)}")


def stop_process(proc: subprocess.Popen | None, grace: float = 30.0, sig: int = signal.SIGTERM) -> int | None:
    """Send `sig`, wait up to `grace` seconds, then kill. Returns the exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
