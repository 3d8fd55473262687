"""kopf wiring, kept thin: every trigger queues the object's key, and the work queue (chunkpilot.kube.work_queue)
runs the same level-triggered Reconciler pass on a fresh read: duplicate triggers merged, one pass at a time per
object, a failed knobs push retried after 1 s doubling to 30 s, and every object passed again each `resync`.
On a standby replica (kopf peering) kopf stops delivering events and the queue's gate (peering_gate.py) holds the
passes, retries and resyncs too.

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
from kubernetes.client import ApiException

from chunkpilot.api.types import GROUP, KIND, PLURAL, VERSION
from chunkpilot.kube.client import Kube, load_config
from chunkpilot.kube.kopf_process import KopfProcess, with_client_login
from chunkpilot.kube.object_key import ObjectKey
from chunkpilot.kube.peering_gate import PeeringGate
from chunkpilot.kube.work_queue import WorkQueue
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


def build_registry() -> kopf.OperatorRegistry:
    registry = with_client_login(kopf.OperatorRegistry())

    # Handlers only queue the object's key: the pass reads it fresh (chunkpilot.kube.work_queue).
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def inference_deployment_changed(event: kopf.RawEvent, memo: kopf.Memo, **_) -> None:
        meta = event["object"].get("metadata", {})
        key = ObjectKey.from_meta(meta)
        if event["type"] == "DELETED":
            memo.queue.forget(key)
            memo.reconciler.forget(*key)
        elif not memo.stopping.is_set():
            memo.queue.add(key)

    @kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "chunkpilot-operator"},
                   registry=registry)
    def owned_deployment_changed(event: kopf.RawEvent, memo: kopf.Memo, **_) -> None:
        if memo.stopping.is_set():
            return
        meta = event["object"].get("metadata", {})
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
                memo.queue.add(ObjectKey.of_owner(meta, ref))

    @kopf.on.probe(id="reconciler", registry=registry)
    def reconciler_alive(memo: kopf.Memo, **_) -> dict | str:
        """The liveness probe: fails (kopf answers 500) while the work queue is stuck, so the kubelet restarts a
        process that would otherwise report itself healthy and never pass again (chunkpilot.kube.work_queue)."""
        queue: WorkQueue | None = getattr(memo, "queue", None)
        if getattr(memo, "reconciler", None) is None or queue is None:
            return "starting"
        trouble = queue.health()
        if trouble is not None:  # permanent: kopf would otherwise retry the probe handler and hang the request
            raise kopf.PermanentError(trouble)
        return {"threads": queue.alive_threads(), "of": queue.workers + 1, "restarts": queue.restarts}

    return registry


def pass_once(reconciler: Reconciler, queue: WorkQueue, key: ObjectKey) -> bool:
    """One queued pass; True asks the queue to retry after a backoff (a knobs push failed)."""
    out = reconciler.reconcile_by_name(*key)
    if out is None:  # gone (a DELETED event can be missed across a 410 re-list): no more resyncs
        queue.forget(key)
        reconciler.forget(*key)
        return False
    return out.retry


def event_poster(kube: Kube):
    def post(obj: dict, type_: str, reason: str, message: str) -> None:
        try:
            kube.post_event(obj, type_, reason, message, component="chunkpilot-operator")
        except ApiException as e:  # an Event is news, not state: a pass never fails for one
            log.warning("event %s on %s not posted: %s %s", reason, (obj.get("metadata") or {}).get("name"),
                        e.status, e.reason)
    return post


def run(config: OperatorConfig) -> None:
    """Blocks until SIGINT/SIGTERM. kopf runs in a thread of its own (kopf's documented embedding) so that the
    signal reaches us first: the stop flag makes passes still queued for the thread pool return at once, so a
    pod stops in about a second instead of working through its backlog."""
    load_config()
    stopping = threading.Event()
    kube = Kube(pool_size=config.workers * 2, field_manager=FIELD_MANAGER)
    reconciler = Reconciler(kube, config.engine, event_poster(kube), verify_seconds=config.resync_seconds)
    process = kopf_process(config)
    # kopf pauses its own handlers on a standby replica; the queue's resync and retries ask the same peering object
    gate = PeeringGate(None if config.peering is None else
                       (lambda: kube.read_peerings(config.peering, config.namespaces)), process.priority)
    queue = WorkQueue(lambda key: pass_once(reconciler, queue, key), workers=config.workers,
                      resync=config.resync_seconds, gate=gate, name="reconcile")
    memo = kopf.Memo(reconciler=reconciler, stopping=stopping, queue=queue)
    def on_signal(signum, _frame) -> None:
        log.info("%s received: finishing the passes in flight and stopping", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    queue.start()
    try:
        process.run(build_registry(), kopf_settings(config), memo, stopping)
    finally:
        queue.stop()
