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


class SteadyLoad:
    """Two clients sending short completions through a gateway one after another until stop(), each outcome
    recorded ("ok", or the error): what a restart or a deleted pod under load must not fail. A context manager, so
    its threads end when a test fails too."""

    def __init__(self, base_url: str, clients: int = 2) -> None:
        import threading

        import openai

        self.results: list[str] = []  # list.append is atomic: the clients' threads share it without a lock
        self._stop = threading.Event()
        self._client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        import openai

        while not self._stop.is_set():
            try:
                out = self._client.completions.create(model="smollm2", prompt="Tell me about bicycles.",
                                                      max_tokens=2, extra_body={"ignore_eos": True})
                self.results.append("ok" if out.usage.completion_tokens == 2 else f"short: {out}")
            except openai.APIError as e:
                self.results.append(f"{type(e).__name__}: {e}")

    def __enter__(self) -> "SteadyLoad":
        for th in self._threads:
            th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for th in self._threads:
            th.join()

    def failed(self) -> list[str]:
        return [r for r in self.results if r != "ok"]
