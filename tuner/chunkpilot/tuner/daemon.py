"""Cluster mode: one tuning thread per InferenceDeployment whose tuning mode is not off (see supervisor.py), each
running the same TunerLoop as local mode, with the custom resource as actuator and publisher.

* auto: the chosen knobs go to `status.scheduler` (source: tuner, generation + 1), which the tuner alone writes;
  the operator pushes them to every ready pod (and keeps the ConfigMap for pods that start later) and records
  each pod's acknowledgement in `status.knobs`, which the tuner waits on.
* advisory: only `status.tuning.recommendation` is written.
* The tuner writes only `status.scheduler`, `status.tuning`, `status.slo`, `status.autoscaling` and the Tuning,
  SLOMet and Autoscaling conditions (read-modify-write with the resourceVersion, retried on 409, so the
  operator's conditions survive), and, with `spec.autoscaling.mode: auto`, `spec.replicas` through the scale
  subresource only - refused (Autoscaling=False, ConflictingAutoscaler) while an HPA targets the resource.
* A change of the SLOs, bounds or objective starts a new study (its name carries a fingerprint of them): trials
  measured against other targets say nothing about the new ones.
* kopf's bookkeeping uses the prefix `tuner.chunkpilot.io`, apart from the operator's. The tuner puts no
  finalizer on resources and never patches them (its role has only their status and scale subresources), so
  deleting a resource never waits for the tuner.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import kopf
import optuna
from kubernetes.client import ApiException
from pydantic import ValidationError

from chunkpilot.api.types import (GROUP, KIND, PLURAL, VERSION, AutoscalingStatus, Condition, ConditionType,
                                  InferenceDeployment, InferenceDeploymentSpec, InferenceDeploymentStatus, KnobsStatus,
                                  SchedulerStatus, SLOStatus, TuningStatus, desired_knobs, knob_refusal,
                                  slo_classes)
from chunkpilot.contract.knobs import SchedulerKnobs, threshold_text
from chunkpilot.contract.slo import SLOClasses, SLOTargets
from chunkpilot.kube.autoscalers import AutoscalerCheck
from chunkpilot.kube.client import Kube, load_config
from chunkpilot.kube.conditions import merge_conditions, now_rfc3339
from chunkpilot.kube.kopf_process import KopfProcess, with_client_login
from chunkpilot.kube.peering_gate import PeeringGate
from chunkpilot.tuner import reasons
from chunkpilot.tuner.autoscale import ScalingPolicy
from chunkpilot.tuner.config import TuningConfig, build_loop
from chunkpilot.tuner.interfaces import Measurer, ReplicaCount
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.metrics import TunerMetrics
from chunkpilot.tuner.prometheus import PrometheusMeasurer, PrometheusSource
from chunkpilot.tuner.retry import Backoff
from chunkpilot.tuner.space import DEFAULT_THRESHOLD_MAX, Knobs
from chunkpilot.tuner.state import TunerState, conditions, dump, status_autoscaling, status_slo, status_tuning
from chunkpilot.tuner.supervisor import Supervisor

log = logging.getLogger(__name__)
# Pause after a failed iteration, doubling up to the max while failures repeat (retry.py: the one retry layer).
ERROR_BACKOFF_INITIAL = 2.0
ERROR_BACKOFF_MAX = 60.0
INVALID_SPEC_RECHECK = 60.0  # a spec the API types refuse is read again this often (not a failure: nothing retries)
ANNOTATION_PREFIX = f"tuner.{GROUP}"


@dataclass(frozen=True)
class ClusterConfig:
    prometheus_url: str
    storage: str
    namespaces: tuple[str, ...] = ()
    selector_template: str = 'namespace="{namespace}",service="{name}"'
    peering: str | None = None
    liveness: str | None = "http://0.0.0.0:8081/healthz"
    min_requests: int = 20
    seed: int | None = None
    # Knobs travel status.scheduler -> the operator's watch -> a push to each ready pod -> its acknowledgement in
    # status.knobs: about a second on the local cluster. The bound covers a push that failed and its retries
    # (1, 2, 4, 8 s); past it the trial is given up and the next iteration tries again.
    apply_timeout: float = 30.0


def tuning_config(namespace: str, name: str, spec: dict, cluster: ClusterConfig) -> TuningConfig:
    """The InferenceDeployment's spec → the loop's settings; raises ValidationError/ValueError on a bad spec."""
    s = InferenceDeploymentSpec.model_validate(spec)
    if why := knob_refusal(s):
        raise ValueError(why)  # the operator's rule: the tuner holds what the operator refuses
    slo = s.slo.targets
    b, a = s.tuning.bounds, s.autoscaling
    classes = slo_classes(s)
    # With classes the engine composes each step for the tightest deadline running; the step-time model predicts
    # a first-come-first-served step, so it cannot screen knobs there: Optuna searches, judged by measurement.
    guidance = "blackbox" if classes is not None else s.tuning.guidance
    thresholds = threshold_bounds(s)
    targets = {"slo": s.slo.model_dump(), "bounds": b.model_dump(), "objective": s.tuning.objective}
    if classes is not None:  # the constraints and the objective are the classes': another study
        targets["classes"] = classes.to_json()
    pods = s.disaggregation.pods if thresholds is not None else None
    if thresholds is not None:  # another space, another study; every other resource keeps its study's name
        targets["thresholds"] = list(thresholds)
        targets["pods"] = pods
    fingerprint = hashlib.sha256(json.dumps(targets, sort_keys=True).encode()).hexdigest()[:8]
    return TuningConfig(
        deployment=f"{namespace}/{name}@{fingerprint}", slo=slo,
        budget_bounds=(b.token_budget.min, b.token_budget.max),
        chunk_bounds=(b.max_chunk.min, b.max_chunk.max), threshold_bounds=thresholds, pods=pods,
        selector=measurement_selector(cluster.selector_template, namespace, name, s.disaggregated),
        classes=classes,
        storage=cluster.storage, seed=cluster.seed,
        settings=TunerSettings(mode=s.tuning.mode, objective=s.tuning.objective, window=s.tuning.window_seconds,
                               warmup=s.tuning.warmup_seconds, max_trials=s.tuning.max_trials,
                               min_requests=cluster.min_requests, guidance=guidance,
                               apply_timeout=cluster.apply_timeout),
        scaling=ScalingPolicy(mode=a.mode, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                              up_stabilization=a.scale_up_stabilization_seconds,
                              down_stabilization=a.scale_down_stabilization_seconds,
                              target_utilization=a.target_prefill_utilization))


def threshold_bounds(spec: InferenceDeploymentSpec) -> tuple[int, int] | None:
    """The decode pods' disaggregation threshold is the tuner's to search only with disaggregation mode auto and
    tuning mode auto (mode on keeps the spec's threshold; advisory changes nothing): from one KV block (fewer
    uncached tokens are never worth a transfer) to the longest prompt the model takes (spec.model.maxModelLen, or
    space.DEFAULT_THRESHOLD_MAX where the spec leaves it to the model); the grid adds "never"."""
    d = spec.disaggregation
    if d is None or d.mode != "auto" or spec.tuning.mode != "auto":
        return None
    return TuningConfig.step, spec.model.max_model_len or DEFAULT_THRESHOLD_MAX


def measurement_selector(template: str, namespace: str, name: str, disaggregated: bool) -> str:
    """The Prometheus selector of the series a resource is judged by. Disaggregated, the SLOs are the clients',
    and the clients reach the decode pods alone (the client Service selects them): their TTFT and ITL are end to
    end, a remote prefill and its transfer included. A prefill pod's own series (its steps, and whatever it
    records for the prompts it computes for decode pods) are not what any client saw, would count it as a pod
    carrying the client load, and its steps would pull the decode pods' step-time fit towards long prefill-only
    steps. The default template's `service="<name>"` already selects the decode pods alone (the ServiceMonitor
    scrapes the prefill pods as service `<name>-prefill`, builders.prefill_service); the prefill pods are excluded
    outright as well, by their Service and their pod names (`<name>-prefill-...`, their Deployment's), so that a
    wider template (a regex on the service or the pod) cannot let them in."""
    selector = template.format(namespace=namespace, name=name)
    if disaggregated:
        selector += f',service!="{name}-prefill",pod!~"{name}-prefill-.*"'
    return selector


class StatusWriter:
    """Read-modify-write of the tuner's part of status (scheduler, tuning, slo, and the Tuning and SLOMet
    conditions), retried on conflicts. Only the API's status models go in."""

    def __init__(self, kube: Kube, namespace: str, name: str) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name

    def _read_modify_write(self, make_patch, what: str, attempts: int) -> bool:
        """Read the resource, patch its status with make_patch(raw) against the resourceVersion read, and retry on
        conflicts. False when the resource is gone or every attempt conflicted."""
        for _ in range(attempts):
            raw = self.kube.read_inference_deployment(self.namespace, self.name)
            if raw is None:
                return False
            try:
                self.kube.patch_status(self.namespace, self.name, make_patch(raw),
                                       raw["metadata"].get("resourceVersion"))
                return True
            except ApiException as e:
                if e.status != 409:
                    raise
        log.warning("%s of %s/%s not written after %d conflicts", what, self.namespace, self.name, attempts)
        return False

    def write(self, *, tuning: TuningStatus | None = None, slo: SLOStatus | None = None,
              autoscaling: AutoscalingStatus | None = None, tuner_conditions: list[Condition] | None = None,
              attempts: int = 5) -> None:
        """The tuner's report (the knobs go through write_knobs, which owns their generation)."""
        part = {key: dump(model) for key, model in (("tuning", tuning), ("slo", slo), ("autoscaling", autoscaling))
                if model is not None}
        if slo is not None and not slo.classes:
            part["slo"]["classes"] = None  # a merge patch keeps what it leaves out: the classes' report goes too

        def patch(raw: dict) -> dict:
            if tuner_conditions is None:
                return part
            return {**part, "conditions": merge_conditions((raw.get("status") or {}).get("conditions") or [],
                                                           tuner_conditions, now_rfc3339(),
                                                           family=ConditionType.CLASS_SLO_MET_PREFIX)}
        self._read_modify_write(patch, "status", attempts)

    def write_knobs(self, knobs: Knobs, newer_than: int, attempts: int = 5) -> int:
        """status.scheduler = the tuner's knobs, under a generation newer than `newer_than` and than the one in
        status at the time of writing (read-modify-write against the resourceVersion). The operator writes the
        spec's knobs as generation 1 when it first sees a resource, which can be after the tuner read it: counting
        from its own read, the tuner wrote different knobs under that same generation 1, and "every pod reports
        generation 1" then proved nothing (seen on a real kubelet). Returns the generation written."""
        generation = newer_than + 1

        def patch(raw: dict) -> dict:
            nonlocal generation
            st = status_scheduler(raw)
            generation = max(newer_than, st.generation if st is not None else 0) + 1
            scheduler = dump(SchedulerStatus.of(knobs, source="tuner", generation=generation))
            # a merge patch keeps what it leaves out: delete what these knobs do not carry
            if knobs.disagg_threshold is None and st is not None and st.disagg_threshold is not None:
                scheduler["disaggThreshold"] = None
            if knobs.prefill_pods is None and st is not None and st.prefill_pods is not None:
                scheduler["prefillPods"] = None
            if knobs.prefill_budget is None and st is not None and st.prefill_token_budget is not None:
                scheduler["prefillTokenBudget"] = None
            return {"scheduler": scheduler}
        self._read_modify_write(patch, "knobs", attempts)
        return generation


