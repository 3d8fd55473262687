"""The Gateway API Inference Extension's parts on the emulated API server (tests/control_plane.py): its v1.5.0 CRDs
and the Gateway API's HTTPRoute, as scripts/gateway-tools.sh caches them, installed for a module and removed after it
(other modules expect a cluster without them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import yaml

from ..conftest import require_tool
from ..waiting import eventually

CACHE = Path(os.environ.get("CHUNKPILOT_CACHE", Path.home() / ".cache" / "chunkpilot"))
GIE_CRDS = CACHE / "gie" / "v1.5.0" / "crds"
GATEWAY_CRDS = CACHE / "gateway-api" / "v1.4.1" / "crds"
HOW = "bash scripts/gateway-tools.sh (builds the endpoint picker and copies the CRDs)"
EPP = "epp-v1.5.0"


def crd_docs() -> list[dict]:
    for d in (GIE_CRDS, GATEWAY_CRDS):
        if not d.is_dir():
            require_tool(f"{d.parent.name}-{d.name}-crds", HOW)  # fails in CI, skips locally, saying how
    files = sorted(GIE_CRDS.glob("*.yaml")) + [GATEWAY_CRDS / "gateway.networking.k8s.io_httproutes.yaml"]
    return [yaml.safe_load(f.read_text()) for f in files]


@contextlib.contextmanager
def installed_crds(control_plane) -> Iterator[None]:
    docs = crd_docs()
    ext = kubernetes.client.ApiextensionsV1Api(control_plane.api())
    names = {c["metadata"]["name"] for c in docs}
    for crd in docs:
        ext.create_custom_resource_definition(crd)

    def established(name: str) -> bool:
        return any(c.type == "Established" and c.status == "True"
                   for c in ext.read_custom_resource_definition(name).status.conditions or [])
    try:
        assert eventually(lambda: all(established(n) for n in names))
        yield
    finally:
        for name in names:
            ext.delete_custom_resource_definition(name)
        assert eventually(lambda: not names & {c.metadata.name for c in ext.list_custom_resource_definition().items}), \
            "the Gateway API Inference Extension's CRDs must be gone before other modules run"
