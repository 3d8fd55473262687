"""One level-triggered pass over one InferenceDeployment: read what is, render what should be, change the
difference, write status. Safe to run any number of times, from any trigger, after any crash.

Order matters for "no half-applied objects": the whole spec is checked (types, cross-field rules, referenced
volumes) before the first write, and a spec that fails leaves every existing object as it was."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kubernetes.client import ApiException
from pydantic import ValidationError

from chunkpilot.api.types import (DISAGGREGATED_ROLES, ConditionType, DisaggregationStatus, InferenceDeployment,
                                  InferenceDeploymentSpec, InferenceDeploymentStatus, KnobsStatus, desired_knobs,
                                  RoutingStatus, prefill_pods)
from chunkpilot.operator import builders, routing
from chunkpilot.operator.knobs_delivery import (HttpPusher, ReadyPod, deliver, deliver_by_role, owned_pods, ready_pods,
                                                runs)
from chunkpilot.operator.role_split import split_roles
from chunkpilot.operator.pod_trouble import creating, engine_trouble, mount_trouble, starting
from chunkpilot.contract.knobs import parse_knobs, threshold_text
from chunkpilot.kube.autoscalers import AutoscalerCheck
from chunkpilot.kube.client import Kube
from chunkpilot.kube.conditions import condition, now_rfc3339
from chunkpilot.kube.object_key import ObjectKey
from chunkpilot.operator.apply import describe, plan, with_hash
from chunkpilot.operator.conditions import Problem, RolePods, role_status, status_patch
from chunkpilot.operator.policy import PolicyError

log = logging.getLogger(__name__)

# (object, type Normal|Warning, reason, message) -> posts a Kubernetes Event about the InferenceDeployment.
EventPoster = Callable[[dict, str, str, str], None]
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"
# what the chart's Secret admission policy says when the operator's apply would take over someone else's Secret
NOT_OURS = "was not made by the chunkpilot operator"


class Delivery(NamedTuple):
    """What one pass's knobs delivery found: status.knobs, whether a push failed (the queue retries after 1 s,
    doubling to 30 s), why any pod fails to come up, whether any runs containers not ready yet, and, for a
    disaggregated resource, each role's own record, and in mode auto the split as the pods' labels say after it."""

    knobs: KnobsStatus | None
    failed: bool
    trouble: str | None
    waiting: bool
    roles: dict[str, KnobsStatus] = {}
    split: DisaggregationStatus | None = None


@dataclass
class Outcome:
    changes: list[str] = field(default_factory=list)  # e.g. "apply ConfigMap x"
    problem: Problem | None = None
    status: dict | None = None  # the status patch written, if any
    retry: bool = False  # a knobs push failed: pass again after a backoff (the work queue's)


def spec_error_message(err: ValidationError) -> str:
    """pydantic's errors as `spec.field.path: what is wrong (got value)`, in the CRD's camelCase names."""
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in ("spec", *e["loc"]))
        got = e.get("input")
        parts.append(f"{loc}: {e['msg']}" + (f" (got {got!r})" if not isinstance(got, dict) else ""))
    return "; ".join(parts)


class Reconciler:
    def __init__(self, kube: Kube, settings: builders.OperatorSettings, post_event: EventPoster,
                 crd_cache_seconds: float = 60.0, pusher: HttpPusher | None = None,
                 verify_seconds: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.settings = settings
        self.post_event = post_event
        self.pusher = pusher or HttpPusher(builders.ADMIN_PORT)
        # How long a pod's recorded acknowledgement is trusted before the pod is asked again (the push is the
        # question: a PUT of the knobs it should run, answered with what it runs). Someone with the token can push
        # other knobs through a port-forward; the record would otherwise say the pod runs ours for good.
        self.verify_seconds, self.clock = verify_seconds, clock
        self._verified: dict[ObjectKey, float] = {}  # when every ready pod last answered a push
        self._crds: dict[str, tuple[float, bool]] = {}  # CRD -> when it was last looked for, and whether it exists
        self._crd_cache_seconds = crd_cache_seconds
        # (namespace, name) -> the uid a Warning was posted for: once per object, forgotten with it
        self._warned_monitor: dict[ObjectKey, str] = {}
        self._warned_pool: dict[ObjectKey, str] = {}
        self._warned_hpa: dict[ObjectKey, str] = {}
        self.autoscalers = AutoscalerCheck(kube)
        self._hpa_owned: dict[ObjectKey, bool] = {}  # an HPA owned the Deployment's count at the last pass

    def reconcile_by_name(self, namespace: str, name: str) -> Outcome | None:
        """A pass on a fresh read; None when the object is gone. The work queue (chunkpilot.kube.work_queue) runs
        one pass at a time per object, so no pass on an older copy can land after a newer one."""
        raw = self.kube.read_inference_deployment(namespace, name)
        return None if raw is None else self.reconcile(raw)

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone: drop what this process remembered about it (and about its role Deployments)."""
        for memory in (self._hpa_owned, self._warned_monitor, self._warned_pool, self._warned_hpa, self._verified):
            for child in (None, *DISAGGREGATED_ROLES):
                memory.pop(ObjectKey(namespace, builders.role_name(name, child)), None)

    # -- one pass ------------------------------------------------------------------------------------------
    def reconcile(self, raw: dict) -> Outcome:
        meta = raw["metadata"]
        if meta.get("deletionTimestamp"):
            return Outcome()  # owner references let the garbage collector remove the children
        ns, name = ObjectKey.from_meta(meta)
        out = Outcome()
        obj, desired = None, []
        try:
            obj = self._parse(raw)
            desired = self._desired(obj, raw)
        except PolicyError as e:
            out.problem = Problem("NotAllowed", str(e))
        except (builders.SpecError, ValidationError) as e:
            msg = spec_error_message(e) if isinstance(e, ValidationError) else str(e)
            out.problem = Problem("InvalidSpec", msg)
        except _MissingVolume as e:
            out.problem = Problem("MissingVolume", str(e))
        except ApiException as e:
            out.problem = Problem("ApiError", _api_message(e, "reading referenced objects"))

        roles = _pod_roles(obj, raw)
        deploys: dict[str | None, dict | None] | None = None  # role (None: every pod) -> its Deployment as it is
        if out.problem is None and obj is not None:
            try:
                self._apply_token_secret(obj)
                lives = self._apply_all(raw, desired, out)
                deploys = {role: lives.get(builders.role_name(name, role)) for role in roles}
            except _NameConflict as e:
                out.problem = Problem("NameConflict", str(e))
            except ApiException as e:
                out.problem = Problem("ApiError", _api_message(e, "applying the engine objects"))
        if deploys is None and (out.problem is None or out.problem.reason != "NameConflict"):
            # (a Deployment that is not ours says nothing about this resource's replicas)
            deploys = {role: self._read_quietly("apps/v1", "Deployment", ns, builders.role_name(name, role))
                       for role in roles}
        deploys = deploys or {role: None for role in roles}

        status = raw.get("status") or {}
        delivery = None
        if obj is not None and out.problem is None and all(d is not None for d in deploys.values()):
            delivery = self._deliver_knobs(obj, deploys)
            # pods loading or crashing change no Deployment field we watch: pass again (1 s doubling to 30 s)
            # while they do, so the conditions follow the containers within half a minute
            out.retry = delivery.failed or delivery.waiting
        # the spec's problems first: the engine's failure may only be their consequence
        trouble = delivery.trouble if delivery is not None else None
        problem = out.problem or (Problem("EngineFailing", trouble) if trouble else None)
        knobs = delivery.knobs if delivery is not None else None
        selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(name).items())
        routed = _routing_status(status) if obj is None else routing.status(
            obj, obj.spec.routing is not None and self._crd_present(routing.POOL_CRD))
        if roles == (None,):
            patch = status_patch(status, deploy=deploys[None], desired_replicas=self._replicas(ns, name, obj, raw,
                                                                                                deploys[None]),
                                 generation=meta.get("generation"), selector=selector, knobs=knobs, problem=problem,
                                 now=now_rfc3339(), split=delivery.split if delivery is not None else None,
                                 routing=routed)
        else:
            role_pods = [RolePods(role, deploys[role], self._replicas(ns, name, obj, raw, deploys[role], role),
                                  delivery.roles.get(role) if delivery is not None else None) for role in roles]
            patch = status_patch(status, deploy=None, desired_replicas=0, generation=meta.get("generation"),
                                 selector=selector, knobs=knobs, problem=problem, now=now_rfc3339(), roles=role_pods,
                                 routing=routed)
        if patch is not None:
            try:
                self.kube.patch_status(ns, name, patch, meta.get("resourceVersion"))
                out.status = patch
            except ApiException as e:
                if e.status == 409:  # changed since read (e.g. the tuner wrote knobs): its event brings a new pass
                    log.debug("status of %s/%s is stale; the next pass writes it", ns, name)
                elif e.status != 404:  # 404: deleted meanwhile, nothing to report on
                    log.warning("status of %s/%s not written: %s", ns, name, _api_message(e, "writing status"))
        self._post_problem(raw, status, problem)
        return out

    def _replicas(self, ns: str, name: str, obj: InferenceDeployment | None, raw: dict, deploy: dict | None,
                  role: str | None = None) -> int:
        """The pods a Deployment of the resource should have: the spec's (each role's, disaggregated), or the live
        count where an HPA owns that Deployment's replicas."""
        if deploy is not None and self._hpa_owned.get(ObjectKey(ns, builders.role_name(name, role))):
            return int((deploy.get("spec") or {}).get("replicas") or 0)
        if obj is None:  # an unreadable spec: what it says, as far as it can be read
            spec = raw.get("spec") or {}
            d = spec.get("disaggregation") or {}
            if role is None and d.get("mode") == "auto":
                return sum(int((d.get(r) or {}).get("replicas", 1)) for r in DISAGGREGATED_ROLES)
            if role is not None:
                spec = d.get(role) or {"replicas": 1}  # the schema's default
            return int(spec.get("replicas") or 0)
        return builders.pod_count(obj, role)

    # -- knobs delivery (knobs_delivery.py) ---------------------------------------------------------------
    def _apply_token_secret(self, obj: InferenceDeployment) -> None:
        """The admin token's Secret, applied on every pass without reading it back (the operator has no right to
        read Secrets): one that someone deleted is back at the next pass, not at the operator's next restart (new
        engine pods hung in ContainerCreating meanwhile). An unchanged apply persists nothing. A same-named Secret
        whose fields someone else wrote is a 409, not taken over."""
        secret = builders.admin_token_secret(obj, self.settings)  # bound to the uid: a recreated object gets a new one
        try:
            self.kube.apply(secret, force=False)
        except ApiException as e:
            # 409: fields someone else wrote; the chart's admission policy (templates/secrets-policy.yaml) refuses
            # an update of a Secret the operator did not make, and says so
            if e.status == 409 or (e.status in (403, 422) and NOT_OURS in (e.body or "")):
                raise _NameConflict([describe(secret)]) from None
            raise

    def _deliver_knobs(self, obj: InferenceDeployment, deploys: dict[str | None, dict]) -> Delivery:
        """Push the desired knobs to the ready pods that have not acknowledged them: the pods of the ReplicaSets
        our Deployment owns, not any pod with its labels (knobs_delivery.owned_pods). `deploys`: role -> its live
        Deployment; role None is every pod of a resource without disaggregation, whose status.knobs is as it always
        was; with roles, each role's pods get that role's knobs (desired_knobs(obj, role)). The pod troubles come
        from the same list of pods (pod_trouble)."""
        ns, name = key = ObjectKey.from_meta(obj.metadata)
        selector = builders.selector_labels(name)  # every pod of the resource, of either role
        try:
            pods, replica_sets = self.kube.list_pods(ns, selector), self.kube.list_replica_sets(ns, selector)
        except ApiException as e:
            log.warning("cannot list the pods of %s/%s: %s", ns, name, _api_message(e, "listing pods"))
            return Delivery(obj.status.knobs, True, None, False)
        owned = {role: owned_pods(pods, replica_sets, (d.get("metadata") or {}).get("uid"))
                 for role, d in deploys.items()}
        now = self.clock()
        stale = now - self._verified.get(key, -math.inf) >= self.verify_seconds
        previous = None if stale else obj.status.knobs
        push = self.pusher.for_token(builders.admin_token(obj, self.settings))
        split = None
        if None in owned and builders.live(obj):
            status, by_role, failures = self._split(obj, ready_pods(owned[None]), previous, push)
            split = _split_status(owned[None], by_role)
        elif None in owned:
            knobs, source = desired_knobs(obj)
            status, failures = deliver(previous, knobs, source, ready_pods(owned[None]), push)
            by_role = {}
        else:
            wants = {role: (*desired_knobs(obj, role), ready_pods(owned[role])) for role in owned}
            status, by_role, failures = deliver_by_role(previous, wants, "decode", push)
        if stale and not failures:
            self._verified[key] = now
        if failures:
            log.info("knobs generation %d not yet pushed to %s/%s: %s (the pods also read the ConfigMap)",
                     status.generation, ns, name, "; ".join(failures))
        listed = [p for role_pods in owned.values() for p in role_pods]
        return Delivery(status, bool(failures), engine_trouble(listed) or self._mount_trouble(ns, listed),
                        starting(listed), by_role, split)

    def _split(self, obj: InferenceDeployment, pods: list[ReadyPod], previous: KnobsStatus | None,
               push) -> tuple[KnobsStatus, dict[str, KnobsStatus], list[str]]:
        """Disaggregation mode auto: push each ready pod its role's knobs with the role the split gives it
        (role_split.py; the engine switches at its next step, no restart), then move the role labels of the pods
        that acknowledged a new role, so the Services follow: the client Service stops sending a new prefill pod
        requests (the streams it has run on), and the prefill Service names it to the decode pods. A pod whose
        push failed keeps its label and is asked again on the next pass."""
        ns, name = ObjectKey.from_meta(obj.metadata)
        target = split_roles(((p.name, p.role, p.started) for p in pods), prefill_pods(obj))
        wants = {}
        for role in DISAGGREGATED_ROLES:
            knobs, source = desired_knobs(obj, role)
            wants[role] = (knobs.with_role(role), source, [p for p in pods if target[p.name] == role])
        status, by_role, failures = deliver_by_role(previous, wants, "decode", push)
        acked = {e.pod for r in by_role.values() for e in r.pods if runs(e, wants[target[e.pod]][0])}
        moved = []
        for pod in pods:
            role = target[pod.name]
            if pod.role == role or pod.name not in acked:
                continue
            try:
                self.kube.patch_pod_labels(ns, pod.name, builders.role_labels(role))
            except ApiException as e:
                failures.append(f"{pod.name}: its role label not moved to {role}: {_api_message(e, 'a pod patch')}")
                continue
            moved.append(f"{pod.name} {pod.role or 'unlabelled'} -> {role}")
        if moved:
            counts = {r: sum(1 for t in target.values() if t == r) for r in DISAGGREGATED_ROLES}
            self.post_event({"apiVersion": obj.api_version, "kind": obj.kind, "metadata": obj.metadata}, "Normal",
                            "RolesSwitched", f"{', '.join(moved)} (no restart); the split is "
                            f"{counts['prefill']} prefill : {counts['decode']} decode pods")
            log.info("%s/%s: roles switched: %s", ns, name, ", ".join(moved))
        return status, by_role, failures

    def _mount_trouble(self, ns: str, pods: list[dict]) -> str | None:
        """A volume the kubelet cannot mount (FailedMount), which only Events say: read only while some pod waits
        to create its containers, so a steady pass costs no list."""
        if not creating(pods):
            return None
        try:
            events = self.kube.list_events(ns, "reason=FailedMount")
        except ApiException as e:  # an older chart's role: the condition then says "not ready" without the why
            log.warning("cannot list the Events of %s: %s", ns, _api_message(e, "listing Events"))
            return None
        return mount_trouble(pods, events)

    def _parse(self, raw: dict) -> InferenceDeployment:
        spec = InferenceDeploymentSpec.model_validate(raw.get("spec") or {})
        try:  # status is ours and the tuner's; an unreadable one is not the user's spec error
            status = InferenceDeploymentStatus.model_validate(raw.get("status") or {})
        except ValidationError:
            status = InferenceDeploymentStatus()
        return InferenceDeployment(metadata=raw["metadata"], spec=spec, status=status)

    def _desired(self, obj: InferenceDeployment, raw: dict) -> list[dict]:
        builders.validate(obj, self.settings)
        src = obj.spec.model.source
        ns = ObjectKey.from_meta(obj.metadata).namespace
        claims = []
        if src.startswith("pvc://"):
            claims.append(("spec.model.source", src.removeprefix("pvc://").partition("/")[0], "with the model files"))
        draft = obj.spec.engine.speculative.draft_model if obj.spec.engine.speculative else None
        if draft and draft.startswith("pvc://"):
            claims.append(("spec.engine.speculative.draftModel", draft.removeprefix("pvc://").partition("/")[0],
                           "with the draft model's files"))
        if src.startswith("hf://") and obj.spec.model.cache_claim:
            claims.append(("spec.model.cacheClaim", obj.spec.model.cache_claim, "writable, for the download"))
        for field_, claim, what in claims:
            if self.kube.read("v1", "PersistentVolumeClaim", ns, claim) is None:
                raise _MissingVolume(f"{field_} names PersistentVolumeClaim {claim!r}, which does not exist in "
                                     f"namespace {ns!r}: create it ({what}) or fix the field")
        return builders.desired_objects(obj, self.settings, service_monitor_crd=self._monitor_crd(obj, raw),
                                        pool_crd=self._pool_crd(obj, raw))

    def _monitor_crd(self, obj: InferenceDeployment, raw: dict) -> bool:
        if not obj.spec.monitoring.service_monitor:
            return False
        present = self._monitor_crd_present()
        key = ObjectKey.from_meta(obj.metadata)
        if not present and self._warned_monitor.get(key) != obj.metadata["uid"]:
            self._warned_monitor[key] = obj.metadata["uid"]
            self.post_event(raw, "Warning",
                            "ServiceMonitorUnavailable", "spec.monitoring.serviceMonitor is true but the cluster has no "
                            "ServiceMonitor CRD (install the Prometheus Operator, or scrape the engine Service's "
                            "metrics port yourself)")
        return present

    def _pool_crd(self, obj: InferenceDeployment, raw: dict) -> bool:
        """spec.routing needs GIE's InferencePool CRD: without it nothing of the routing is rendered, the clients
        keep the Service, and a Warning says what to install (once per object); status.routing says it too."""
        if obj.spec.routing is None:
            return False
        present = self._crd_present(routing.POOL_CRD)
        key = ObjectKey.from_meta(obj.metadata)
        if not present and self._warned_pool.get(key) != obj.metadata["uid"]:
            self._warned_pool[key] = obj.metadata["uid"]
            self.post_event(raw, "Warning", "RoutingUnavailable", routing.NO_POOL_CRD)
        return present

    def _monitor_crd_present(self) -> bool:
        return self._crd_present(SERVICE_MONITOR_CRD)

    def _crd_present(self, crd: str) -> bool:
        now = time.monotonic()
        at, present = self._crds.get(crd, (-math.inf, False))
        if now - at > self._crd_cache_seconds:
            present = self.kube.crd_exists(crd)
            self._crds[crd] = (now, present)
        return present

    def _apply_all(self, raw: dict, desired: list[dict], out: Outcome) -> dict[str, dict]:
        """Create or apply each desired object, then prune the optional ones no longer wanted; returns each
        Deployment as the API server answered, by name."""
        uid = raw["metadata"].get("uid")
        lives = []
        for want in desired:
            lives.append(self.kube.read(want["apiVersion"], want["kind"], *ObjectKey.from_meta(want["metadata"])))
        # Nothing is written while any name is taken by an object that is not ours: applying it would give it
        # our ownerReference, and deleting this resource would then garbage-collect someone else's object.
        taken = [describe(w) for w, live in zip(desired, lives) if live is not None and not _owned_by(live, uid)]
        if taken:
            raise _NameConflict(taken)
        deploys = {}
        for want, live in zip(desired, lives):
            if want["kind"] == "Deployment" and live is not None:
                want = self._defer_replicas(raw, want, live)
            action = plan(want, live)
            if action == "create":
                try:
                    live = self.kube.create(with_hash(want))
                except ApiException as e:
                    if e.status != 409:  # 409: another pass (or operator replica) created it first
                        raise
                    live = self.kube.read(want["apiVersion"], want["kind"], *ObjectKey.from_meta(want["metadata"]))
                    if live is not None and not _owned_by(live, uid):  # someone else's, created meanwhile
                        raise _NameConflict([describe(want)]) from None
                    live = self.kube.apply(with_hash(want))
                    action = "apply"
                self.post_event(raw, "Normal", "Created", f"created {describe(want)}")
            elif action == "apply":
                before = live
                live = self.kube.apply(with_hash(want))
                self._post_update(raw, want, before)
            if action != "none":
                out.changes.append(f"{action} {describe(want)}")
            if want["kind"] == "Deployment":
                deploys[want["metadata"]["name"]] = live
        self._prune(raw, desired, out)
        return deploys

    def _defer_replicas(self, raw: dict, want: dict, live: dict) -> dict:
        """An HPA that targets the Deployment (not the InferenceDeployment) owns its replicas: the operator keeps
        the live count instead of re-applying spec.replicas against it (two controllers fighting), and says once
        where the HPA should point. The field stays in the applied object (dropping a field this manager owns
        would reset it to the default)."""
        key = ObjectKey.from_meta(want["metadata"])
        hpas = self._hpas_on_deployment(*key)
        if not hpas:
            return want
        uid = raw["metadata"].get("uid", "")
        if self._warned_hpa.get(key) != uid:
            self._warned_hpa[key] = uid
            self.post_event(raw, "Warning", "DeploymentAutoscaled",
                            f"HorizontalPodAutoscaler {', '.join(hpas)} targets Deployment {key.name}: the operator "
                            f"leaves its replicas to it and spec.replicas is not applied. Point the HPA at the "
                            f"InferenceDeployment instead (scaleTargetRef kind InferenceDeployment, its scale "
                            f"subresource), or use spec.autoscaling")
        kept = json.loads(json.dumps(want))
        kept["spec"]["replicas"] = (live.get("spec") or {}).get("replicas", kept["spec"].get("replicas"))
        return kept

    def _hpas_on_deployment(self, namespace: str, name: str) -> list[str]:
        """HPAs on the child Deployment (the shared check: one list per namespace at most every 30 s). A list that
        cannot be read (RBAC of an older chart) counts as none: the operator then behaves as before."""
        try:
            names = sorted(self.autoscalers.targeting(namespace, [("apps", "Deployment", name)]))
        except ApiException as e:
            log.warning("cannot list HorizontalPodAutoscalers in %s: %s", namespace, _api_message(e, "listing"))
            names = []
        self._hpa_owned[ObjectKey(namespace, name)] = bool(names)
        return names

    def _prune(self, raw: dict, desired: list[dict], out: Outcome) -> None:
        """Delete the optional children the spec no longer wants (PDB at replicas <= 1, ServiceMonitor switched
        off, today's Deployment or the role Deployments and the prefill Service when disaggregation is switched on
        or off: builders.optional_children), but only ours: same name and our owner reference with this
        resource's uid. Run after the wanted objects are applied, so a switch starts the new pods before it stops
        the old ones."""
        meta = raw["metadata"]
        (ns, name), uid = ObjectKey.from_meta(meta), meta.get("uid")
        wanted = {(d["apiVersion"], d["kind"], d["metadata"]["name"]) for d in desired}
        # the routing objects are looked for only while the spec asks for routing or status says some were made
        # (a pass of every other resource reads no more than before)
        routed = "routing" in (raw.get("spec") or {}) or "routing" in (raw.get("status") or {})
        routing_children = set(routing.optional_children(name))
        for api_version, kind, child in builders.optional_children(name):
            key = (api_version, kind, child)
            if key in wanted or (kind == "ServiceMonitor" and not self._monitor_crd_present()):
                continue
            if key in routing_children and (not routed or (kind == "InferencePool"
                                                           and not self._crd_present(routing.POOL_CRD))):
                continue
            live = self.kube.read(api_version, kind, ns, child)
            if live and _owned_by(live, uid):
                self.kube.delete(api_version, kind, ns, child)
                out.changes.append(f"delete {kind} {child}")
                self.post_event(raw, "Normal", "Deleted", f"deleted {kind} {child}: the spec no longer asks for it")

    def _post_update(self, raw: dict, want: dict, before: dict) -> None:
        if want["kind"] == "ConfigMap" and want["metadata"]["name"] == builders.knobs_configmap_name(
                ObjectKey.from_meta(raw["metadata"]).name):
            said = []
            for key, text in want["data"].items():  # one file, or one per role ("prefill: token budget ...")
                knobs = parse_knobs(text)
                role = "" if key == builders.KNOBS_FILE else key.removeprefix("knobs-").removesuffix(".json") + ": "
                # the tuner's threshold (decode pods, disaggregation auto) as people read it: "never" = colocated
                threshold = ("" if knobs.disagg_threshold is None else
                             f", disaggregation threshold {threshold_text(knobs.disagg_threshold)}")
                said.append(f"{role}token budget {knobs.token_budget}, max chunk {knobs.max_chunk}{threshold} "
                            f"(generation {knobs.generation})")
            self.post_event(raw, "Normal", "KnobsChanged",
                            f"{'; '.join(said)}: the pods apply them in place, no restart")
        elif (want["kind"] == "Deployment" and _template_hash(want) != _template_hash(before)
              and want["metadata"]["name"] != routing.epp_name(ObjectKey.from_meta(raw["metadata"]).name)):
            self.post_event(raw, "Normal", "RollingUpdate", "the engine image, model, resources or engine settings "
                            "changed: pods are replaced one at a time (maxUnavailable 0)")
        else:
            self.post_event(raw, "Normal", "Updated", f"updated {describe(want)}")

    def _post_problem(self, raw: dict, old_status: dict, problem: Problem | None) -> None:
        """A Warning Event when a problem appears or changes; not again on every pass while it persists."""
        if problem is None:
            return
        prev = condition(old_status, ConditionType.DEGRADED) or {}
        if prev.get("status") == "True" and prev.get("reason") == problem.reason and \
                prev.get("message") == problem.message:
            return
        self.post_event(raw, "Warning", problem.reason, problem.message)

    def _read_quietly(self, api_version: str, kind: str, ns: str, name: str) -> dict | None:
        try:
            return self.kube.read(api_version, kind, ns, name)
        except ApiException:
            return None


