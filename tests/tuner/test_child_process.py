"""The child-process helpers every server start goes through (engines in the demo and tests, Prometheus): a
process that dies while starting is reported at once with its log, a silent one times out, stop kills a process
that ignores SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from chunkpilot.lab.child_process import free_port, stop_process, wait_http_ready


def start(tmp_path, code: str) -> tuple[subprocess.Popen, object]:
    log = tmp_path / "child.log"
    return subprocess.Popen([sys.executable, "-c", code], stdout=open(log, "w"), stderr=subprocess.STDOUT), log


def test_a_child_that_dies_is_reported_with_its_log(tmp_path):
    proc, log = start(tmp_path, "print('model folder not found', flush=True); raise SystemExit(3)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)engine x exited with 3.*model folder not found"):
        wait_http_ready(proc, f"http://127.0.0.1:{free_port()}/ready", "engine x", log, timeout=30)
    assert time.monotonic() - t0 < 10  # not the whole timeout


def test_a_silent_child_times_out_and_stop_kills_what_ignores_sigterm(tmp_path):
    proc, log = start(tmp_path, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                "print('ready', flush=True); time.sleep(60)")
    try:
        with pytest.raises(TimeoutError, match="prometheus not ready after 1s"):
            wait_http_ready(proc, f"http://127.0.0.1:{free_port()}/-/ready", "prometheus", log, timeout=1)
    finally:
        t0 = time.monotonic()
        code = stop_process(proc, grace=1)
    assert code is not None and code < 0  # killed by a signal, after the grace period
    assert time.monotonic() - t0 < 10
    assert stop_process(None) is None
