"""`chunkpilot operator run` (real kopf, default settings, as the chart's ServiceAccount with the chart's RBAC)
against a real kube-apiserver + kube-controller-manager + etcd (tests/control_plane.py).

The controller manager is real: it makes ReplicaSets and Pods for our Deployments, writes Deployment status and
garbage-collects. There is no scheduler or kubelet, so Pods stay Pending; where a test needs ready pods it plays
the kubelet by writing pod status itself, and says so. Writes are counted from the API server's audit log."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes.client import ApiException

from ..conftest import service_account_user
from .operator_proc import CHILDREN, Cluster, operator, sample
from ..waiting import consistently, eventually

NS = "op-main"
OPERATOR = service_account_user("operator")


@pytest.fixture(scope="module")
def cluster(control_plane, chart_accounts, tmp_path_factory):
    k = Cluster(control_plane.api())
    k.namespace(NS)
    # the images these tests roll to, allowed as a cluster admin would (operator/policy.py)
    with operator(chart_accounts["operator"], tmp_path_factory.mktemp("operator"),
                  "--allowed-image-prefix", "registry.example/", "--allowed-image-prefix", "x:") as op:
        yield control_plane, k, op
        assert op.alive(), f"the operator died on user input:\n{op.log()}"
        assert op.stop() == 0, op.log()
    assert k.delete_namespace(NS)


def message(e: ApiException) -> str:
    return json.loads(e.body)["message"]


def child(plural: str, name: str) -> str:
    return f"{name}-knobs" if plural == "configmaps" else name


def operator_writes(cp, since: int, resource: str, name: str | None = None) -> list[dict]:
    return cp.writes(cp.audit(OPERATOR, since), resource, name)


def test_create_renders_every_object_with_owner_references(cluster):
    cp, k, op = cluster
    owner = k.create(sample("alpha", NS))
    assert eventually(lambda: k.children_exist(NS, "alpha")), op.log()
    for plural in CHILDREN:
        obj = k.get(plural, NS, "alpha" if plural != "configmaps" else "alpha-knobs")
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceDeployment", "alpha", owner["metadata"]["uid"], True)
    assert k.knobs(NS, "alpha") == {"token_budget": 128, "max_chunk": 64, "generation": 1}
    # The real Deployment controller made a ReplicaSet and two (Pending) pods, and wrote Deployment status.
    assert eventually(lambda: k.cond(NS, "alpha", "Ready").get("reason") == "ReplicasNotReady")
    assert eventually(lambda: k.status(NS, "alpha").get("replicas") == 2), k.status(NS, "alpha")
    status = k.status(NS, "alpha")
    # what the operator delivered (no pod is ready here: none acknowledged); status.scheduler is the tuner's alone
    assert status["knobs"] == {"tokenBudget": 128, "maxChunk": 64, "source": "spec", "generation": 1,
                               "appliedReplicas": 0, "pods": []}
    assert "scheduler" not in status
    assert status["observedGeneration"] == 1 and "app.kubernetes.io/instance=alpha" in status["selector"]
    assert eventually(lambda: ("Normal", "Created", "created Deployment alpha") in k.events(NS, "alpha"))
    # The sample asks for a ServiceMonitor; this cluster has no Prometheus Operator CRD: a Warning, no object.
    assert any(r == "ServiceMonitorUnavailable" for _, r, _ in k.events(NS, "alpha"))

    # Level-triggered and idempotent: another pass (triggered by an unrelated label) writes nothing to children.
    mark = cp.audit_mark()
    k.patch("alpha", {"metadata": {"labels": {"team": "search"}}}, NS)
    def pdb_reads() -> int:  # each pass reads the children, the PDB last, before it writes anything
        return sum(1 for e in cp.audit(OPERATOR, mark) if e["verb"] == "get" and e["objectRef"].get("name") == "alpha"
                   and e["objectRef"].get("resource") == "poddisruptionbudgets")
    # the pass the label triggered has read the children ...
    assert eventually(lambda: pdb_reads() >= 1)
    # ... and has ended once the next pass reads them (one pass at a time per object): no write in between
    k.patch("alpha", {"metadata": {"labels": {"team": "ranking"}}}, NS)
    consistently(lambda: [len(operator_writes(cp, mark, p, child(p, "alpha"))) for p in CHILDREN] == [0, 0, 0, 0],
                 until=lambda: pdb_reads() >= 2, timeout=30, poll=0.2, what="no writes to unchanged children")


def test_knob_change_updates_only_the_configmap(cluster):
    cp, k, op = cluster
    k.create(sample("beta", NS))
    assert eventually(lambda: k.children_exist(NS, "beta"))
    assert eventually(lambda: len(replicasets(k, "beta")) == 1)
    template = k.get("deployments", NS, "beta")["spec"]["template"]
    before = replicasets(k, "beta")
    mark = cp.audit_mark()
    k.patch("beta", {"spec": {"scheduler": {"tokenBudget": 256, "maxChunk": 32}}}, NS)
    assert eventually(lambda: k.knobs(NS, "beta") == {"token_budget": 256, "max_chunk": 32, "generation": 2})
    # the pass is complete once status records the knobs (it is written after the ConfigMap: absent until then)
    assert eventually(lambda: (k.status(NS, "beta").get("knobs") or {}).get("generation") == 2)
    assert len(operator_writes(cp, mark, "configmaps", "beta-knobs")) == 1
    assert [operator_writes(cp, mark, p, "beta") for p in CHILDREN if p != "configmaps"] == [[], [], []], \
        "a knob change must write only the ConfigMap"
    assert k.get("deployments", NS, "beta")["spec"]["template"] == template
    assert replicasets(k, "beta") == before  # no rollout: the pods apply the file in place
    assert eventually(lambda: any(r == "KnobsChanged" and "generation 2" in m for _, r, m in k.events(NS, "beta")))


def test_tuner_knobs_in_status_reach_the_configmap_and_are_kept(cluster):
    cp, k, op = cluster
    k.create(sample("gamma", NS))  # the sample has tuning.mode: auto
    assert eventually(lambda: k.children_exist(NS, "gamma"))
    tuned = {"tokenBudget": 96, "maxChunk": 48, "source": "tuner", "generation": 5}
    k.patch("gamma", {"status": {"scheduler": tuned}}, NS, status=True)
    assert eventually(lambda: k.knobs(NS, "gamma") == {"token_budget": 96, "max_chunk": 48, "generation": 5})
    # the pass that wrote the ConfigMap writes status next: the tuner's field must survive it
    consistently(lambda: k.status(NS, "gamma")["scheduler"] == tuned,
                 until=lambda: (k.status(NS, "gamma").get("knobs") or {}).get("source") == "tuner", timeout=30,
                 poll=0.1,
                 what="the tuner's status.scheduler")
    # Tuning switched off: the spec's knobs come back with a newer generation (metadata.generation 2 + the tuner's
    # 5), so an acknowledgement of the tuner's never passes for them; the tuner's status.scheduler stays as written.
    k.patch("gamma", {"spec": {"tuning": {"mode": "off"}}}, NS)
    assert eventually(lambda: k.knobs(NS, "gamma") == {"token_budget": 128, "max_chunk": 64, "generation": 7})
    assert k.status(NS, "gamma")["scheduler"] == tuned


def test_scaling_to_one_replica_removes_the_pdb(cluster):
    cp, k, op = cluster
    k.create(sample("eta", NS))
    assert eventually(lambda: k.children_exist(NS, "eta"))
    k.patch("eta", {"spec": {"replicas": 1}}, NS)
    assert eventually(lambda: k.get("poddisruptionbudgets", NS, "eta") is None)
    assert k.get("deployments", NS, "eta")["spec"]["replicas"] == 1
    k.patch("eta", {"spec": {"replicas": 3}}, NS)
    assert eventually(lambda: k.get("poddisruptionbudgets", NS, "eta") is not None)


def test_an_hpa_on_the_child_deployment_owns_its_replicas(cluster):
    """Review: an HPA that targets the Deployment (not the InferenceDeployment) was not detected, and every pass
    re-applied spec.replicas against it. Here the real HPA controller (kube-controller-manager: no metrics, so it
    only enforces its minReplicas 3) scales the Deployment to 3; the operator leaves that count alone through
    later passes, says where the HPA should point, and the status follows the Deployment."""
    import kubernetes

    cp, k, op = cluster
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "scaled-child-hpa", "namespace": NS},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scaled-child"},
                    "minReplicas": 3, "maxReplicas": 5,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 80}}}]}}
    kubernetes.client.AutoscalingV2Api(k.api).create_namespaced_horizontal_pod_autoscaler(NS, hpa)
    k.create(sample("scaled-child", NS, replicas=2))
    assert eventually(lambda: k.children_exist(NS, "scaled-child"))
    assert eventually(lambda: k.get("deployments", NS, "scaled-child")["spec"]["replicas"] == 3, 90), \
        "the HPA controller did not enforce its minReplicas"
    k.patch("scaled-child", {"metadata": {"labels": {"poke": "1"}}}, NS)  # a pass
    assert eventually(lambda: any(r == "DeploymentAutoscaled" and "scaled-child-hpa" in m
                                  for _, r, m in k.events(NS, "scaled-child"))), op.log()
    def settled() -> bool:  # the pass that posted the Event applies the deferred count right after it
        m = cp.audit_mark()
        time.sleep(2)
        return operator_writes(cp, m, "deployments", "scaled-child") == []
    assert eventually(settled)
    mark = cp.audit_mark()
    k.patch("scaled-child", {"spec": {"scheduler": {"tokenBudget": 256, "maxChunk": 64}}}, NS)  # a pass that writes
    assert eventually(lambda: k.knobs(NS, "scaled-child")["token_budget"] == 256)
    assert eventually(lambda: k.status(NS, "scaled-child")["knobs"]["tokenBudget"] == 256)  # the pass is complete
    writes = operator_writes(cp, mark, "deployments", "scaled-child")
    assert writes == [], ("the operator fought the HPA over replicas", [(w["verb"], w.get("requestURI")) for w in writes], op.log()[-3000:])
    assert k.get("deployments", NS, "scaled-child")["spec"]["replicas"] == 3


def test_image_change_rolls_the_deployment(cluster):
    cp, k, op = cluster
    k.create(sample("delta", NS, replicas=1))
    assert eventually(lambda: k.children_exist(NS, "delta") or k.get("deployments", NS, "delta") is not None)
    before = k.get("deployments", NS, "delta")["spec"]["template"]
    assert eventually(lambda: len(replicasets(k, "delta")) == 1)
    k.patch("delta", {"spec": {"engine": {"image": "registry.example/engine:2"}}}, NS)

    def rolled():
        t = k.get("deployments", NS, "delta")["spec"]["template"]
        return t["spec"]["containers"][0]["image"] == "registry.example/engine:2"
    assert eventually(rolled)
    after = k.get("deployments", NS, "delta")["spec"]["template"]
    key = "chunkpilot.io/config-hash"
    assert after["metadata"]["annotations"][key] != before["metadata"]["annotations"][key]
    assert eventually(lambda: len(replicasets(k, "delta")) == 2), "the real Deployment controller starts a new one"
    assert eventually(lambda: any(r == "RollingUpdate" for _, r, _ in k.events(NS, "delta")))
    knobs = k.knobs(NS, "delta")  # the knobs did not move (a spec edit gives them a newer generation, no more)
    assert (knobs["token_budget"], knobs["max_chunk"]) == (128, 64)


def replicasets(k: Cluster, instance: str) -> set[str]:
    items = k.apps.list_namespaced_replica_set(NS, label_selector=f"app.kubernetes.io/instance={instance}").items
    return {rs.metadata.name for rs in items}


def play_kubelet(k: Cluster, namespace: str, instance: str) -> int:
    """No kubelet here: mark the instance's pods Running and Ready ourselves, as a kubelet would; how many it marked
    (a pod a ReplicaSet deleted between the list and the patch is not counted: the caller asks again)."""
    pods = k.core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={instance}").items
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    marked = 0
    for pod in pods:
        try:
            k.core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {
                "phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now},
                                                   {"type": "ContainersReady", "status": "True",
                                                    "lastTransitionTime": now}]}})
            marked += 1
        except ApiException as e:
            if e.status != 404:
                raise
    return marked


def test_deployment_status_drives_the_conditions(cluster):
    cp, k, op = cluster
    k.create(sample("epsilon", NS))
    assert eventually(lambda: k.children_exist(NS, "epsilon"))
    assert eventually(lambda: play_kubelet(k, NS, "epsilon") == 2), "the ReplicaSet controller makes 2 pods"
    # The real ReplicaSet and Deployment controllers see ready pods; the operator's conditions follow.
    assert eventually(lambda: k.cond(NS, "epsilon", "Ready").get("status") == "True", 60), k.status(NS, "epsilon")
    assert eventually(lambda: k.cond(NS, "epsilon", "Progressing").get("reason") == "RolloutComplete")
    assert k.status(NS, "epsilon")["readyReplicas"] == 2

    # A rollout that cannot finish: its pods never get ready. A short progress deadline (a field the operator
    # does not set, so it stays the user's) lets the real Deployment controller declare it failed.
    k.apps.patch_namespaced_deployment("epsilon", NS, {"spec": {"progressDeadlineSeconds": 2}},
                                       field_manager="sre")
    k.patch("epsilon", {"spec": {"engine": {"image": "registry.example/engine:broken"}}}, NS)
    assert eventually(lambda: k.cond(NS, "epsilon", "Degraded").get("reason") == "RolloutFailed", 60), \
        k.status(NS, "epsilon")
    assert "progress" in k.cond(NS, "epsilon", "Degraded")["message"]
    assert k.get("deployments", NS, "epsilon")["spec"]["progressDeadlineSeconds"] == 2


@pytest.mark.parametrize("name, override, reason, words", [
    ("bad-budget", {"engine__maxNumSeqs": 300}, "InvalidSpec", "spec.scheduler.tokenBudget"),
    ("no-slo", {"slo": {}}, "InvalidSpec", "spec.slo"),
    ("no-claim", {"model__source": "pvc://no-such-claim/smollm2"}, "MissingVolume", "no-such-claim"),
    # the admin's policy (operator/policy.py): by default no host path may be mounted
    ("host-etc", {"model__source": "hostpath:///etc"}, "NotAllowed", "host path /etc is not allowed"),
    ("any-taint", {"engine__tolerations": [{"operator": "Exists"}]}, "NotAllowed", "tolerates every taint"),
    # the platform's API key cannot be switched off from a spec
    ("key-off", {"engine__extraArgs": ["--api-key="]}, "InvalidSpec", "extraArgs[0]"),
    ("key-env", {"engine__env": [{"name": "CHUNKPILOT_API_KEY", "value": ""}]}, "InvalidSpec", "CHUNKPILOT_"),
])
def test_invalid_spec_degrades_with_a_warning_and_creates_nothing(cluster, name, override, reason, words):
    """Specs the CRD's schema and CEL admit but the operator cannot serve (admission itself is tested below)."""
    cp, k, op = cluster
    mark = cp.audit_mark()
    k.create(sample(name, NS, **override))
    assert eventually(lambda: k.cond(NS, name, "Degraded").get("status") == "True"), op.log()
    assert k.cond(NS, name, "Degraded")["reason"] == reason and words in k.cond(NS, name, "Degraded")["message"]

    def warnings():
        return [m for t, r, m in k.events(NS, name) if t == "Warning" and r == reason]

    def passes() -> int:  # each pass starts with a fresh read of the object
        return sum(1 for e in cp.audit(OPERATOR, mark) if e["verb"] == "get" and e["objectRef"].get("name") == name
                   and e["objectRef"].get("resource") == "inferencedeployments")
    assert eventually(warnings)
    # The pass that wrote Degraded triggers another, and so does a label: they must not warn again. A pass has
    # ended once the next one has read the object (one pass at a time per object).
    n = passes()
    k.patch(name, {"metadata": {"labels": {"poke": "1"}}}, NS)
    assert eventually(lambda: passes() >= n + 1)
    k.patch(name, {"metadata": {"labels": {"poke": "2"}}}, NS)
    consistently(lambda: len(warnings()) == 1, until=lambda: passes() >= n + 2, timeout=30, poll=0.2,
                 what="one Warning while the problem lasts")
    assert words in warnings()[0]
    assert all(k.get(p, NS, n) is None for p, n in
               [("deployments", name), ("services", name), ("configmaps", f"{name}-knobs")])
    assert op.alive()