class StatusActuator:
    """The tuner's knobs into status.scheduler; "applied" is the operator's record in status.knobs that every ready
    pod acknowledged exactly these knobs under this generation (an API read, not a Prometheus scrape: seconds,
    not a scrape interval plus a volume sync)."""

    def __init__(self, writer: StatusWriter, start: Knobs, generation: int) -> None:
        self.writer = writer
        self._knobs, self._generation = start, generation

    def apply(self, knobs: Knobs) -> int:
        self._generation = self.writer.write_knobs(knobs, self._generation)
        self._knobs = knobs
        return self._generation

    def applied(self, generation: int) -> bool:
        raw = self.writer.kube.read_inference_deployment(self.writer.namespace, self.writer.name)
        status = (raw or {}).get("status") or {}
        try:
            knobs = KnobsStatus.model_validate(status.get("knobs"))
        except ValidationError:  # none yet (the operator has not delivered since) or unreadable: not applied
            return False
        ready = int(status.get("readyReplicas") or 0)
        prefill = self._knobs.prefill_knobs
        return knobs.applied_everywhere(SchedulerKnobs.of(self._knobs, generation), ready,
                                        None if prefill is None else SchedulerKnobs.of(prefill, generation)) and \
            split_applied(status, self._knobs.prefill_pods, ready)

    def current(self) -> Knobs:
        return self._knobs


