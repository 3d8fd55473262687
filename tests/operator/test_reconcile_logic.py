"""The operator's pure decisions: what to write, when, and what status says. No API server needed."""

from __future__ import annotations

import copy

import pytest
import yaml
from pydantic import ValidationError

from chunkpilot.api import types as t

from chunkpilot.api.types import (Condition, InferenceDeploymentSpec, KnobsStatus, SchedulerStatus,
                                  desired_knobs)
from chunkpilot.contract.knobs import DISAGG_NEVER, SchedulerKnobs
from chunkpilot.kube.conditions import merge_conditions
from chunkpilot.operator import builders
from chunkpilot.operator.apply import APPLIED_HASH, is_subset, plan, with_hash
from chunkpilot.operator.conditions import OPERATOR_STATUS_FIELDS, Problem, deployment_conditions, status_patch
from chunkpilot.operator.knobs_delivery import PushError
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


# ---- disaggregation switched on and off (spec.disaggregation) -------------------------------------------------
class MemoryKube:
    """The API calls a pass makes, on objects kept in memory: enough to see what a pass creates, applies and
    deletes (tests/operator/test_operator_apiserver.py runs the same switch against a real API server)."""

    def __init__(self, resource: dict) -> None:
        self.resource = resource
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.pods: list[dict] = []
        self.replica_sets: list[dict] = []
        self.deleted: list[str] = []
        self._uid = 0

    def _key(self, obj: dict) -> tuple[str, str, str]:
        return obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]

    def read(self, api_version, kind, namespace, name):
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def create(self, obj):
        self._uid += 1
        made = copy.deepcopy(obj)
        made["metadata"]["uid"] = f"{obj['kind'].lower()}-{self._uid}"
        self.objects[self._key(obj)] = made
        return copy.deepcopy(made)

    def apply(self, obj, force=True):
        live = self.objects.get(self._key(obj))
        if live is None:
            return self.create(obj)
        applied = copy.deepcopy(obj)
        applied["metadata"]["uid"] = live["metadata"]["uid"]
        self.objects[self._key(obj)] = applied
        return copy.deepcopy(applied)

    def delete(self, api_version, kind, namespace, name):
        self.deleted.append(f"{kind} {name}")
        self.objects.pop((kind, namespace, name), None)

    def patch_status(self, namespace, name, patch, resource_version=None):
        status = self.resource.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        return self.resource

    def read_inference_deployment(self, namespace, name):
        return copy.deepcopy(self.resource)

    def list_pods(self, namespace, selector):
        return [p for p in self.pods if p["metadata"]["labels"].items() >= selector.items()]

    def list_replica_sets(self, namespace, selector):
        return list(self.replica_sets)

    def list_events(self, namespace, field_selector):
        return []

    def patch_pod_labels(self, namespace, name, labels):
        pod = next(p for p in self.pods if p["metadata"]["name"] == name)
        pod["metadata"]["labels"] = {**pod["metadata"]["labels"], **labels}  # a copy: the template's is shared
        return pod

    def list_autoscalers(self, namespace):
        return []

    def crd_exists(self, name):
        return True

    def run_pods(self) -> None:
        """Play the Deployment and ReplicaSet controllers and the kubelet: every Deployment's pods, ready."""
        self.pods, self.replica_sets = [], []
        for (kind, ns, name), d in self.objects.items():
            if kind != "Deployment":
                continue
            rs = {"metadata": {"uid": f"rs-{name}", "ownerReferences": [{"uid": d["metadata"]["uid"],
                                                                          "controller": True}]}}
            self.replica_sets.append(rs)
            n = d["spec"]["replicas"]
            d["status"] = {"observedGeneration": 0, "replicas": n, "updatedReplicas": n, "readyReplicas": n}
            for i in range(n):
                self.pods.append({
                    "metadata": {"name": f"{name}-{i}", "labels": d["spec"]["template"]["metadata"]["labels"],
                                 "ownerReferences": [{"uid": f"rs-{name}", "controller": True}]},
                    "status": {"podIP": f"10.0.{len(self.pods)}.1", "conditions": [{"type": "Ready",
                                                                                   "status": "True"}]}})


