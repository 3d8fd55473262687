"""A local Prometheus server (the Debian package's binary) scraping the engines: for local mode, the demo and the
tests. Data lives in a folder of ours, so a restarted server keeps what it scraped."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import requests
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    def __init__(self, workdir: Path, targets: list[str] | dict[str, list[str]], *, job: str = "chunkpilot",
                 scrape_interval: str = "1s", port: int | None = None, binary: str = "prometheus") -> None:
        """targets: host:port list scraped as `job`, or {job: [host:port, ...]} for several jobs."""
        if shutil.which(binary) is None:
            raise FileNotFoundError(f"{binary} is not installed: `sudo apt-get install prometheus` "
                                    "(or put the binary from prometheus.io on PATH)")
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": name, "static_configs": [{"targets": hosts}]}
                               for name, hosts in (targets if isinstance(targets, dict) else {job: targets}).items()],
        }))
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "prometheus.log"

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if requests.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout}s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
