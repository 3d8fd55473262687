"""End to end against a real cluster (kind, k3d or a real one). Deselected by default (marker `e2e`): it needs a
cluster, which these CI machines cannot run. Run it with

    CHUNKPILOT_E2E_CONTEXT=kind-kind .venv/bin/pytest -m e2e tests/operator/test_e2e_cluster.py

It installs the CRD, runs `chunkpilot operator run` against that context in a fresh namespace and checks what the
emulator cannot: real schema/CEL admission, real server-side apply, and garbage collection through the owner
references. Pods need not become ready (no model is mounted), so no GPU or image pull is required."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import yaml

from ..engine.server_proc import wait_for

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "chunkpilot.io", "v1alpha1", "inferencedeployments"


@pytest.fixture(scope="module")
def context_kubeconfig(tmp_path_factory):
    context = os.environ.get("CHUNKPILOT_E2E_CONTEXT")
    if not context:
        pytest.fail("set CHUNKPILOT_E2E_CONTEXT to the kube context to test against (e.g. kind-kind)")
    src = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
    conf = yaml.safe_load(src.read_text())
    conf["current-context"] = context  # the operator and kopf both read the current context
    out = tmp_path_factory.mktemp("e2e") / "kubeconfig"
    out.write_text(yaml.safe_dump(conf))
    return out


def test_operator_on_a_real_cluster(context_kubeconfig, tmp_path):
    import kubernetes

    from .operator_proc import sample

    api = kubernetes.config.new_client_from_config(str(context_kubeconfig))
    ext = kubernetes.client.ApiextensionsV1Api(api)
    crd = yaml.safe_load((ROOT / "crds" / "inferencedeployments.chunkpilot.io.yaml").read_text())
    try:
        ext.create_custom_resource_definition(crd)
    except kubernetes.client.ApiException as e:
        assert e.status == 409, e
    ns = f"chunkpilot-e2e-{uuid.uuid4().hex[:6]}"
    core, apps = kubernetes.client.CoreV1Api(api), kubernetes.client.AppsV1Api(api)
    co = kubernetes.client.CustomObjectsApi(api)
    core.create_namespace({"metadata": {"name": ns}})
    import subprocess
    import sys

    env = dict(os.environ, KUBECONFIG=str(context_kubeconfig))
    log = open(tmp_path / "operator.log", "w")
    op = subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", "operator", "run", "-n", ns,
                           "--liveness", ""], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        body = sample("e2e", ns, replicas=1, engine__resources={"gpus": 0, "cpu": "1", "memory": "1Gi"},
                      model__source="hostpath:///nonexistent-model")
        time.sleep(2)
        co.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)

        def read(fn, name):
            try:
                return fn(name, ns)
            except kubernetes.client.ApiException:
                return None
        assert wait_for(lambda: read(apps.read_namespaced_deployment, "e2e") is not None, 60)
        assert read(core.read_namespaced_config_map, "e2e-knobs") and read(core.read_namespaced_service, "e2e")
        gen = apps.read_namespaced_deployment("e2e", ns).metadata.generation
        co.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e",
                                          {"spec": {"scheduler": {"tokenBudget": 64, "maxChunk": 32}}})
        assert wait_for(lambda: '"token_budget": 64' in core.read_namespaced_config_map("e2e-knobs", ns)
                        .data["knobs.json"], 60)
        assert apps.read_namespaced_deployment("e2e", ns).metadata.generation == gen  # no roll
        obj = co.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e")
        assert {c["type"] for c in obj["status"]["conditions"]} >= {"Ready", "Progressing", "Degraded"}
        with pytest.raises(kubernetes.client.ApiException) as rejected:  # CEL: maxChunk <= tokenBudget
            co.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e",
                                              {"spec": {"scheduler": {"maxChunk": 4096}}})
        assert rejected.value.status == 422
        co.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e")
        assert wait_for(lambda: read(apps.read_namespaced_deployment, "e2e") is None, 120)  # garbage collected
    finally:
        op.terminate()
        op.wait(30)
        core.delete_namespace(ns)