def _resource(disaggregation: dict | None, generation: int = 1) -> dict:
    raw = yaml.safe_load(SMOL.read_text())
    raw["metadata"] |= {"namespace": "ml", "uid": "res-1", "generation": generation, "resourceVersion": "1"}
    if disaggregation is not None:
        raw["spec"]["disaggregation"] = disaggregation
    return raw


def _switch(kube: MemoryKube, disaggregation: dict | None) -> None:
    kube.resource["spec"].pop("disaggregation", None)
    if disaggregation is not None:
        kube.resource["spec"]["disaggregation"] = disaggregation
    kube.resource["metadata"]["generation"] += 1


def _reconciler(kube: MemoryKube, pushed: list[tuple[str, SchedulerKnobs]]):
    from chunkpilot.operator.knobs_delivery import one_by_one
    from chunkpilot.operator.reconciler import Reconciler

    class Pusher:
        def for_token(self, token):
            return one_by_one(lambda pod, knobs: pushed.append((pod.name, knobs)) or knobs)
    settings = builders.OperatorSettings(admin_token_key="k")
    return Reconciler(kube, settings, lambda *a: None, pusher=Pusher())


def _children(kube: MemoryKube) -> set[str]:
    return {f"{kind} {name}" for kind, _, name in kube.objects}


AUTO_CHILDREN = {"ConfigMap smollm2-knobs", "Secret smollm2-knobs-token", "Deployment smollm2", "Service smollm2",
                 "Service smollm2-prefill", "PodDisruptionBudget smollm2", "NetworkPolicy smollm2",
                 "ServiceMonitor smollm2"}
ON_SPLIT = {"mode": "on", "prefill": {"replicas": 2, "knobs": {"tokenBudget": 1024, "maxChunk": 512}},
            "decode": {"replicas": 2}}