def split_applied(status: dict, prefill_pods: int | None, ready: int) -> bool:
    """The operator's record says the pods serve in the split chosen (disaggregation mode auto): as many ready
    prefill pods as asked, at most all ready pods but one (operator/role_split.py). True where no split is chosen."""
    if prefill_pods is None:
        return True
    prefill = ((status.get("disaggregation") or {}).get("prefill") or {}).get("readyReplicas") or 0
    return int(prefill) == max(0, min(prefill_pods, ready - 1))


class StatusScaler:
    """Replicas through the scale subresource. The count and readiness come from the resource (the operator
    mirrors its Deployment into status.replicas and status.readyReplicas). Auto is refused while an HPA targets the
    resource: two controllers must not fight over spec.replicas. The HPA check is the shared one
    (chunkpilot.kube.autoscalers: one list per namespace at most every 30 s)."""

    def __init__(self, kube: Kube, namespace: str, name: str, autoscalers: AutoscalerCheck | None = None) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.autoscalers = autoscalers or AutoscalerCheck(kube)

    def replicas(self) -> ReplicaCount:
        raw = self.kube.read_inference_deployment(self.namespace, self.name) or {}
        spec = int((raw.get("spec") or {}).get("replicas", 1))
        ready = int((raw.get("status") or {}).get("readyReplicas") or 0)
        return ReplicaCount(spec=spec, ready=ready, version=(raw.get("metadata") or {}).get("resourceVersion"))

    def scale(self, replicas: int, version: str | None = None) -> bool:
        """Through the scale subresource, against `version` (a conflict or a deleted resource: not written)."""
        try:
            self.kube.scale_inference_deployment(self.namespace, self.name, replicas, resource_version=version)
        except ApiException as e:
            if e.status in (404, 409):
                log.info("%s/%s: not scaled to %d (%s %s)", self.namespace, self.name, replicas, e.status, e.reason)
                return False
            raise
        return True

    def refused(self) -> str:
        try:
            # ours, or the Deployment the operator made for it (same name): either fights over the replicas
            hpas = self.autoscalers.targeting(self.namespace, [(GROUP, KIND, self.name),
                                                               ("apps", "Deployment", self.name)])
        except ApiException as e:  # not knowing is no licence to fight another controller
            return (f"cannot list HorizontalPodAutoscalers in {self.namespace} ({e.status} {e.reason}): "
                    f"autoscaling.mode auto is refused until the tuner may (chart RBAC)")
        return "" if not hpas else (
            f"HorizontalPodAutoscaler {', '.join(hpas)} targets "
            + ("the Deployment of this InferenceDeployment"
               if all(t[1] == "Deployment" for t in hpas.values()) else "this InferenceDeployment")
            + ": autoscaling.mode auto is refused, two controllers must not fight over replicas; recommending "
              "only. Use mode recommend and let an HPA on the InferenceDeployment (its scale subresource) act "
              "on chunkpilot:tuner_desired_replicas, or delete the HPA")


