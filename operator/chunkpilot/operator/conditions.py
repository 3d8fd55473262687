"""Pure functions: the owned Deployment's state (and any error) in, the InferenceDeployment's status out.

The operator owns the Ready, Progressing and Degraded conditions; the tuner owns Tuning and SLOMet
(chunkpilot.kube.conditions merges them so that neither wipes the other's)."""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.api.types import Condition, ConditionType, InferenceDeploymentStatus, KnobsStatus
from chunkpilot.kube.conditions import merge_conditions

# The status fields the operator writes (conditions: Ready, Progressing, Degraded); the tuner writes scheduler
# (source: tuner), tuning and slo, and the Tuning and SLOMet conditions.
# Never `scheduler`: the tuner alone writes the knobs it chose (one writer per field; see docs/architecture.md).
OPERATOR_STATUS_FIELDS = {"observed_generation", "replicas", "ready_replicas", "selector", "knobs"}


@dataclass(frozen=True)
class Problem:
    """Why the operator could not make the cluster match the spec (None when it could)."""

    reason: str  # CamelCase, e.g. InvalidSpec, MissingVolume, ApiError
    message: str  # says what to change


def _cond(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> Condition:
    return Condition(type=type_, status="True" if ok else "False", reason=reason, message=message,
                     observed_generation=generation)


def deployment_conditions(deploy: dict | None, desired_replicas: int, generation: int | None,
                          problem: Problem | None) -> list[Condition]:
    """Ready / Progressing / Degraded from the Deployment's status, as `kubectl rollout status` reads it."""
    ds = (deploy or {}).get("status") or {}
    dgen = int((deploy or {}).get("metadata", {}).get("generation") or 0)
    ready = int(ds.get("readyReplicas") or 0)
    updated = int(ds.get("updatedReplicas") or 0)
    total = int(ds.get("replicas") or 0)
    # the Deployment's own conditions (apps/v1 names, not ConditionType: those are the InferenceDeployment's)
    by_type = {c.get("type"): c for c in ds.get("conditions") or []}
    prog = by_type.get("Progressing", {})
    deadline = prog.get("status") == "False" and prog.get("reason") == "ProgressDeadlineExceeded"
    replica_failure = by_type.get("ReplicaFailure", {})

    if deploy is None:
        ready_c = _cond(ConditionType.READY, False, "NotCreated", "the engine Deployment does not exist yet",
                        generation)
    elif desired_replicas == 0:
        ready_c = _cond(ConditionType.READY, True, "ScaledToZero", "replicas is 0", generation)
    elif ready >= desired_replicas:
        ready_c = _cond(ConditionType.READY, True, "AllReplicasReady", f"{ready}/{desired_replicas} engine pods ready",
                        generation)
    else:
        why = f": {problem.message}" if problem is not None and problem.reason == "EngineFailing" else ""
        ready_c = _cond(ConditionType.READY, False, "ReplicasNotReady",
                        f"{ready}/{desired_replicas} engine pods ready{why}", generation)

    rolling = deploy is not None and (int(ds.get("observedGeneration") or 0) < dgen or updated < desired_replicas
                                      or total > updated or ready < desired_replicas)
    if deadline:
        prog_c = _cond(ConditionType.PROGRESSING, False, "RolloutFailed",
                       prog.get("message") or "progress deadline exceeded", generation)
    elif rolling:
        prog_c = _cond(ConditionType.PROGRESSING, True, "RollingOut",
                       f"{updated}/{desired_replicas} pods updated, {ready} ready", generation)
    else:
        prog_c = _cond(ConditionType.PROGRESSING, False, "RolloutComplete" if deploy is not None else "NotCreated",
                       "all engine pods run the current spec" if deploy is not None else "", generation)

    if problem is not None:
        deg_c = _cond(ConditionType.DEGRADED, True, problem.reason, problem.message, generation)
    elif deadline:
        deg_c = _cond(ConditionType.DEGRADED, True, "RolloutFailed",
                      (prog.get("message") or "the rollout did not progress") +
                      "; check the engine pods' events and logs (image, GPU capacity, model path)", generation)
    elif replica_failure.get("status") == "True":
        deg_c = _cond(ConditionType.DEGRADED, True, "ReplicaFailure",
                      replica_failure.get("message") or "pods cannot be created", generation)
    else:
        deg_c = _cond(ConditionType.DEGRADED, False, "AsExpected", "", generation)
    return [ready_c, prog_c, deg_c]


def status_patch(current_status: dict, *, deploy: dict | None, desired_replicas: int, generation: int | None,
                 selector: str, knobs: KnobsStatus | None, problem: Problem | None, now: str) -> dict | None:
    """The merge patch for `status` (the operator's fields only), or None when nothing changed (so reconciles that
    change nothing write nothing: level-triggered without a write loop)."""
    ds = (deploy or {}).get("status") or {}
    conditions = merge_conditions(current_status.get("conditions") or [],
                                  deployment_conditions(deploy, desired_replicas, generation, problem), now)
    want = InferenceDeploymentStatus(
        observed_generation=generation, replicas=int(ds.get("replicas") or 0),
        ready_replicas=int(ds.get("readyReplicas") or 0), selector=selector, knobs=knobs,
    ).model_dump(by_alias=True, exclude_none=True, include=OPERATOR_STATUS_FIELDS)
    want["conditions"] = conditions  # merged: the tuner's conditions pass through as they are
    changed = {k: v for k, v in want.items() if current_status.get(k) != v}
    return changed or None