def test_switching_disaggregation_on_and_off_leaves_exactly_the_objects_of_the_mode():
    kube = MemoryKube(_resource(None))
    pushed: list[tuple[str, SchedulerKnobs]] = []
    r = _reconciler(kube, pushed)
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    today = {"ConfigMap smollm2-knobs", "Secret smollm2-knobs-token", "Deployment smollm2", "Service smollm2",
             "PodDisruptionBudget smollm2", "NetworkPolicy smollm2", "ServiceMonitor smollm2"}
    assert _children(kube) == today
    kube.run_pods()
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert "disaggregation" not in kube.resource["status"] and kube.resource["status"]["readyReplicas"] == 2

    # on: the role Deployments and the prefill Service come, today's Deployment and PDB go
    _switch(kube, ON_SPLIT)
    out = r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    disaggregated = {"ConfigMap smollm2-knobs", "Secret smollm2-knobs-token", "Deployment smollm2-prefill",
                     "Deployment smollm2-decode", "Service smollm2", "Service smollm2-prefill",
                     "PodDisruptionBudget smollm2-prefill", "PodDisruptionBudget smollm2-decode",
                     "NetworkPolicy smollm2", "ServiceMonitor smollm2"}
    assert _children(kube) == disaggregated, out.changes
    assert sorted(kube.deleted) == ["Deployment smollm2", "PodDisruptionBudget smollm2"]
    # created before the old ones were deleted: the new pods start while the old still run
    assert out.changes.index("create Deployment smollm2-decode") < out.changes.index("delete Deployment smollm2")
    assert kube.objects[("Service", "ml", "smollm2")]["spec"]["selector"]["chunkpilot.io/role"] == "decode"
    assert "disaggregation" in kube.resource["status"]

    # the pods of each role are pushed their role's knobs; the status counts each role
    kube.run_pods()
    pushed.clear()
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    generation = kube.resource["metadata"]["generation"]
    assert sorted(pushed) == [("smollm2-decode-0", SchedulerKnobs(128, 64, generation)),
                              ("smollm2-decode-1", SchedulerKnobs(128, 64, generation)),
                              ("smollm2-prefill-0", SchedulerKnobs(1024, 512, generation)),
                              ("smollm2-prefill-1", SchedulerKnobs(1024, 512, generation))]
    status = t.InferenceDeploymentStatus.model_validate(kube.resource["status"])
    assert (status.replicas, status.ready_replicas) == (4, 4)
    d = status.disaggregation
    assert (d.prefill.ready_replicas, d.decode.ready_replicas) == (2, 2)
    assert (d.prefill.knobs.knobs, d.prefill.applied_replicas) == (t.Knobs(1024, 512), 2)
    assert (d.decode.knobs.knobs, d.decode.applied_replicas) == (t.Knobs(128, 64), 2)
    # status.knobs: the decode pods' knobs at its top, every pod with its role
    assert (status.knobs.token_budget, status.knobs.applied_replicas) == (128, 2)
    assert {(p.pod, p.role) for p in status.knobs.pods} == {
        ("smollm2-decode-0", "decode"), ("smollm2-decode-1", "decode"), ("smollm2-prefill-0", "prefill"),
        ("smollm2-prefill-1", "prefill")}
    cond = {c["type"]: c for c in kube.resource["status"]["conditions"]}
    assert cond["Ready"]["status"] == "True" and "prefill: 2/2" in cond["Ready"]["message"]
    pushed.clear()
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert pushed == []  # acknowledged: nothing pushed again

    # auto: one Deployment of both roles' pods in place of the role Deployments (the split: role_split.py)
    kube.deleted.clear()
    _switch(kube, {**ON_SPLIT, "mode": "auto"})
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert _children(kube) == AUTO_CHILDREN
    assert sorted(kube.deleted) == ["Deployment smollm2-decode", "Deployment smollm2-prefill",
                                    "PodDisruptionBudget smollm2-decode", "PodDisruptionBudget smollm2-prefill"]
    assert kube.objects[("Deployment", "ml", "smollm2")]["spec"]["replicas"] == 4

    # off again: today's objects, and nothing of the roles is left
    kube.deleted.clear()
    _switch(kube, {"mode": "off", "prefill": {"replicas": 2}})
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert _children(kube) == today
    assert sorted(kube.deleted) == ["Service smollm2-prefill"]
    assert "disaggregation" not in kube.resource["status"]
    assert kube.objects[("Service", "ml", "smollm2")]["spec"]["selector"] == builders.selector_labels("smollm2")
    # what is applied is exactly what the resource without disaggregation renders (with the hash a pass adds)
    plain = t.InferenceDeployment.model_validate(kube.read_inference_deployment("ml", "smollm2"))
    plain.spec.disaggregation = None
    want = {(o["kind"], o["metadata"]["name"]): o for o in builders.desired_objects(
        plain, builders.OperatorSettings(admin_token_key="k"), service_monitor_crd=True)}
    for (kind, _, name), live in kube.objects.items():
        if kind != "Secret":
            live = copy.deepcopy(live)
            live["metadata"].pop("uid")
            live.pop("status", None)
            assert live == with_hash(want[(kind, name)]), (kind, name)


def test_a_switch_deletes_only_what_is_ours():
    """A Deployment named like a role's that someone else made stays (and the pass says NameConflict when the
    spec wants that name)."""
    kube = MemoryKube(_resource(None))
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "smollm2-decode", "namespace": "ml", "uid": "theirs"},
              "spec": {"replicas": 1}}
    kube.objects[("Deployment", "ml", "smollm2-decode")] = theirs
    r = _reconciler(kube, [])
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert kube.objects[("Deployment", "ml", "smollm2-decode")] == theirs and "Deployment smollm2-decode" not in \
        kube.deleted
    _switch(kube, ON_SPLIT)
    out = r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert out.problem.reason == "NameConflict" and "Deployment smollm2-decode" in out.problem.message
    assert kube.objects[("Deployment", "ml", "smollm2")]  # nothing was changed: today's pods still serve