class StatusPublisher:
    def __init__(self, writer: StatusWriter, config: TuningConfig, metrics: TunerMetrics | None,
                 post_event=None) -> None:
        self.writer, self.config, self.metrics = writer, config, metrics
        self.post_event = post_event  # (type, reason, message) -> a Kubernetes Event on the resource
        self._healthy, self._last_change, self._feasible = True, None, None
        self._last_scale, self._refused = None, ""

    def _events(self, state: TunerState) -> None:
        """`kubectl describe` tells an SRE when the tuner moved knobs and when it stopped being able to."""
        if self.post_event is None:
            return
        if state.healthy != self._healthy:
            if state.healthy:
                self.post_event("Normal", "MeasurementsBack", "measurements work again; tuning resumes")
            else:
                self.post_event("Warning", "MeasurementsUnavailable", state.reason)
            self._healthy = state.healthy
        if state.feasible is not None and state.feasible != self._feasible:
            if state.feasible is False:
                self.post_event("Warning", "NoFeasibleKnobs", state.feasible_reason)
            elif self._feasible is False:
                self.post_event("Normal", "FeasibleKnobs", "knobs are predicted to keep the SLOs again; tuning "
                                                           "explores inside them")
            self._feasible = state.feasible
        sc = state.scaling
        if sc is not None:
            if sc.refused != self._refused:
                if sc.refused:
                    self.post_event("Warning", sc.refused_reason, sc.refused)
                self._refused = sc.refused
            if sc.last_scale and sc.last_scale != self._last_scale:
                self._last_scale = sc.last_scale
                self.post_event("Normal", "Scaled", f"replicas -> {sc.desired}: {sc.reason}")
        if state.last_change and state.last_change != self._last_change and state.current is not None:
            self._last_change = state.last_change
            k = state.current
            threshold = ("" if k.disagg_threshold is None else
                         f", disaggregation threshold {threshold_text(k.disagg_threshold)}")
            self.post_event("Normal", "KnobsTuned", f"token budget {k.token_budget}, max chunk "
                                                    f"{k.max_chunk}{threshold} ({state.phase.lower()})")

    def publish(self, state: TunerState) -> None:
        self._events(state)
        self.writer.write(tuning=status_tuning(state, self.config.slo, self.config.settings.objective),
                          slo=status_slo(state.current_window, self.config.slo),
                          autoscaling=status_autoscaling(state),
                          tuner_conditions=conditions(state, self.config.slo))
        if self.metrics is not None:
            self.metrics.update(self.writer.namespace, self.writer.name, state, self.config.slo,
                                self.config.settings.objective)
            self.metrics.update_scaling(self.writer.namespace, self.writer.name, state,
                                        self.config.scaling.max_replicas)


