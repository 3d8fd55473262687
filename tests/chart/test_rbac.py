"""The chart's RBAC is exactly what the code uses. The operator and the tuner run as real processes against the
emulated API server (see tests/operator/test_operator_kmock.py for why kmock) through every path that touches a
new kind of object; each request is recorded with the caller's token, and the set of (API group, resource, verb)
each process used must equal the rules the chart renders for it, but for the few rules listed below with the
reason they cannot show up here."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from ..engine.server_proc import wait_for
from ..operator.kube_emulator import KubeEmulatorThread
from ..operator.operator_proc import client, create, patch, sample
from .test_chart import docs, render

# Rules the chart grants that these runs cannot exercise, and why they are still needed.
NOT_EXERCISED = {
    ("", "namespaces", "list"): "kopf lists namespaces only when --namespace globs are given",
    ("", "namespaces", "watch"): "kopf watches namespaces only when --namespace globs are given",
}


def chart_rules(component: str) -> set[tuple[str, str, str]]:
    out = set()
    for d in docs(render()):
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] in (f"cp-chunkpilot-{component}",
                                                                    f"cp-chunkpilot-{component}-cluster"):
            for rule in d["rules"]:
                out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def start(kube, tmp_path, token: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, KUBECONFIG=str(kube.kubeconfig(tmp_path / f"{token}.kubeconfig", token=token)))
    return subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", *args], env=env,
                            stdout=open(tmp_path / f"{token}.log", "w"), stderr=subprocess.STDOUT)


def used(kube, token: str) -> set[tuple[str, str, str]]:
    return {c.rule for c in kube.handler.calls if c.authorization == f"Bearer {token}"}


def test_roles_equal_the_api_calls_of_operator_and_tuner(tmp_path):
    with KubeEmulatorThread() as kube:
        api = client(kube)
        # The Prometheus Operator's CRD exists, so ServiceMonitors are made (and later deleted).
        kube.handler.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None,
                             "servicemonitors.monitoring.coreos.com"] = {
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"kind": "ServiceMonitor", "plural": "servicemonitors"},
                     "versions": [{"name": "v1", "served": True, "storage": True}]}}
        operator = start(kube, tmp_path, "operator", "operator", "run", "--liveness", "")
        tuner = start(kube, tmp_path, "tuner", "tuner", "run", "--prometheus-url", "http://127.0.0.1:1",
                      "--metrics-port", "0", "--liveness", "", "--storage", f"sqlite:///{tmp_path / 'study.db'}")
        try:
            create(api, sample("a"))  # replicas 2: PDB; serviceMonitor: true; tuning auto
            create(api, sample("b", model__source="pvc://models/smollm2"))  # reads the PVC (missing: Degraded)
            assert wait_for(lambda: kube.get("servicemonitors", "default", "a") is not None, 30), \
                (tmp_path / "operator.log").read_text()[-3000:]
            # Someone edits what the operator owns: the next pass puts it back (a patch of each kind).
            for plural, group, edit in (("services", "v1", {"ports": []}),
                                        ("poddisruptionbudgets", "policy/v1", {"maxUnavailable": 5}),
                                        ("servicemonitors", "monitoring.coreos.com/v1", {"endpoints": []})):
                kube.handler.objects[f"{group}/{plural}", "default", "a"].patch({"spec": edit})
            patch(api, "a", {"metadata": {"labels": {"poke": "1"}}})
            assert wait_for(lambda: sum(1 for c in kube.handler.calls if c.verb == "patch" and c.resource in
                                        ("services", "poddisruptionbudgets", "servicemonitors")) >= 3, 30)
            patch(api, "a", {"spec": {"replicas": 1, "monitoring": {"serviceMonitor": False},
                                      "scheduler": {"tokenBudget": 256}}})
            assert wait_for(lambda: kube.get("poddisruptionbudgets", "default", "a") is None
                            and kube.get("servicemonitors", "default", "a") is None, 30)
            assert wait_for(lambda: ((kube.get("inferencedeployments", "default", "a").get("status") or {})
                                     .get("tuning") or {}).get("phase") == "Holding", 60)
            kube.handler.objects["apps/v1/deployments", "default", "a"].patch(
                {"status": {"readyReplicas": 1}})  # the emulated controller moves: the owned-Deployment trigger
        finally:
            for p in (operator, tuner):
                p.terminate()
                p.wait(40)
        for component in ("operator", "tuner"):
            granted = chart_rules(component)
            calls = used(kube, component)
            assert calls, (tmp_path / f"{component}.log").read_text()[-3000:]
            assert calls <= granted, f"{component} used calls the chart does not grant: {sorted(calls - granted)}"
            unused = granted - calls - set(NOT_EXERCISED)
            assert not unused, f"the chart grants {component} more than it uses: {sorted(unused)}"
        # the rules in the chart are literally these, no wildcards anywhere
        rules = [r for d in docs(render()) if d["kind"] == "ClusterRole" for r in d["rules"]]
        assert not [r for r in rules if "*" in yaml.safe_dump(r)]