def test_a_refused_disaggregation_is_an_invalid_spec_with_an_event_and_changes_nothing():
    kube = MemoryKube(_resource(None))
    events: list[tuple[str, str, str]] = []
    from chunkpilot.operator.reconciler import Reconciler

    r = Reconciler(kube, builders.OperatorSettings(admin_token_key="k"),
                   lambda obj, type_, reason, message: events.append((type_, reason, message)),
                   pusher=type("P", (), {"for_token": lambda self, token: (lambda pods, knobs: {})})())
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    before = copy.deepcopy(kube.objects)
    _switch(kube, {"mode": "on"})
    kube.resource["spec"]["engine"]["resources"]["gpus"] = 2
    out = r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert out.problem.reason == "InvalidSpec" and t.DISAGG_TP_RULE_MESSAGE in out.problem.message
    assert kube.objects == before
    degraded = next(c for c in kube.resource["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "tensorParallelSize 1" in degraded["message"]
    assert ("Warning", "InvalidSpec", out.problem.message) in events


def test_auto_splits_its_pods_by_switching_roles_and_the_tuners_knobs_go_to_the_decode_pods_alone():
    """Disaggregation auto: the pods of one Deployment are pushed the role the split gives them with their role's
    knobs, and the pods that acknowledged a new role get its labels (the Services follow); the tuner's knobs and
    threshold go to the decode pods, never to the prefill pods; the tuner's split (status.scheduler.prefillPods)
    moves pods between the roles, no restart, each move an Event."""
    from chunkpilot.operator.knobs_delivery import one_by_one
    from chunkpilot.operator.reconciler import Reconciler

    kube = MemoryKube(_resource({**ON_SPLIT, "mode": "auto"}))
    pushed: list[tuple[str, SchedulerKnobs]] = []
    events: list[str] = []
    refuse: set[str] = set()

    def push(pod, knobs):
        if pod.name in refuse:
            raise PushError("connection refused")
        pushed.append((pod.name, knobs))
        return knobs

    class Pusher:
        def for_token(self, token):
            return one_by_one(push)
    r = Reconciler(kube, builders.OperatorSettings(admin_token_key="k"),
                   lambda raw, type_, reason, message: events.append(f"{reason}: {message}"), pusher=Pusher())
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert _children(kube) == AUTO_CHILDREN
    kube.run_pods()  # four pods, each labelled decode as the template starts them
    kube.resource["status"]["scheduler"] = {"tokenBudget": 256, "maxChunk": 128, "source": "tuner",
                                            "generation": 7, "disaggThreshold": 512}
    pushed.clear()
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    decode, prefill = SchedulerKnobs(256, 128, 7, 512, role="decode"), SchedulerKnobs(1024, 512, 1 + 7, role="prefill")
    # the prefill pods: their role's own knobs, not the tuner's (it measured the decode pods), under the spec's
    # generation, counted past the tuner's
    assert sorted(pushed) == [("smollm2-0", decode), ("smollm2-1", decode), ("smollm2-2", prefill),
                              ("smollm2-3", prefill)]
    assert _roles(kube) == {"smollm2-0": "decode", "smollm2-1": "decode", "smollm2-2": "prefill",
                            "smollm2-3": "prefill"}
    assert [e for e in events if e.startswith("RolesSwitched")] == [
        "RolesSwitched: smollm2-2 decode -> prefill, smollm2-3 decode -> prefill (no restart); the split is "
        "2 prefill : 2 decode pods"]
    status = t.InferenceDeploymentStatus.model_validate(kube.resource["status"])
    assert status.knobs.disagg_threshold == 512 and status.knobs.applied_replicas == 2
    assert {(p.pod, p.role, p.disagg_threshold) for p in status.knobs.pods} == {
        ("smollm2-0", "decode", 512), ("smollm2-1", "decode", 512), ("smollm2-2", "prefill", None),
        ("smollm2-3", "prefill", None)}
    d = status.disaggregation
    assert (d.prefill.replicas, d.prefill.ready_replicas, d.decode.replicas, d.decode.applied_replicas) == (2, 2, 2, 2)
    assert d.decode.knobs.disagg_threshold == 512 and d.prefill.knobs.disagg_threshold is None
    # the tuner's wait: every pod at its role's knobs
    assert status.knobs.applied_everywhere(SchedulerKnobs(256, 128, 7, 512), status.ready_replicas)
    assert '"disagg_threshold": 512' in kube.objects[("ConfigMap", "ml", "smollm2-knobs")]["data"]["knobs.json"]
    assert any("KnobsChanged: token budget 256, max chunk 128, disaggregation threshold 512" in e for e in events), events
    pushed.clear()
    events.clear()
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert pushed == [] and events == []  # acknowledged, roles and all: nothing pushed or moved again

    # the tuner's split: one prefill pod. The last prefill pod by name serves clients again; a pod whose push fails
    # keeps its role and label until a pass reaches it
    kube.resource["status"]["scheduler"] |= {"generation": 8, "prefillPods": 1}
    refuse.add("smollm2-3")
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert _roles(kube)["smollm2-3"] == "prefill"
    refuse.clear()
    pushed.clear()
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert ("smollm2-3", SchedulerKnobs(256, 128, 8, 512, role="decode")) in pushed
    assert _roles(kube) == {"smollm2-0": "decode", "smollm2-1": "decode", "smollm2-2": "prefill",
                            "smollm2-3": "decode"}
    d = t.InferenceDeploymentStatus.model_validate(kube.resource["status"]).disaggregation
    assert (d.prefill.replicas, d.decode.replicas) == (1, 3)
    # 0: colocated, every pod serves clients; the client Service's selector names decode pods, so all of them
    kube.resource["status"]["scheduler"] |= {"generation": 9, "prefillPods": 0}
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert set(_roles(kube).values()) == {"decode"}
    # never: pushed as the engine's integer, shown as never
    kube.resource["status"]["scheduler"] |= {"generation": 10, "disaggThreshold": DISAGG_NEVER}
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert {k.disagg_threshold for name, k in pushed if k.role == "decode"} >= {DISAGG_NEVER}
    assert any("disaggregation threshold never" in e for e in events), events


def _roles(kube: MemoryKube) -> dict[str, str]:
    """Each pod's role, as both its labels say (they must agree)."""
    out = {}
    for p in kube.pods:
        labels = p["metadata"]["labels"]
        assert labels.get("chunkpilot.io/role") == labels.get("llm-d.ai/role"), labels
        out[p["metadata"]["name"]] = labels.get("chunkpilot.io/role")
    return out


def test_routing_without_the_pool_crd_warns_once_says_what_to_install_and_renders_none_of_it():
    from chunkpilot.operator import routing
    from chunkpilot.operator.reconciler import Reconciler

    kube = MemoryKube(_resource(None))
    kube.resource["spec"]["routing"] = {}
    crds = {routing.POOL_CRD: False}
    kube.crd_exists = lambda name: crds.get(name, True)
    events: list[tuple[str, str, str]] = []
    r = Reconciler(kube, builders.OperatorSettings(admin_token_key="k"),
                   lambda obj, type_, reason, message: events.append((type_, reason, message)),
                   pusher=type("P", (), {"for_token": lambda self, token: (lambda pods, knobs: {})})(),
                   crd_cache_seconds=0)
    for _ in range(2):
        r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert [e for e in events if e[1] == "RoutingUnavailable"] == [("Warning", "RoutingUnavailable", routing.NO_POOL_CRD)]
    assert kube.resource["status"]["routing"] == {"message": routing.NO_POOL_CRD}
    assert not [k for k in kube.objects if k[2].endswith("-epp") or k[0] == "InferencePool"]
    # the CRD installed: the pool and its picker come, and status says where to send traffic
    crds[routing.POOL_CRD] = True
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert ("InferencePool", "ml", "smollm2") in kube.objects and ("Deployment", "ml", "smollm2-epp") in kube.objects
    assert kube.resource["status"]["routing"]["inferencePool"] == "smollm2"
    # routing removed: every routing object goes, and status.routing with them
    del kube.resource["spec"]["routing"]
    kube.resource["metadata"]["generation"] += 1
    r.reconcile(kube.read_inference_deployment("ml", "smollm2"))
    assert not [k for k in kube.objects if k[2].endswith("-epp") or k[0] == "InferencePool"]
    assert "routing" not in kube.resource["status"]
