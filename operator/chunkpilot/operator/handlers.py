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

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass, field

import kopf

from chunkpilot.api.types import GROUP, KIND, PLURAL, VERSION
from chunkpilot.operator import builders
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
    resync_seconds: float = 300.0
    workers: int = 16


def kopf_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    settings.watching.server_timeout = config.resync_seconds
    settings.watching.client_timeout = config.resync_seconds + 30
    settings.execution.max_workers = config.workers
    # Only our explicit Events (Created, KnobsChanged, InvalidSpec...) reach `kubectl describe`, not kopf's chatter.
    settings.posting.level = logging.WARNING
    settings.peering.standalone = config.peering is None
    if config.peering:
        settings.peering.name = config.peering
        settings.peering.priority = config.priority
        settings.peering.clusterwide = not config.namespaces
    return settings


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    # A registry of our own starts without kopf's default login; use the kubernetes client's (in-cluster
    # service account, else kubeconfig), the same credentials our Kube calls use.
    @kopf.on.login(registry=registry)
    def login(**kwargs) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

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
    failure: list[BaseException] = []

    def operate() -> None:
        try:
            asyncio.run(kopf.operator(
                registry=build_registry(),
                settings=kopf_settings(config),
                clusterwide=not config.namespaces,
                namespaces=list(config.namespaces),
                standalone=config.peering is None,
                peering_name=config.peering,
                priority=config.priority,
                liveness_endpoint=config.liveness,
                memo=memo,
                stop_flag=stopping,
            ))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    def on_signal(signum, _frame) -> None:
        log.info("%s received: finishing the passes in flight and stopping", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    thread = threading.Thread(target=operate, name="kopf", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if failure:
        raise SystemExit(f"operator stopped: {failure[0]!r}")
