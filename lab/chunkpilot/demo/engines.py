"""Engine processes for the demo: `chunkpilot engine serve` on loopback ports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from chunkpilot.lab import free_port, stop_process, wait_http_ready


class EngineProcess:
    def __init__(self, model: str, name: str, log_dir: Path, *args: str, cores: set[int] | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"engine-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunkpilot.cli.main", "engine", "serve", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--served-model-name", "smollm2", "--log-level", "warning", *args],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            # pinned before exec, so every thread torch starts inherits the cores
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        self.cores = cores

    def wait_ready(self, timeout: float = 300.0) -> EngineProcess:
        wait_http_ready(self.proc, self.url + "/ready", f"engine {self.name}", self.log_path, timeout, poll=0.3)
        return self

    def stop(self) -> None:
        stop_process(self.proc, 30)
