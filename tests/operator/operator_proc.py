"""`chunkpilot operator run` as a real subprocess against the emulated API server, plus small helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import kubernetes
import yaml

from chunkpilot.api.types import GROUP, PLURAL, VERSION

from .kube_emulator import KubeEmulatorThread

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "crds" / "samples" / "smollm2.yaml"


class OperatorProcess:
    def __init__(self, kube: KubeEmulatorThread, workdir: Path, *args: str) -> None:
        self.kubeconfig = kube.kubeconfig(workdir / "kubeconfig.yaml")
        self.log_path = workdir / "operator.log"
        self.args = ["--liveness", "", "--resync", "30", *args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", "operator", "run", *self.args],
                                         env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def client(kube: KubeEmulatorThread) -> kubernetes.client.ApiClient:
    conf = kubernetes.client.Configuration(host=kube.url)
    conf.connection_pool_maxsize = 8
    return kubernetes.client.ApiClient(conf)


def sample(name: str, namespace: str = "default", **spec_overrides) -> dict:
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"] = {"name": name, "namespace": namespace}
    for path, value in spec_overrides.items():
        node = body["spec"]
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return body


def create(api: kubernetes.client.ApiClient, body: dict) -> dict:
    ns = body["metadata"]["namespace"]
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)


def patch(api: kubernetes.client.ApiClient, name: str, body: dict, namespace: str = "default",
          status: bool = False) -> dict:
    co = kubernetes.client.CustomObjectsApi(api)
    fn = co.patch_namespaced_custom_object_status if status else co.patch_namespaced_custom_object
    return fn(GROUP, VERSION, namespace, PLURAL, name, body, _content_type="application/merge-patch+json")