def status_scheduler(raw: dict) -> SchedulerStatus | None:
    """status.scheduler of a raw resource, or None when absent or unreadable."""
    try:  # only the part we need: a status field a newer version added must not cost us the knobs' generation
        return SchedulerStatus.model_validate((raw.get("status") or {}).get("scheduler"))
    except ValidationError:
        return None


def start_knobs(raw: dict) -> tuple[Knobs, int]:
    """The knobs the pods should run now and their generation (api.types.desired_knobs, the rule the operator
    delivers by), so the tuner's first write is newer than both the spec's and its own last; raises
    ValidationError on a spec the API types refuse."""
    spec = InferenceDeploymentSpec.model_validate(raw.get("spec") or {})
    st = status_scheduler(raw)
    obj = InferenceDeployment(metadata=raw.get("metadata") or {}, spec=spec,
                              status=InferenceDeploymentStatus(scheduler=st))
    knobs, _ = desired_knobs(obj)
    return knobs.knobs, knobs.generation


def poster(raw: dict):
    ref = {"apiVersion": raw.get("apiVersion", f"{GROUP}/{VERSION}"), "kind": raw.get("kind", "InferenceDeployment"),
           "metadata": {k: raw["metadata"][k] for k in ("name", "namespace", "uid") if k in raw["metadata"]}}

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(ref, type=type_, reason=reason, message=message[:1024])
    return post