def test_objects_with_our_names_that_are_not_ours_are_left_alone(cluster):
    """A ConfigMap someone else made, named like our knobs ConfigMap: applying over it would make it ours, and
    deleting the InferenceDeployment would then garbage-collect it."""
    cp, k, op = cluster
    k.core.create_namespaced_config_map(NS, {"metadata": {"name": "kappa-knobs"}, "data": {"theirs": "1"}})
    k.create(sample("kappa", NS))
    assert eventually(lambda: k.cond(NS, "kappa", "Degraded").get("reason") == "NameConflict"), op.log()
    assert "ConfigMap kappa-knobs" in k.cond(NS, "kappa", "Degraded")["message"]
    assert eventually(lambda: [m for t, r, m in k.events(NS, "kappa") if t == "Warning" and r == "NameConflict"])
    victim = k.get("configmaps", NS, "kappa-knobs")
    assert victim["data"] == {"theirs": "1"} and not victim["metadata"].get("ownerReferences")
    assert k.get("deployments", NS, "kappa") is None and k.get("services", NS, "kappa") is None  # nothing half-made
    # a ConfigMap that is the resource's: when the garbage collector has taken it, it has looked at kappa's
    uid = k.get("inferencedeployments", NS, "kappa")["metadata"]["uid"]
    k.core.create_namespaced_config_map(NS, {"metadata": {"name": "kappa-sentinel", "ownerReferences": [
        {"apiVersion": "chunkpilot.io/v1alpha1", "kind": "InferenceDeployment", "name": "kappa", "uid": uid}]}})
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", "kappa")
    assert eventually(lambda: k.get("inferencedeployments", NS, "kappa") is None)
    consistently(lambda: k.get("configmaps", NS, "kappa-knobs")["data"] == {"theirs": "1"},
                 until=lambda: k.get("configmaps", NS, "kappa-sentinel") is None, timeout=60, poll=0.2,
                 what="someone else's ConfigMap surviving the garbage collector")
    k.core.delete_namespaced_config_map("kappa-knobs", NS)


