"""Removing the finalizer that kopf daemons of earlier tuner versions left on InferenceDeployments.

The tuner itself never patches InferenceDeployments (its role has only their status and scale subresources), so
it cannot take the old `tuner.chunkpilot.io/finalizer` off: a resource still carrying it would wait for ever on
delete. The chart's post-install/post-upgrade hook Job runs `chunkpilot tuner drop-legacy-finalizers` once, as a
ServiceAccount of its own that may list and patch InferenceDeployments and is deleted with the Job when it
succeeds.
"""

from __future__ import annotations

import logging

from kubernetes.client import ApiException

from chunkpilot.api.types import GROUP
from chunkpilot.kube.client import Kube
from chunkpilot.kube.object_key import ObjectKey

log = logging.getLogger(__name__)

LEGACY_FINALIZER = f"tuner.{GROUP}/finalizer"


def drop_legacy_finalizers(kube: Kube, namespaces: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Take LEGACY_FINALIZER off every InferenceDeployment (of `namespaces`, or all) that carries it; returns
    "namespace/name" of each one changed. An object whose finalizer list changed meanwhile (422) or that is gone
    is left for the next run."""
    changed = []
    for obj in kube.list_inference_deployments(namespaces):
        meta = obj["metadata"]
        key, finalizers = ObjectKey.from_meta(meta), meta.get("finalizers") or []
        if LEGACY_FINALIZER not in finalizers:
            continue
        try:
            kube.remove_finalizer(*key, LEGACY_FINALIZER, finalizers.index(LEGACY_FINALIZER))
        except ApiException as e:
            if e.status in (404, 409, 422):
                log.warning("%s: legacy finalizer not removed (%s %s)", key, e.status, e.reason)
                continue
            raise
        changed.append(str(key))
    return changed
