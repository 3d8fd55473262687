"""The one HPA check both controllers make: which HorizontalPodAutoscalers target an object. The operator leaves a
Deployment's replicas to an HPA on it; the tuner refuses autoscaling.mode auto while an HPA targets the resource or
its Deployment: two controllers must not fight over replicas. One namespace's list is read at most every `seconds`
and serves every object in it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from chunkpilot.kube.client import Kube

Target = tuple[str, str, str]  # (API group, "" for the core group; kind; name)


def targeting(items: list[dict], targets: list[Target]) -> dict[str, Target]:
    """{HPA name: the target it names} for the HPAs (autoscaling/v2 objects) whose scaleTargetRef is in `targets`."""
    out = {}
    for hpa in items:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        api_version = ref.get("apiVersion") or ""
        target = (api_version.split("/")[0] if "/" in api_version else "", ref.get("kind"), ref.get("name"))
        if target in targets:
            out[hpa["metadata"]["name"]] = target
    return out


class AutoscalerCheck:
    def __init__(self, kube: Kube, seconds: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.seconds, self.clock = kube, seconds, clock
        self._lists: dict[str, tuple[float, list[dict]]] = {}
        self._lock = threading.Lock()

    def targeting(self, namespace: str, targets: list[Target]) -> dict[str, Target]:
        """Raises the API's error when the list cannot be read (each caller decides what not knowing means)."""
        now = self.clock()
        with self._lock:
            hit = self._lists.get(namespace)
        if hit is None or now - hit[0] >= self.seconds:
            hit = (now, self.kube.list_autoscalers(namespace))
            with self._lock:
                self._lists[namespace] = hit
        return targeting(hit[1], targets)