def test_a_bad_update_leaves_the_running_objects_alone(cluster):
    cp, k, op = cluster
    k.create(sample("zeta", NS))
    assert eventually(lambda: k.children_exist(NS, "zeta"))
    time.sleep(1.0)  # let the passes the Deployment controller's status writes trigger settle
    mark = cp.audit_mark()
    # A valid image change together with an invalid knob: nothing may be applied, not even the image.
    k.patch("zeta", {"spec": {"engine": {"image": "x:2", "maxNumSeqs": 200}}}, NS)
    assert eventually(lambda: k.cond(NS, "zeta", "Degraded").get("reason") == "InvalidSpec")
    assert [len(operator_writes(cp, mark, p, child(p, "zeta"))) for p in CHILDREN] == [0, 0, 0, 0]
    k.patch("zeta", {"spec": {"engine": {"maxNumSeqs": 8}}}, NS)  # fixed: applied, condition clears
    assert eventually(lambda: k.cond(NS, "zeta", "Degraded").get("status") == "False")
    assert eventually(lambda: k.get("deployments", NS, "zeta")["spec"]["template"]["spec"]["containers"][0]["image"]
                      == "x:2")


def test_a_person_editing_a_managed_field_is_put_right_and_keeps_their_own_fields(cluster):
    """Server-side apply field ownership: the operator's force-apply takes back the fields it sets (a person's
    edit of one shows as drift and is reverted); fields only the person set stay theirs."""
    cp, k, op = cluster
    k.create(sample("iota", NS))
    assert eventually(lambda: k.children_exist(NS, "iota"))
    k.core.patch_namespaced_service("iota", NS, {"metadata": {"labels": {"owner": "sre"}},
                                                 "spec": {"sessionAffinity": "ClientIP"}}, field_manager="kubectl-edit")
    svc = k.get("services", NS, "iota")
    managers = {m["manager"] for m in svc["metadata"]["managedFields"]}
    assert {"chunkpilot-operator", "kubectl-edit"} <= managers
    # A managed field edited: the target port the operator set (ports merge by their port number).
    want = svc["spec"]["ports"][0]["targetPort"]
    k.core.patch_namespaced_service("iota", NS, {"spec": {"ports": [{"port": svc["spec"]["ports"][0]["port"],
                                                                     "targetPort": 9999}]}},
                                    field_manager="kubectl-edit")
    assert k.get("services", NS, "iota")["spec"]["ports"][0]["targetPort"] == 9999
    k.patch("iota", {"metadata": {"labels": {"poke": "1"}}}, NS)  # any trigger: the next pass sees the drift
    assert eventually(lambda: k.get("services", NS, "iota")["spec"]["ports"][0]["targetPort"] == want), op.log()
    svc = k.get("services", NS, "iota")
    assert svc["metadata"]["labels"]["owner"] == "sre" and svc["spec"]["sessionAffinity"] == "ClientIP"
    owned = next(m for m in svc["metadata"]["managedFields"] if m["manager"] == "chunkpilot-operator")
    assert "f:ports" in str(owned["fieldsV1"])


