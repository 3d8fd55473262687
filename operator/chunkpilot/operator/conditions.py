"""Pure functions: the owned Deployment's state (and any error) in, the InferenceDeployment's status out.

The operator owns the Ready, Progressing and Degraded conditions; the tuner owns Tuning and SLOMet
(chunkpilot.kube.conditions merges them so that neither wipes the other's)."""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.api.types import (Condition, ConditionType, DisaggregationStatus, InferenceDeploymentStatus,
                                  KnobsStatus, RoleStatus, RoutingStatus, SchedulerStatus)
from chunkpilot.kube.conditions import merge_conditions

# The status fields the operator writes (conditions: Ready, Progressing, Degraded); the tuner writes scheduler
# (source: tuner), tuning and slo, and the Tuning and SLOMet conditions.
# Never `scheduler`: the tuner alone writes the knobs it chose (one writer per field; see docs/architecture.md).
OPERATOR_STATUS_FIELDS = {"observed_generation", "replicas", "ready_replicas", "selector", "knobs", "disaggregation",
                          "routing"}


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


def role_status(replicas: int, ready: int, knobs: KnobsStatus | None) -> RoleStatus:
    """One role's entry of status.disaggregation: its pods, and the knobs delivered to them (None until a pass
    could deliver) with how many ready pods acknowledged them."""
    return RoleStatus(replicas=replicas, ready_replicas=ready,
                      knobs=None if knobs is None else SchedulerStatus.of(knobs.scheduler_knobs.knobs,
                                                                          source=knobs.source,
                                                                          generation=knobs.generation),
                      applied_replicas=0 if knobs is None else knobs.applied_replicas)


@dataclass(frozen=True)
class RolePods:
    """One role of a disaggregated resource: its Deployment as it is, the pods it should have, and the knobs
    delivered to them (None until a pass could deliver)."""

    role: str
    deploy: dict | None
    desired_replicas: int
    knobs: KnobsStatus | None = None

    def status(self) -> RoleStatus:
        ds = (self.deploy or {}).get("status") or {}
        return role_status(int(ds.get("replicas") or 0), int(ds.get("readyReplicas") or 0), self.knobs)


def role_conditions(roles: list[RolePods], generation: int | None, problem: Problem | None) -> list[Condition]:
    """Ready / Progressing / Degraded of a disaggregated resource, from each role's Deployment: ready when every
    role is, rolling out while any role does (a failed rollout first), degraded when any role is. Ready's message
    counts every role; another message that differs by role names its role ("decode: RolloutFailed ...")."""
    per_role = [(r.role, deployment_conditions(r.deploy, r.desired_replicas, generation, problem)) for r in roles]
    worst_first = ((lambda c: c.status == "False",),  # Ready
                   (lambda c: c.reason == "RolloutFailed", lambda c: c.status == "True"),  # Progressing
                   (lambda c: c.status == "True",))  # Degraded
    out = []
    for i, tests in enumerate(worst_first):
        conds = [(role, cs[i]) for role, cs in per_role]
        role, chosen = next(((r, c) for test in tests for r, c in conds if test(c)), conds[0])
        if i == 0:
            message = "; ".join(f"{r}: {c.message}" for r, c in conds)
        elif len({c.message for _, c in conds}) == 1:  # the same for every role (a spec problem): said once
            message = chosen.message
        else:
            message = f"{role}: {chosen.message}"
        out.append(chosen.model_copy(update={"message": message}))
    return out


def status_patch(current_status: dict, *, deploy: dict | None, desired_replicas: int, generation: int | None,
                 selector: str, knobs: KnobsStatus | None, problem: Problem | None, now: str,
                 roles: list[RolePods] | None = None, split: DisaggregationStatus | None = None,
                 routing: RoutingStatus | None = None) -> dict | None:
    """The merge patch for `status` (the operator's fields only), or None when nothing changed (so reconciles that
    change nothing write nothing: level-triggered without a write loop). With `roles` (disaggregation mode on),
    conditions and counts come from each role's Deployment and `deploy` is not read; with `split` (mode auto: one
    Deployment, its pods' roles), status.disaggregation is that; without either, status.disaggregation goes.
    status.routing is `routing` (spec.routing's pool and picker), gone without it."""
    if roles is None:
        ds = (deploy or {}).get("status") or {}
        conditions = deployment_conditions(deploy, desired_replicas, generation, problem)
        replicas, ready, disaggregation = int(ds.get("replicas") or 0), int(ds.get("readyReplicas") or 0), split
    else:
        conditions = role_conditions(roles, generation, problem)
        by_role = {r.role: r.status() for r in roles}
        replicas = sum(s.replicas for s in by_role.values())
        ready = sum(s.ready_replicas for s in by_role.values())
        disaggregation = DisaggregationStatus(**by_role)
    want = InferenceDeploymentStatus(
        observed_generation=generation, replicas=replicas, ready_replicas=ready, selector=selector, knobs=knobs,
        disaggregation=disaggregation, routing=routing,
    ).model_dump(by_alias=True, exclude_none=True, include=OPERATOR_STATUS_FIELDS)
    # merged: the tuner's conditions pass through as they are
    want["conditions"] = merge_conditions(current_status.get("conditions") or [], conditions, now)
    for key, value in (("disaggregation", disaggregation), ("routing", routing)):
        if value is None and key in current_status:
            want[key] = None  # switched off: a merge patch removes the field with a null
    changed = {k: v for k, v in want.items() if current_status.get(k) != v}
    return changed or None