def iteration_failure(e: Exception, retry_in: float) -> tuple[str, str]:
    """The Tuning condition's reason and message for an iteration that raised."""
    from sqlalchemy.exc import SQLAlchemyError

    if isinstance(e, ApiException):
        return "KubernetesAPIError", reasons.api_failed(e.status, e.reason, retry_in)
    if isinstance(e, (SQLAlchemyError, optuna.exceptions.StorageInternalError)):
        root = e  # Optuna wraps the database's words ("attempt to write a readonly database") in a generic error
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        said = (str(root).strip().splitlines() or [""])[0][:300]
        return "StudyStorageUnavailable", reasons.storage_failed(type(root).__name__, said, retry_in)
    return "IterationFailed", reasons.iteration_failed(e, retry_in)


def report_failure(writer: StatusWriter, post_event, reason: str, message: str) -> None:
    """Tuning=False and a Warning Event naming the failure; best effort (the API may be what fails)."""
    try:
        writer.write(tuner_conditions=[Condition(type=ConditionType.TUNING, status="False", reason=reason,
                                                 message=message)])
        post_event("Warning", reason, message)
    except Exception as e:  # noqa: BLE001 - the report must never be what stops the loop
        log.warning("tuning %s/%s: the failure could not be reported (%r)", writer.namespace, writer.name, e)


EventPoster = Callable[[str, str, str], None]  # (type, reason, message) -> a Kubernetes Event on the resource


@dataclass(frozen=True)
class Sources:
    """What tune_one builds a resource's loop from, besides the API client and the settings in `memo`: production
    code takes `Sources.of(cluster)`, tests hand in fakes (a scripted measurer, an event list, a quick backoff)."""

    # (selector of the resource's engine series, its SLOs, the wait that a stop ends, its SLO classes or None) ->
    # the window measurer
    measurer: Callable[[str, SLOTargets, Callable[[float], bool], SLOClasses | None], Measurer]
    events: Callable[[dict], EventPoster]  # the raw resource -> where its Events go
    build_loop: Callable[..., TunerLoop] = build_loop  # config.build_loop: the study storage named in the config
    # the pause after a failed iteration, doubling while failures repeat (retry.py: the one retry layer)
    backoff: Callable[[], Backoff] = lambda: Backoff(ERROR_BACKOFF_INITIAL, ERROR_BACKOFF_MAX)

    @classmethod
    def of(cls, cluster: ClusterConfig) -> Sources:
        """Prometheus at the cluster's URL; Events through kopf."""
        def measurer(selector: str, slo: SLOTargets, sleep: Callable[[float], bool], classes: SLOClasses | None
                     ) -> Measurer:
            return PrometheusMeasurer(PrometheusSource(cluster.prometheus_url, selector), slo, sleep=sleep,
                                      classes=classes)
        return cls(measurer=measurer, events=poster)