def test_deleting_an_inference_deployment_garbage_collects_its_objects(cluster):
    cp, k, op = cluster
    k.create(sample("theta", NS))
    assert eventually(lambda: k.children_exist(NS, "theta"))
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", "theta")
    # The real garbage collector follows the owner references; the operator deletes nothing itself.
    assert eventually(lambda: all(k.get(p, NS, "theta-knobs" if p == "configmaps" else "theta") is None
                                  for p in CHILDREN), 60)
    assert eventually(lambda: not k.core.list_namespaced_pod(
        NS, label_selector="app.kubernetes.io/instance=theta").items, 60)


def test_admission_defaults_cel_and_pruning(cluster):
    """What the real API server does with the CRD before the operator sees anything."""
    cp, k, op = cluster
    minimal = {"apiVersion": "chunkpilot.io/v1alpha1", "kind": "InferenceDeployment",
               "metadata": {"name": "kappa", "namespace": NS},
               "spec": {"model": {"source": "image:///models/m"}, "unknownField": 1,
                        "scheduler": {"tokenBudget": 256, "maxChunk": 64, "surprise": True}}}
    made = k.create(minimal)
    assert "unknownField" not in made["spec"] and "surprise" not in made["spec"]["scheduler"]  # pruned
    assert made["spec"]["replicas"] == 1 and made["spec"]["tuning"]["mode"] == "off"  # schema defaults
    with pytest.raises(ApiException) as bad:
        k.create(sample("lambda", NS, scheduler={"tokenBudget": 64, "maxChunk": 128}))
    assert bad.value.status == 422 and "maxChunk must be <= tokenBudget" in message(bad.value)
    with pytest.raises(ApiException) as bad:
        k.create(sample("mu", NS, model__source="s3://bucket/model"))
    assert bad.value.status == 422 and "spec.model.source" in message(bad.value)
    with pytest.raises(ApiException) as bad:  # 4 GPUs cannot be split into ranks of 3
        k.create(sample("xi", NS, engine__resources={"gpus": 4}, engine__tensorParallelSize=3))
    assert bad.value.status == 422 and "divide evenly by tensorParallelSize" in message(bad.value)
    split = k.create(sample("omicron", NS, engine__resources={"gpus": 4}, engine__tensorParallelSize=2))
    assert split["spec"]["engine"]["tensorParallelSize"] == 2
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", "omicron")
    k.create(sample("pi", NS, engine__tensorParallelSize=None))  # null: the default (the GPU count)
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", "pi")
    with pytest.raises(ApiException) as bad:  # CEL on update too
        k.patch("kappa", {"spec": {"scheduler": {"maxChunk": 512}}}, NS)
    assert bad.value.status == 422 and "maxChunk must be <= tokenBudget" in message(bad.value)
    assert eventually(lambda: k.get("deployments", NS, "kappa") is not None), k.status(NS, "kappa")


