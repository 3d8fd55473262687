"""Start `chunkpilot engine serve` as a real process on a free loopback port, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from chunkpilot.lab.child_process import free_port, stop_process, wait_http_ready


class EngineServer:
    def __init__(self, model: str, log_dir: Path, *args: str, name: str = "smollm2", env: dict | None = None,
                 port: int | None = None, host: str = "127.0.0.1") -> None:
        """`port`: one chosen beforehand (free_port), where another process must be told it first; `host`: another
        loopback address, where a test gives the engine a fixed port (a pod's) that 127.0.0.1 may have taken."""
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.name = name
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "chunkpilot.cli.main", "engine", "serve", "--model", model, "--host", host,
               "--port", str(self.port), "--served-model-name", name, "--log-level", "warning", *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120) -> "EngineServer":
        self._log.flush()
        try:
            wait_http_ready(self.proc, self.url + "/ready", "server", self.log_path, timeout)
        except BaseException:  # a fixture that fails here never reaches its stop(): the engine must not outlive it
            self.stop(sig=signal.SIGKILL, timeout=10)
            raise
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                key = s.name + (str(sorted(labels.items())) if labels else "")
                out[key] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        code = stop_process(self.proc, timeout, sig)
        self._log.close()
        return code


def wait_for(cond, timeout: float = 30.0, poll: float = 0.05) -> bool:
    """Poll `cond` until it is true or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return False


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> None:
    """`r` is an error of `status` in OpenAI's shape whose message says each of `words`."""
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