class _MissingVolume(Exception):
    pass


class _NameConflict(Exception):
    def __init__(self, taken: list[str]) -> None:
        super().__init__(f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''} and belong to something "
                         "else (no ownerReference to this InferenceDeployment): rename the InferenceDeployment, or "
                         "delete or rename the existing object; nothing was changed")


def _pod_roles(obj: InferenceDeployment | None, raw: dict) -> tuple[str | None, ...]:
    """The roles whose Deployments the resource runs (builders.roles); for a spec that does not parse, what its
    disaggregation mode says, so the status still counts the pods that run."""
    if obj is not None:
        return builders.roles(obj)
    mode = ((raw.get("spec") or {}).get("disaggregation") or {}).get("mode", "off")
    return DISAGGREGATED_ROLES if mode == "on" else (None,)


def _split_status(pods: list[dict], by_role: dict[str, KnobsStatus]) -> DisaggregationStatus:
    """Mode auto: each role's pods as their labels say after this pass's switches (a pod whose label moved this
    pass is counted in its new role: its acknowledgement is in that role's record), and the knobs delivered."""
    switched = {e.pod: role for role, k in by_role.items() for e in k.pods}
    roles = {}
    for role in DISAGGREGATED_ROLES:
        mine = [p for p in pods if switched.get(p["metadata"]["name"],
                                                (p["metadata"].get("labels") or {}).get(builders.ROLE_LABEL)) == role]
        roles[role] = role_status(len(mine), len(ready_pods(mine)), by_role.get(role))
    return DisaggregationStatus(**roles)


def _owned_by(live: dict, uid: str | None) -> bool:
    return any(r.get("uid") == uid for r in live["metadata"].get("ownerReferences") or [])


def _template_hash(deploy: dict | None) -> str | None:
    tmpl = ((deploy or {}).get("spec") or {}).get("template") or {}
    return ((tmpl.get("metadata") or {}).get("annotations") or {}).get(builders.CONFIG_HASH)


def _api_message(e: ApiException, doing: str) -> str:
    try:
        detail = json.loads(e.body or "{}").get("message") or e.reason
    except (ValueError, AttributeError):
        detail = e.reason
    return f"the API server refused {doing}: {e.status} {detail}; the operator retries on the next pass"


def _routing_status(status: dict) -> RoutingStatus | None:
    """status.routing as it is, where this pass could not read the spec (nothing about routing changed then)."""
    try:
        return RoutingStatus.model_validate(status["routing"]) if status.get("routing") else None
    except ValidationError:
        return None
