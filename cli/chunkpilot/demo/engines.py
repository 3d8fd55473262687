"""Engine processes for the demo: `chunkpilot engine serve` on loopback ports."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from chunkpilot.tuner.prometheus_server import free_port


class EngineProcess:
    def __init__(self, model: str, name: str, log_dir: Path, *args: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"engine-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunkpilot.cli.main", "engine", "serve", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--served-model-name", "smollm2", "--log-level", "warning", *args],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> EngineProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"engine {self.name} not ready after {timeout:.0f}s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
