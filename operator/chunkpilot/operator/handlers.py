"""kopf wiring, kept thin: every trigger runs the same level-triggered Reconciler pass.

Why event handlers and not kopf's create/update handlers: the knobs live partly in status (the tuner writes
`status.scheduler`), which kopf's change detection ignores, and a pass that reads everything fresh needs no stored
diff-base. Triggers:
* any change of an InferenceDeployment (spec, or the tuner's status.scheduler);
* any change of a Deployment we own (rollout progress → status; someone edited or deleted it → repaired);
* every `resync` seconds, a pass over every InferenceDeployment seen, so drift in the children we do not watch
  (someone deleted the ConfigMap or edited the Service) and failed passes are repaired at least that often. A watch
  reconnect is not enough for that: kopf continues each watch from its last resourceVersion (bookmarks keep it
  fresh), so the server sends only new events and nothing is re-listed unless the version expired (410).
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field

import kopf

from chunkpilot.api.types import GROUP, KIND, PLURAL, VERSION
from chunkpilot.kube.client import Kube, load_config
from chunkpilot.kube.kopf_process import KopfProcess, with_client_login
from chunkpilot.operator import builders
from chunkpilot.operator.apply import FIELD_MANAGER
from chunkpilot.operator.reconciler import Reconciler

log = logging.getLogger(__name__)

# Our own prefix, so kopf's bookkeeping never collides with the tuner's (which is also a kopf process).
ANNOTATION_PREFIX = f"operator.{GROUP}"


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    engine: builders.OperatorSettings = field(default_factory=builders.OperatorSettings)
    peering: str | None = None  # None: standalone (one replica); a name: kopf peering among replicas
    priority: int | None = None  # None: a random one per process (see KopfProcess)
    liveness: str | None = "http://0.0.0.0:8080/healthz"
    resync_seconds: int = 300
    workers: int = 16


def kopf_process(config: OperatorConfig) -> KopfProcess:
    return KopfProcess(prefix=ANNOTATION_PREFIX, namespaces=config.namespaces, peering=config.peering,
                       priority=config.priority, liveness=config.liveness, workers=config.workers)


def kopf_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    settings = kopf_process(config).settings()
    # How long one watch request lasts before kopf reconnects (from its last resourceVersion). kopf sends it as the
    # watch's `timeoutSeconds`, which a real API server parses as an integer: "300.0" is refused with 400 and
    # nothing is ever watched.
    settings.watching.server_timeout = int(config.resync_seconds)
    settings.watching.client_timeout = int(config.resync_seconds) + 30
    return settings


class Resync:
    """Every InferenceDeployment the watch has shown, passed again every `interval` seconds from a thread of its
    own (one at a time: a resync must not crowd out the passes real changes trigger)."""

    def __init__(self, reconciler: Reconciler, interval: float, stopping: threading.Event) -> None:
        self.reconciler, self.interval, self.stopping = reconciler, interval, stopping
        self._known: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def seen(self, namespace: str, name: str, deleted: bool) -> None:
        with self._lock:
            (self._known.discard if deleted else self._known.add)((namespace, name))

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            with self._lock:
                keys = sorted(self._known)
            for namespace, name in keys:
                if self.stopping.is_set():
                    return
                try:
                    if self.reconciler.reconcile_by_name(namespace, name) is None:
                        self.seen(namespace, name, deleted=True)  # gone (a DELETED event can be missed in a 410)
                except Exception:  # noqa: BLE001 - one object's failure must not end the resync of the others
                    log.exception("resync of %s/%s failed; retried in %ss", namespace, name, self.interval)


def build_registry() -> kopf.OperatorRegistry:
    registry = with_client_login(kopf.OperatorRegistry())

    # Passes still queued for the thread pool when we stop just return (they are idempotent; see run()).
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def inference_deployment_changed(event: kopf.RawEvent, memo: kopf.Memo, **_) -> None:
        meta = event["object"].get("metadata", {})
        memo.resync.seen(meta.get("namespace", "default"), meta.get("name"), event["type"] == "DELETED")
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
    load_config()
    stopping = threading.Event()
    reconciler = Reconciler(Kube(pool_size=config.workers * 2, field_manager=FIELD_MANAGER), config.engine, post_event)
    reconciler.stopping = stopping  # pending knobs-push retries end with the process
    resync = Resync(reconciler, config.resync_seconds, stopping)
    memo = kopf.Memo(reconciler=reconciler, stopping=stopping, resync=resync)
    def on_signal(signum, _frame) -> None:
        log.info("%s received: finishing the passes in flight and stopping", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=resync.run, name="resync", daemon=True).start()
    kopf_process(config).run(build_registry(), kopf_settings(config), memo, stopping)
