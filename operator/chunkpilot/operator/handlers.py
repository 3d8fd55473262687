"""kopf wiring, kept thin: every trigger runs the same level-triggered Reconciler pass.

Why event handlers and not kopf's create/update handlers: the knobs live partly in status (the tuner writes
`status.scheduler`), which kopf's change detection ignores, and a pass that reads everything fresh needs no stored
diff-base. Triggers:
* any change of an InferenceDeployment (spec, or the tuner's status.scheduler);
* any change of a Deployment we own (rollout progress → status; someone edited or deleted it → repaired);
* every watch reconnect re-lists all objects (settings.watching.server_timeout = resync), so drift in the other
  children and failed passes are retried at least that often.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field

import kopf

from chunkpilot.api.types import GROUP, KIND, PLURAL, VERSION
from chunkpilot.operator import builders
from chunkpilot.operator.kopf_process import KopfProcess, with_client_login
from chunkpilot.operator.kube import Kube
from chunkpilot.operator.reconciler import Reconciler

log = logging.getLogger(__name__)

# Our own prefix, so kopf's bookkeeping never collides with the tuner's (which is also a kopf process).
ANNOTATION_PREFIX = f"operator.{GROUP}"


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    engine: builders.OperatorSettings = field(default_factory=builders.OperatorSettings)
    peering: str | None = None  # None: standalone (one replica); a name: kopf peering among replicas
    priority: int = 0
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    resync_seconds: int = 300
    workers: int = 16


def kopf_process(config: OperatorConfig) -> KopfProcess:
    return KopfProcess(prefix=ANNOTATION_PREFIX, namespaces=config.namespaces, peering=config.peering,
                       priority=config.priority, liveness=config.liveness, workers=config.workers)


def kopf_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf_process(config).settings()
    # Each reconnect re-lists: the periodic resync. kopf sends this as the watch's `timeoutSeconds`, which a real
    # API server parses as an integer: "300.0" is refused with 400 and nothing is ever watched.
    settings.watching.server_timeout = int(config.resync_seconds)
    settings.watching.client_timeout = int(config.resync_seconds) + 30
    return settings


def build_registry() -> kopf.OperatorRegistry:
    registry = with_client_login(kopf.OperatorRegistry())

    # Passes still queued for the thread pool when we stop just return (they are idempotent; see run()).
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def inference_deployment_changed(event: kopf.RawEvent, memo: kopf.Memo, **_) -> None:
        if event["type"] == "DELETED" or memo.stopping.is_set():
            return
        memo.reconciler.reconcile(event["object"])

    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "chunkpilot-operator"},
                   registry=registry)
    def owned_deployment_changed(event: kopf.RawEvent, memo: kopf.Memo, **_) -> None:
        if memo.stopping.is_set():
            return
        meta = event["object"].get("metadata", {})
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
                memo.reconciler.reconcile_by_name(meta.get("namespace", "default"), ref["name"])

    @kopf.on.probe(id="reconciler", registry=registry)
    def reconciler_alive(memo: kopf.Memo, **_) -> str:
        return "ok" if getattr(memo, "reconciler", None) is not None else "starting"

    return registry


def post_event(obj: dict, type_: str, reason: str, message: str) -> None:
    kopf.event(obj, type=type_, reason=reason, message=message[:1024])


def run(config: OperatorConfig) -> None:
    """Blocks until SIGINT/SIGTERM. kopf runs in a thread of its own (kopf's documented embedding) so that the
    signal reaches us first: the stop flag makes passes still queued for the thread pool return at once, so a
    pod stops in about a second instead of working through its backlog."""
    from chunkpilot.operator.kube import load_config

    load_config()
    stopping = threading.Event()
    memo = kopf.Memo(reconciler=Reconciler(Kube(pool_size=config.workers * 2), config.engine, post_event),
                     stopping=stopping)
    def on_signal(signum, _frame) -> None:
        log.info("%s received: finishing the passes in flight and stopping", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kopf_process(config).run(build_registry(), kopf_settings(config), memo, stopping)
