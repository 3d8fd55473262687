"""The operator's pure decisions: what to write, when, and what status says. No API server needed."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from chunkpilot.api.types import (Condition, InferenceDeploymentSpec, KnobsStatus, SchedulerStatus,
                                  desired_knobs)
from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.kube.conditions import merge_conditions
from chunkpilot.operator import builders
from chunkpilot.operator.apply import APPLIED_HASH, is_subset, plan, with_hash
from chunkpilot.operator.conditions import OPERATOR_STATUS_FIELDS, Problem, deployment_conditions, status_patch
from chunkpilot.operator.reconciler import spec_error_message

from .test_crd_and_builders import SMOL, load


def live_copy(desired: dict) -> dict:
    """What the API server returns: our object plus defaults and bookkeeping."""
    live = copy.deepcopy(with_hash(desired))
    live["metadata"].update(uid="u", resourceVersion="7", creationTimestamp="2026-11-29T00:00:00Z")
    if live["kind"] == "Deployment":
        live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
        live["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
        live["spec"]["revisionHistoryLimit"] = 10
        live["status"] = {"replicas": 2}
    return live


def test_plan_is_a_no_op_on_server_defaults_and_applies_on_change_or_drift():
    obj = load(SMOL)
    for desired in builders.desired_objects(obj):
        assert plan(desired, None) == "create"
        assert plan(desired, live_copy(desired)) == "none", desired["kind"]
    deploy = builders.deployment(obj)
    drifted = live_copy(deploy)
    drifted["spec"]["template"]["spec"]["containers"][0]["image"] = "hand-edited:1"
    assert plan(deploy, drifted) == "apply"  # someone edited a field we own: put it back
    changed = copy.deepcopy(deploy)
    changed["spec"]["replicas"] = 5
    assert plan(changed, live_copy(deploy)) == "apply"
    assert with_hash(deploy)["metadata"]["annotations"][APPLIED_HASH] != \
        with_hash(changed)["metadata"]["annotations"][APPLIED_HASH]


def test_subset_matches_int_or_string_spellings_but_not_different_lists():
    assert is_subset({"port": 8000, "cpu": "4"}, {"port": "8000", "cpu": "4", "extra": 1})
    assert not is_subset({"args": ["a"]}, {"args": ["a", "b"]})
    assert not is_subset({"enabled": True}, {"enabled": "True"})


def test_desired_knobs_have_one_owner_per_mode_and_a_generation_that_only_grows():
    obj = load(SMOL)
    obj.metadata["generation"] = 1
    assert desired_knobs(obj) == (SchedulerKnobs(128, 64, 1), "spec")
    assert desired_knobs(obj) == desired_knobs(obj)  # pure: the same object, the same knobs and generation
    obj.spec.scheduler.token_budget, obj.metadata["generation"] = 256, 2  # a spec edit bumps metadata.generation
    assert desired_knobs(obj) == (SchedulerKnobs(256, 64, 2), "spec")
    seen = [2]
    obj.status.scheduler = SchedulerStatus(tokenBudget=96, maxChunk=32, source="tuner", generation=9)
    assert desired_knobs(obj) == (SchedulerKnobs(96, 32, 9), "tuner")  # auto mode: the tuner's alone
    seen.append(9)
    obj.spec.tuning.mode, obj.metadata["generation"] = "advisory", 3
    knobs, source = desired_knobs(obj)  # back to the spec's: newer than anything the tuner wrote
    assert (knobs.knobs, source) == (obj.spec.scheduler.knobs, "spec") and knobs.generation == 12
    seen.append(knobs.generation)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_the_operator_never_writes_the_tuners_knobs():
    """One writer per field: status.scheduler is the tuner's; the operator's patch cannot carry it."""
    assert "scheduler" not in OPERATOR_STATUS_FIELDS
    obj = load(SMOL)
    obj.status.scheduler = SchedulerStatus(tokenBudget=96, maxChunk=32, source="tuner", generation=9)
    knobs = KnobsStatus(tokenBudget=96, maxChunk=32, generation=9, source="tuner")
    patch = status_patch({"scheduler": {"tokenBudget": 1}}, deploy=None, desired_replicas=1, generation=1,
                         selector="a=b", knobs=knobs, problem=None, now="t")
    assert "scheduler" not in patch and patch["knobs"]["generation"] == 9


def test_conditions_follow_a_rollout():
    gen = 3
    assert [c.reason for c in deployment_conditions(None, 2, gen, None)] == ["NotCreated", "NotCreated",
                                                                                 "AsExpected"]
    rolling = {"metadata": {"generation": 4}, "status": {"observedGeneration": 4, "replicas": 3, "updatedReplicas": 1,
                                                         "readyReplicas": 2}}
    ready, prog, deg = deployment_conditions(rolling, 2, gen, None)
    assert (ready.status, prog.status, prog.reason, deg.status) == ("True", "True", "RollingOut", "False")
    done = {"metadata": {"generation": 4}, "status": {"observedGeneration": 4, "replicas": 2, "updatedReplicas": 2,
                                                      "readyReplicas": 2}}
    assert [c.reason for c in deployment_conditions(done, 2, gen, None)] == ["AllReplicasReady", "RolloutComplete",
                                                                                "AsExpected"]
    quota = {**done, "status": {**done["status"], "conditions": [
        {"type": "ReplicaFailure", "status": "True", "message": "exceeded quota: gpu"}]}}
    assert deployment_conditions(quota, 2, gen, None)[2].message == "exceeded quota: gpu"
    bad = deployment_conditions(done, 2, gen, Problem("InvalidSpec", "spec.x: fix it"))
    assert (bad[0].status, bad[2].status, bad[2].reason) == ("True", "True", "InvalidSpec")


def test_merge_keeps_the_tuners_conditions_and_transition_times():
    old = [{"type": "Ready", "status": "False", "lastTransitionTime": "t0"},
           {"type": "Tuning", "status": "True", "reason": "Exploring", "lastTransitionTime": "t0"}]
    new = [Condition(type="Ready", status="False", reason="ReplicasNotReady", message="0/1"),
           Condition(type="Degraded", status="False", reason="AsExpected")]
    merged = merge_conditions(old, new, "t1")
    by = {c["type"]: c for c in merged}
    assert by["Ready"]["lastTransitionTime"] == "t0"  # same status: the transition time stays
    assert by["Degraded"]["lastTransitionTime"] == "t1"
    assert by["Tuning"]["reason"] == "Exploring"
    flipped = merge_conditions(merged, [new[0].model_copy(update={"status": "True"})], "t2")
    assert {c["type"]: c for c in flipped}["Ready"]["lastTransitionTime"] == "t2"


def test_status_patch_is_none_when_nothing_changed():
    kw = dict(deploy=None, desired_replicas=1, generation=1, selector="a=b", knobs=None, problem=None, now="t")
    first = status_patch({}, **kw)
    assert first is not None and first["observedGeneration"] == 1
    assert status_patch(first, **{**kw, "now": "later"}) is None


def test_spec_errors_name_the_field_in_the_crd_spelling():
    with pytest.raises(ValidationError) as err:
        InferenceDeploymentSpec.model_validate({"model": {"source": "hostpath:///m"}, "engine": {"maxNumSeqs": 0}})
    assert "spec.engine.maxNumSeqs" in spec_error_message(err.value) and "(got 0)" in spec_error_message(err.value)
