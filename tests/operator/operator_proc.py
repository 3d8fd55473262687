"""The operator and tuner as real subprocesses (`chunkpilot operator run`, `chunkpilot tuner run`) against the real
API server of tests/control_plane.py, as the chart's ServiceAccounts, plus small helpers to read the cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes
import yaml
from kubernetes.client import ApiException

from chunkpilot.api.types import GROUP, PLURAL, VERSION
from chunkpilot.lab.child_process import free_port, log_tail, stop_process

from ..control_plane import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "crds" / "samples" / "smollm2.yaml"
CHILDREN = ("configmaps", "deployments", "services", "poddisruptionbudgets")


class ControllerProcess:
    """`chunkpilot <args>` with KUBECONFIG set; stopped by the fixture that started it, on failure too."""

    def __init__(self, kubeconfig: Path, log_path: Path, *args: str) -> None:
        self.kubeconfig, self.log_path, self.args = kubeconfig, log_path, list(args)
        self.proc: subprocess.Popen | None = None

    def start(self) -> ControllerProcess:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", *self.args], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30) -> int | None:
        return stop_process(self.proc, grace, sig)

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def log(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def __enter__(self) -> ControllerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def operator(kubeconfig: Path, workdir: Path, *args: str) -> ControllerProcess:
    """The operator with its default settings, but for the liveness endpoint on a free loopback port (tests run
    side by side)."""
    return ControllerProcess(kubeconfig, workdir / "operator.log", "operator", "run",
                             "--liveness", f"http://127.0.0.1:{free_port()}/healthz", *args)


def tuner(kubeconfig: Path, workdir: Path, *args: str, prometheus_url: str = "http://127.0.0.1:1") -> ControllerProcess:
    """The tuner in cluster mode; by default its Prometheus is unreachable (a port nothing listens on)."""
    return ControllerProcess(kubeconfig, workdir / "tuner.log", "tuner", "run", "--prometheus-url",
                             prometheus_url, "--metrics-port", "0", "--liveness", "",
                             "--storage", f"sqlite:///{workdir / 'study.db'}", *args)


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


class Cluster:
    """Reads and writes as the admin, for assertions and for playing the user."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.apps = kubernetes.client.AppsV1Api(api)
        self.policy = kubernetes.client.PolicyV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"metadata": {"name": name}})
        return name

    def create(self, body: dict) -> dict:
        ns = body["metadata"]["namespace"]
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

    def patch(self, name: str, body: dict, namespace: str, status: bool = False) -> dict:
        fn = self.custom.patch_namespaced_custom_object_status if status else self.custom.patch_namespaced_custom_object
        return fn(GROUP, VERSION, namespace, PLURAL, name, body, _content_type="application/merge-patch+json")

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        """The object as plain JSON (camelCase), or None."""
        try:
            if plural == "inferencedeployments":
                return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            fn = {"configmaps": self.core.read_namespaced_config_map, "services": self.core.read_namespaced_service,
                  "deployments": self.apps.read_namespaced_deployment,
                  "poddisruptionbudgets": self.policy.read_namespaced_pod_disruption_budget,
                  "pods": self.core.read_namespaced_pod, "secrets": self.core.read_namespaced_secret}[plural]
            return json.loads(fn(name, namespace, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def count(self, plural: str, namespace: str) -> int:
        fn = {"configmaps": self.core.list_namespaced_config_map, "services": self.core.list_namespaced_service,
              "deployments": self.apps.list_namespaced_deployment,
              "poddisruptionbudgets": self.policy.list_namespaced_pod_disruption_budget,
              "replicasets": self.apps.list_namespaced_replica_set}[plural]
        kw = {} if plural == "replicasets" else {"label_selector": "app.kubernetes.io/managed-by=chunkpilot-operator"}
        return len(json.loads(fn(namespace, _preload_content=False, **kw).data)["items"])

    def children_exist(self, namespace: str, name: str) -> bool:
        return all(self.get(p, namespace, f"{name}-knobs" if p == "configmaps" else name) for p in CHILDREN)

    def status(self, namespace: str, name: str) -> dict:
        return (self.get("inferencedeployments", namespace, name) or {}).get("status") or {}

    def cond(self, namespace: str, name: str, type_: str) -> dict:
        return next((c for c in self.status(namespace, name).get("conditions") or [] if c["type"] == type_), {})

    def knobs(self, namespace: str, name: str) -> dict:
        cm = self.get("configmaps", namespace, f"{name}-knobs")
        return json.loads(cm["data"]["knobs.json"]) if cm else {}

    def events(self, namespace: str, name: str) -> list[tuple[str, str, str]]:
        items = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        return [(e.type, e.reason, e.message) for e in sorted(items, key=lambda e: e.metadata.creation_timestamp)]

    def delete_namespace(self, name: str, timeout: float = 60, drop_finalizers: bool = False) -> bool:
        """Delete and wait until it is gone (the namespace controller empties it first). `drop_finalizers`: remove
        the tuner's finalizer by hand, as docs/tuner.md tells a user to when the tuner is gone for good."""
        try:
            self.core.delete_namespace(name)
        except ApiException as e:
            if e.status != 404:
                raise
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if drop_finalizers:
                for o in self.custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL)["items"]:
                    if o["metadata"].get("finalizers"):
                        self.patch(o["metadata"]["name"], {"metadata": {"finalizers": None}}, name)
            try:
                self.core.read_namespace(name)
            except ApiException as e:
                if e.status == 404:
                    return True
                raise
            time.sleep(0.5)
        return False
