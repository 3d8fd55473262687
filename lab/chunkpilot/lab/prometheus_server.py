"""A local Prometheus server (the Debian package's binary) scraping the engines: for local mode, the demo and the
tests. Data lives in a folder of ours, so a restarted server keeps what it scraped."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from chunkpilot.lab.child_process import die_with_parent, free_port, stop_process, wait_http_ready


class PrometheusServer:
    def __init__(self, workdir: Path, targets: list[str] | dict[str, list[str]], *, job: str = "chunkpilot",
                 scrape_interval: str = "1s", port: int | None = None, binary: str = "prometheus",
                 scrape_configs: list[dict] | None = None) -> None:
        """targets: host:port list scraped as `job`, or {job: [host:port, ...]} for several jobs; or, instead,
        `scrape_configs` as Prometheus takes them (e.g. Kubernetes service discovery)."""
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
            "scrape_configs": scrape_configs or [
                {"job_name": name, "static_configs": [{"targets": hosts}]}
                for name, hosts in (targets if isinstance(targets, dict) else {job: targets}).items()],
        }))
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "prometheus.log"

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        wait_http_ready(self.proc, self.url + "/-/ready", "prometheus", self.log_path, timeout)
        return self

    def stop(self) -> None:
        stop_process(self.proc, 20)
