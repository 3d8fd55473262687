"""Knobs delivery, pure parts: which pods get a push, what is recorded as their acknowledgement, and the objects
that make the push possible (the token Secret, the admin port, the NetworkPolicy that admits the operator alone)."""

from __future__ import annotations

import base64

from chunkpilot.api.types import KnobsStatus, PodKnobs
from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.operator import builders as b
from chunkpilot.operator.knobs_delivery import PushError, ReadyPod, deliver, ready_pods

from .test_crd_and_builders import SMOL, load

WANT = SchedulerKnobs(96, 32, 7)


def pod(name, ready=True, ip="10.0.0.1", started="t0", deleting=False):
    return {"metadata": {"name": name, **({"deletionTimestamp": "x"} if deleting else {})},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "engine", "state": {"running": {"startedAt": started}}}]}}


def test_only_ready_serving_pods_are_pushed_to():
    pods = ready_pods([pod("b"), pod("a"), pod("c", ready=False), pod("d", deleting=True), pod("e", ip="")])
    assert [p.name for p in pods] == ["a", "b"] and pods[0].started == "t0"


def test_a_push_goes_only_where_the_acknowledgement_differs_and_failures_are_reported():
    pushed = []

    def push(p, knobs):
        pushed.append(p.name)
        if p.name == "c":
            raise PushError("HTTP 401: a valid bearer token is required")
        return knobs
    before = KnobsStatus(tokenBudget=96, maxChunk=32, generation=7, source="tuner", pods=[
        PodKnobs(pod="a", started="t0", tokenBudget=96, maxChunk=32, generation=7),  # acked: no push
        PodKnobs(pod="b", started="t0", tokenBudget=64, maxChunk=32, generation=6)])  # older: pushed
    pods = [ReadyPod("a", "1", "t0"), ReadyPod("b", "2", "t0"), ReadyPod("c", "3", "t0")]
    status, failures = deliver(before, WANT, "tuner", pods, push)
    assert pushed == ["b", "c"] and failures == ["c: HTTP 401: a valid bearer token is required"]
    assert [p.pod for p in status.pods] == ["a", "b"] and status.applied_replicas == 2
    assert not status.applied_everywhere(WANT, ready_replicas=3)  # c has not acknowledged
    assert status.applied_everywhere(WANT, ready_replicas=2)
    assert not status.applied_everywhere(SchedulerKnobs(96, 32, 8), ready_replicas=2)  # exact generation only


def test_a_restarted_container_is_pushed_again():
    """Its ConfigMap volume may hold an older copy than the knobs it had acknowledged before the restart."""
    before = KnobsStatus(tokenBudget=96, maxChunk=32, generation=7, pods=[
        PodKnobs(pod="a", started="t0", tokenBudget=96, maxChunk=32, generation=7)])
    pushed = []
    deliver(before, WANT, "tuner", [ReadyPod("a", "1", "t1")], lambda p, k: pushed.append(p.name) or k)
    assert pushed == ["a"]


def test_the_admin_port_is_token_guarded_and_admitted_from_the_operator_pods_alone():
    obj = load(SMOL)
    settings = b.OperatorSettings(admin_token_key="k1", operator_namespace="chunkpilot-system",
                                  operator_pod_labels=(("app.kubernetes.io/component", "operator"),))
    secret = b.admin_token_secret(obj, settings)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert token == b.admin_token(obj, settings) != b.admin_token(obj, b.OperatorSettings(admin_token_key="k2"))
    assert secret["metadata"]["ownerReferences"][0]["uid"] == obj.metadata["uid"]
    pod_spec = b.deployment(obj, settings)["spec"]["template"]["spec"]
    c = pod_spec["containers"][0]
    assert {"name": "admin", "containerPort": b.ADMIN_PORT, "protocol": "TCP"} in c["ports"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CHUNKPILOT_ADMIN_TOKEN_FILE"] == f"{b.ADMIN_TOKEN_DIR}/token"
    assert {"name": "admin-token", "secret": {"secretName": secret["metadata"]["name"], "defaultMode": 0o440}} in \
        pod_spec["volumes"]
    rules = b.network_policy(obj, settings)["spec"]["ingress"]
    admin = [r for r in rules if r["ports"] == [{"port": "admin", "protocol": "TCP"}]]
    assert admin == [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "chunkpilot-system"}},
                                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}],
                      "ports": [{"port": "admin", "protocol": "TCP"}]}]
    # an operator outside the cluster: nobody is admitted to the admin port (a rule without `from` admits all)
    outside = b.network_policy(obj, b.OperatorSettings())["spec"]["ingress"]
    assert all(r["ports"] != [{"port": "admin", "protocol": "TCP"}] for r in outside)
    # the token stays out of the pod template: rotating the key never restarts pods
    assert b.deployment(obj, settings) == b.deployment(obj, b.OperatorSettings(
        admin_token_key="k2", operator_namespace="chunkpilot-system",
        operator_pod_labels=(("app.kubernetes.io/component", "operator"),)))
