"""Shared fixtures: the converted SmolLM2 model is made once per machine (cached outside the repo) and loaded
once per test session."""

from __future__ import annotations

import os

import pytest


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (scripts/test.sh runs two workers) each module runs whole on one worker, so its module
    fixtures start once, and every module under tests/cluster/ is one unit: a host runs one kubelet, so they never
    run at the same time. (A scheduler rather than xdist_group marks: xdist 3.8 writes the group into a node id
    that pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/cluster/" if module.startswith("tests/cluster/") else module

    return ByModule(config, log)


def require_tool(name: str, how: str) -> str:
    """The tool's path (PATH, then the cache's bin/ where scripts/go-tools.sh builds helm and kubeconform). In CI a
    missing tool fails the test; locally it skips with how to get it."""
    import shutil
    from pathlib import Path

    cache_bin = Path(os.environ.get("CHUNKPILOT_CACHE", Path.home() / ".cache" / "chunkpilot")) / "bin"
    found = shutil.which(name) or shutil.which(name, path=str(cache_bin))
    if found:
        return found
    message = f"{name} is not installed: {how}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_dir():
    from chunkpilot.engine.model.model_fetch import ModelFetchError, fetch

    try:
        return str(fetch("smollm2"))
    except ModelFetchError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server on loopback (tests/postgres.py), for the tuner's external study storage."""
    from .postgres import HOW, Postgres, find

    for tool in ("initdb", "postgres"):
        if find(tool) is None:
            require_tool(tool, HOW)  # fails under CI=true, skips locally
    server = Postgres().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """A real etcd + kube-apiserver + kube-controller-manager for the whole session (see tests/control_plane.py),
    with the InferenceDeployment CRD installed."""
    from .control_plane import ControlPlane, find_binaries

    found = find_binaries()
    if isinstance(found, str):
        if os.environ.get("CI") == "true":
            pytest.fail(found)
        pytest.skip(found)
    with ControlPlane(tmp_path_factory.mktemp("kube"), found) as cp:
        install_crd(cp)
        yield cp


@pytest.fixture(scope="session")
def chart_accounts(control_plane, tmp_path_factory):
    """The chart's ServiceAccounts and RBAC (rendered by `helm template`, applied to the real API server) and a
    kubeconfig for each, with a token from the TokenRequest API: {"operator": path, "tuner": path}."""
    return install_chart_accounts(control_plane, tmp_path_factory.mktemp("accounts"))


def install_chart_accounts(cluster, out) -> dict:
    """`helm template`'s ServiceAccounts and RBAC applied to `cluster` (a tests.control_plane.ControlPlane), and a
    kubeconfig per account written to the folder `out`."""
    import kubernetes

    from .chart.test_chart import docs, render

    api = cluster.api()
    kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": CHART_NAMESPACE}})
    for doc in docs(render()):
        if doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
            kubernetes.utils.create_from_dict(api, doc, namespace=CHART_NAMESPACE)
    return {c: cluster.service_account_kubeconfig(CHART_NAMESPACE, f"cp-chunkpilot-{c}", out / f"{c}.kubeconfig")
            for c in ("operator", "tuner")}


def install_crd(cluster) -> None:
    """The InferenceDeployment CRD, applied and Established."""
    from pathlib import Path

    import kubernetes
    import yaml

    from .engine.server_proc import wait_for

    crd = yaml.safe_load((Path(__file__).parents[1] / "crds" / "inferencedeployments.chunkpilot.io.yaml").read_text())
    ext = kubernetes.client.ApiextensionsV1Api(cluster.api())
    ext.create_custom_resource_definition(crd)
    name = crd["metadata"]["name"]

    def established() -> bool:
        got = ext.read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])
    assert wait_for(established, 30, poll=0.2), f"CRD {name} not established"


CHART_NAMESPACE = "chunkpilot"  # where tests/chart/test_chart.py's `helm template` puts the chart


def service_account_user(component: str) -> str:
    return f"system:serviceaccount:{CHART_NAMESPACE}:cp-chunkpilot-{component}"