def test_status_is_a_subresource_with_optimistic_concurrency(cluster):
    cp, k, op = cluster
    made = k.create(sample("nu", NS))
    # status sent with the main resource is ignored; spec sent to /status is ignored
    k.patch("nu", {"status": {"replicas": 42}, "metadata": {"labels": {"x": "y"}}}, NS)
    assert k.status(NS, "nu").get("replicas") != 42
    k.patch("nu", {"spec": {"replicas": 7}, "status": {"slo": {"windowSeconds": 60}}}, NS, status=True)
    got = k.get("inferencedeployments", NS, "nu")
    assert got["spec"]["replicas"] == 2 and got["status"]["slo"] == {"windowSeconds": 60}
    with pytest.raises(ApiException) as stale:
        k.patch("nu", {"metadata": {"resourceVersion": made["metadata"]["resourceVersion"]},
                       "status": {"slo": {"windowSeconds": 30}}}, NS, status=True)
    assert stale.value.status == 409


def test_a_deleted_token_secret_is_back_at_the_next_pass(cluster):
    """The admin token's Secret (never read back: the operator has no right to read Secrets) is applied at every
    pass, not once per process: deleted, it would otherwise stay gone until the operator restarted, and new engine
    pods would hang in ContainerCreating (FailedMount) meanwhile."""
    cp, k, op = cluster
    k.create(sample("lambda", NS))
    assert eventually(lambda: k.children_exist(NS, "lambda"))
    assert eventually(lambda: k.get("secrets", NS, "lambda-knobs-token") is not None)
    k.core.delete_namespaced_secret("lambda-knobs-token", NS)
    k.patch("lambda", {"metadata": {"labels": {"poke": "1"}}}, NS)  # any pass; a resync would do it too
    assert eventually(lambda: k.get("secrets", NS, "lambda-knobs-token") is not None), op.log()
    secret = k.get("secrets", NS, "lambda-knobs-token")
    assert secret["data"]["token"] and secret["metadata"]["ownerReferences"][0]["name"] == "lambda"