def tune_one(namespace: str, name: str, uid: str, memo: kopf.Memo, stopped: threading.Event,
             sources: Sources) -> None:
    """One resource's tuning: rebuild the loop when the tuning spec changes, iterate until stopped or gone. Pinned
    to the resource's uid: a new resource of the same name gets a fresh thread, study state and generation.

    A failed call inside an iteration (the object deleted under a scale write, an API server 5xx, Prometheus
    answering garbage) costs one iteration, not the loop: the same loop goes on after a pause, with its study
    position and its scaling history. The autoscaler's recommendations are kept per uid in `memo` too, so a spec
    change that rebuilds the loop (or a restart of this thread) does not start a scale-down stabilization window
    over."""
    kube: Kube = memo.kube
    cluster: ClusterConfig = memo.cluster
    writer = StatusWriter(kube, namespace, name)
    loop: TunerLoop | None = None
    built_for: TuningConfig | None = None
    sleep = stopped.wait  # True once stopped: the measurer gives up its window
    histories = memo.setdefault("scaling_histories", {})
    history = histories.setdefault(uid, [])
    autoscalers = memo.setdefault("autoscalers", AutoscalerCheck(kube))
    may_act = memo.get("gate") or (lambda: True)
    backoff, failing, raw = sources.backoff(), None, None
    while not stopped.is_set():
        # Everything an iteration calls is inside this one try: the read, the spec's check, the loop's build and
        # its window. This is the only place a failure is retried (retry.py); the loop shares its Backoff.
        try:
            if not may_act():  # another tuner replica acts (kopf peering): stand by, write nothing
                sleep(5)
                continue
            raw = kube.read_inference_deployment(namespace, name)
            if raw is None or raw["metadata"].get("uid", "") != uid:
                histories.pop(uid, None)
                return
            try:
                config = tuning_config(namespace, name, raw.get("spec") or {}, cluster)
            except (ValidationError, ValueError) as e:
                writer.write(tuning=TuningStatus(mode="off", phase="Holding", reason=str(e)[:1024]),
                             tuner_conditions=[Condition(type=ConditionType.TUNING, status="False",
                                                         reason="InvalidTuningSpec", message=str(e)[:1024])])
                sleep(INVALID_SPEC_RECHECK)
                continue
            if config != built_for:
                start, generation = start_knobs(raw)
                loop = sources.build_loop(config, StatusActuator(writer, start, generation),
                                          sources.measurer(config.selector, config.slo, sleep, config.classes),
                                          StatusPublisher(writer, config, memo.metrics, post_event=sources.events(raw)),
                                          scaler=StatusScaler(kube, namespace, name, autoscalers),
                                          scaling_history=history, backoff=backoff)
                built_for = config
                # an SRE reading the log after a restart or a reinstall sees whether the study (on its volume or
                # database) came back, or whether the tuner starts from nothing
                done = loop.study.total_completed()
                log.info("tuning %s/%s: study %s, mode %s, %s", namespace, name, config.deployment,
                         config.settings.mode, f"resumed with {done} completed trials" if done else
                         "no completed trials yet")
            loop.iterate()  # resets the shared backoff itself when it went well; a hold (Prometheus down) doubles it
            failing = None
        except Exception as e:  # noqa: BLE001 - one failed call is not a reason to lose the loop (above)
            pause = backoff.failed()
            what = f"Kubernetes API {e.status} {e.reason}" if isinstance(e, ApiException) else repr(e)
            log.warning("tuning %s/%s: an iteration failed (%s); the same loop goes on in %.0f s", namespace, name,
                        what, pause, exc_info=not isinstance(e, ApiException))
            reason, message = iteration_failure(e, pause)
            if reason != failing and raw is not None:  # said once while it lasts; a good iteration replaces it
                report_failure(writer, sources.events(raw), reason, message)
                failing = reason
            sleep(pause)


def build_registry() -> kopf.OperatorRegistry:
    registry = with_client_login(kopf.OperatorRegistry())

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def inference_deployment_changed(event: kopf.RawEvent, memo: kopf.Memo, **_) -> None:
        if not memo.stopping.is_set():
            memo.supervisor.observe(event["type"], event["object"])

    return registry


def kopf_process(cluster: ClusterConfig) -> KopfProcess:
    # kopf would patch resources to take its finalizer off; the tuner's role has no patch on them (status and scale
    # only), so its kopf uses a finalizer name no resource carries.
    return KopfProcess(prefix=ANNOTATION_PREFIX, finalizer=f"{ANNOTATION_PREFIX}/never-set",
                       namespaces=cluster.namespaces, peering=cluster.peering,
                       liveness=cluster.liveness)


def run(cluster: ClusterConfig, metrics: TunerMetrics, stop: threading.Event) -> None:
    """kopf in its own thread (as the operator does) so the CLI's signal handler owns SIGTERM; on stop, every
    tuning thread ends its window and returns."""
    load_config()
    process = kopf_process(cluster)
    kube = Kube()
    # kopf pauses its watch handling on a standby replica, not our tuning threads: they ask the same peering object
    gate = PeeringGate(None if cluster.peering is None else
                       (lambda: kube.read_peerings(cluster.peering, cluster.namespaces)), process.priority)
    memo = kopf.Memo(kube=kube, cluster=cluster, metrics=metrics, stopping=stop, autoscalers=AutoscalerCheck(kube),
                     gate=gate)
    sources = Sources.of(cluster)
    memo.supervisor = Supervisor(lambda namespace, name, uid, stopped: tune_one(namespace, name, uid, memo, stopped,
                                                                               sources))
    try:
        process.run(build_registry(), process.settings(), memo, stop)
    finally:
        memo.supervisor.stop_all()
