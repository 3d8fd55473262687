"""The local one-node cluster (tests/local_cluster.py) for the tests in this folder, and the Prometheus they need."""

from __future__ import annotations

import os

import pytest


def _unavailable(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """A Ready node with the engine image of the current code loaded, and the InferenceDeployment CRD installed.
    Module scope: one module uses it, and the kubelet should not keep a core busy for the rest of the session."""
    from ..conftest import install_crd
    from ..local_cluster import LocalCluster, engine_image, find_node_binaries

    found = find_node_binaries()
    if isinstance(found, str):
        _unavailable(found)
    image = engine_image()
    if isinstance(image, str):
        _unavailable(image)
    with LocalCluster(tmp_path_factory.mktemp("node"), found, images=[image]) as cluster:
        cluster.engine_image = image[0]
        install_crd(cluster)
        yield cluster


@pytest.fixture(scope="session")
def k8s_prometheus() -> str:
    """Upstream's prometheus (scripts/go-tools.sh): Debian's is built without Kubernetes service discovery."""
    from pathlib import Path

    from ..control_plane import CACHE

    path = CACHE / "bin" / "prometheus"
    if not (path.is_file() and os.access(path, os.X_OK)):
        _unavailable(f"{path} not found: run bash scripts/go-tools.sh (Debian's prometheus has no Kubernetes "
                     "service discovery)")
    return str(path)


def helm_binary() -> str:
    from ..conftest import require_tool

    return require_tool("helm", "bash scripts/go-tools.sh (builds it with `go install` into ~/.cache/chunkpilot/bin)")


@pytest.fixture(scope="module")
def chart_cluster(tmp_path_factory):
    """A Ready node as a cluster the chart is installed into: cluster DNS, a default StorageClass, the Prometheus
    Operator and its Prometheus, NetworkPolicy enforced, and the engine, operator and tuner images of the current code in containerd
    (`image_names`: part -> name). No CRD of ours: `helm install` brings it."""
    from ..local_cluster import LocalCluster, build_image, find_node_binaries

    found = find_node_binaries()
    if isinstance(found, str):
        _unavailable(found)
    images = {}
    for part in ("engine", "operator", "tuner"):
        built = build_image(part)
        if isinstance(built, str):
            _unavailable(built)
        images[part] = built
    # NetworkPolicy enforced (kube-router's firewall): the chart's and the operator's policies are tested for real
    with LocalCluster(tmp_path_factory.mktemp("chart-node"), found, images=list(images.values()),
                      prometheus_operator=True, network_policy=True) as cluster:
        cluster.image_names = {part: name for part, (name, _) in images.items()}
        yield cluster