def printed_columns(k: Cluster, name: str) -> dict[str, object]:
    """What `kubectl get infd NAME` prints: the API server's Table of the resource (its printer columns)."""
    resp = k.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", name,
                                                 _preload_content=False,
                                                 _headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    table = json.loads(resp.data)
    return dict(zip([c["name"] for c in table["columnDefinitions"]], table["rows"][0]["cells"]))


def test_disaggregation_is_admitted_with_its_defaults_and_refused_with_what_to_change(cluster):
    """The CRD's schema defaults and CEL rules on the real API server (the table of specs goes through it too:
    tests/chart/test_admission_policy.py)."""
    from chunkpilot.api.types import DISAGG_DRAFT_RULE_MESSAGE, DISAGG_REPLICAS_RULE_MESSAGE, DISAGG_TP_RULE_MESSAGE

    cp, k, op = cluster
    made = k.create(sample("sigma", NS, disaggregation={"mode": "on"}))
    assert made["spec"]["disaggregation"] == {"mode": "on", "threshold": 256, "transport": "nixl",
                                              "leaseSeconds": 10, "prefill": {"replicas": 1},
                                              "decode": {"replicas": 1}}
    assert "disaggregation" not in k.create(sample("tau", NS))["spec"]  # absent stays absent: off
    for c in ("sigma", "tau"):
        k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", c)
    for i, (override, words) in enumerate([
            ({"engine__resources": {"gpus": 2}, "engine__tensorParallelSize": 2}, DISAGG_TP_RULE_MESSAGE),
            ({"engine__speculative": {"method": "draft_model", "draftModel": "pvc://drafts/small"}},
             DISAGG_DRAFT_RULE_MESSAGE),
            ({"disaggregation": {"mode": "on", "decode": {"replicas": 0}}}, DISAGG_REPLICAS_RULE_MESSAGE),
            # a bare `mode: on` in YAML, as kubectl (YAML 1.1) reads it
            ({"disaggregation": {"mode": True}}, "spec.disaggregation.mode")]):
        body = sample(f"upsilon-{i}", NS, **{"disaggregation": {"mode": "on"}, **override})
        with pytest.raises(ApiException) as bad:
            k.create(body)
        assert bad.value.status == 422 and words in message(bad.value), message(bad.value)


def test_disaggregation_switched_on_and_off_leaves_no_orphans(cluster):
    """off -> on: a Deployment per role, the prefill pods' headless Service, the client Service on the decode pods,
    and today's Deployment gone; the status counts each role (printer columns Prefill and Decode); on -> off:
    today's objects back and the roles' gone. The real Deployment and ReplicaSet controllers make the pods and the
    garbage collector removes the pods of a deleted Deployment."""
    cp, k, op = cluster
    k.create(sample("phi", NS))
    assert eventually(lambda: k.children_exist(NS, "phi"))
    k.patch("phi", {"spec": {"disaggregation": {"mode": "on", "prefill": {"replicas": 1},
                                                "decode": {"replicas": 2}}}}, NS)
    assert eventually(lambda: k.get("deployments", NS, "phi") is None
                      and k.get("poddisruptionbudgets", NS, "phi") is None  # pruned last
                      and k.get("deployments", NS, "phi-prefill") is not None
                      and k.get("deployments", NS, "phi-decode") is not None), op.log()
    headless = k.get("services", NS, "phi-prefill")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["chunkpilot.io/role"] == "prefill"
    assert k.get("services", NS, "phi")["spec"]["selector"]["chunkpilot.io/role"] == "decode"
    assert k.get("poddisruptionbudgets", NS, "phi-decode") is not None  # 2 decode pods; 1 prefill pod: none
    decode = k.get("deployments", NS, "phi-decode")["spec"]["template"]
    env = {e["name"]: e.get("value") for e in decode["spec"]["containers"][0]["env"]}
    assert env["CHUNKPILOT_PREFILL_PEERS"] == f"phi-prefill.{NS}.svc:8000" and env["UCX_TLS"] == "tcp,self"
    assert decode["metadata"]["labels"]["llm-d.ai/role"] == "decode"
    assert eventually(lambda: play_kubelet(k, NS, "phi") == 3 and k.get("deployments", NS, "phi") is None)

    def counted() -> bool:
        d = k.status(NS, "phi").get("disaggregation") or {}
        return (d.get("prefill", {}).get("readyReplicas"), d.get("decode", {}).get("readyReplicas")) == (1, 2)
    assert eventually(counted, 60), k.status(NS, "phi")
    assert eventually(lambda: k.cond(NS, "phi", "Ready").get("status") == "True"), k.status(NS, "phi")
    assert k.status(NS, "phi")["readyReplicas"] == 3
    columns = printed_columns(k, "phi")
    assert (columns["Prefill"], columns["Decode"], columns["Ready"]) == (1, 2, 3)

    k.patch("phi", {"spec": {"disaggregation": {"mode": "off"}}}, NS)
    assert eventually(lambda: k.get("deployments", NS, "phi") is not None
                      and k.get("deployments", NS, "phi-prefill") is None
                      and k.get("deployments", NS, "phi-decode") is None
                      and k.get("services", NS, "phi-prefill") is None
                      and k.get("poddisruptionbudgets", NS, "phi-decode") is None), op.log()
    assert "chunkpilot.io/role" not in k.get("services", NS, "phi")["spec"]["selector"]
    assert eventually(lambda: "disaggregation" not in k.status(NS, "phi"))
    # the garbage collector takes the role pods with their Deployments: only today's pods are left
    assert eventually(lambda: {p.metadata.labels.get("chunkpilot.io/role") for p in k.core.list_namespaced_pod(
        NS, label_selector="app.kubernetes.io/instance=phi").items} == {None}, 60)
    assert printed_columns(k, "phi")["Prefill"] is None
