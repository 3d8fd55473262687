"""The chart's ValidatingAdmissionPolicy on the real API server (tests/control_plane.py): the operator's policy
enforced at admission, so `kubectl apply` of a spec the operator would refuse fails at once with the rule's
message. The binding is narrowed to this test's namespace: other tests share the API server."""

from __future__ import annotations

import subprocess

import kubernetes
import pytest
import yaml

from ..engine.server_proc import wait_for
from ..operator.admission_cases import CASES, HELM_SETS
from ..operator.operator_proc import Cluster, sample
from .test_chart import CHART, REPOSITORY, helm

NS = "vap"


@pytest.fixture
def policy(control_plane):
    text = subprocess.run(
        [helm(), "template", "cp", str(CHART), "--kube-version", "1.34.4", "--show-only",
         "templates/admission-policy.yaml", *HELM_SETS],
        capture_output=True, text=True, check=True).stdout
    vap, binding = [d for d in yaml.safe_load_all(text) if d]
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}}}
    adm = kubernetes.client.AdmissionregistrationV1Api(control_plane.api())
    adm.create_validating_admission_policy(vap)
    adm.create_validating_admission_policy_binding(binding)
    k = Cluster(control_plane.api())
    k.namespace(NS)
    try:
        yield k, adm, vap["metadata"]["name"]
    finally:
        adm.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        adm.delete_validating_admission_policy(vap["metadata"]["name"])
        assert k.delete_namespace(NS)


def refusal(k: Cluster, body: dict) -> str | None:
    """None when admitted (the object is deleted again), else the API server's message."""
    try:
        k.create(body)
    except kubernetes.client.ApiException as e:
        return __import__("json").loads(e.body)["message"]
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments",
                                             body["metadata"]["name"])
    return None


def test_admission_refuses_what_the_operator_policy_refuses(policy):
    k, adm, name = policy
    # the policy is compiled and its binding picked up asynchronously: wait until it bites
    assert wait_for(lambda: refusal(k, sample("probe", NS, model__source="hostpath:///etc")) is not None, 30)
    def checked():
        status = adm.read_validating_admission_policy(name).status
        return status is not None and status.type_checking is not None and status.observed_generation
    assert wait_for(checked, 30)  # the API server type-checks the rules against the CRD's schema in the background
    warnings = adm.read_validating_admission_policy(name).status.type_checking.expression_warnings
    assert not warnings, warnings
    refused = {  # the message says what to change
        "hostpath:///etc": ({"model__source": "hostpath:///etc"}, "host path /etc is not allowed"),
        "image": ({"engine__image": "evil.example/miner:1"}, "spec.engine.image evil.example/miner:1"),
        "priority": ({"engine__priorityClassName": "system-node-critical"}, "priorityClassName"),
        "toleration": ({"engine__tolerations": [{"operator": "Exists"}]}, "spec.engine.tolerations"),
        "env": ({"engine__env": [{"name": "CHUNKPILOT_API_KEY", "value": ""}]}, "CHUNKPILOT_"),
        "preload": ({"engine__env": [{"name": "LD_PRELOAD", "value": "/models/x.so"}]}, "load code"),
        "alias": ({"engine__extraArgs": ["-tp", "8"]}, "operator does not set"),
        "expand": ({"engine__extraArgs": ["--max-waiting=$(CHUNKPILOT_API_KEY)"]}, "$(VAR)"),
    }
    for i, (case, (override, words)) in enumerate(refused.items()):
        message = refusal(k, sample(f"bad-{i}", NS, **override))
        assert message is not None and words in message, (case, message)
    # the table the operator judges too (tests/operator/test_crd_and_builders.py): the same verdict on every row
    disagree = []
    for i, (case, override, admitted) in enumerate(CASES):
        message = refusal(k, sample(f"case-{i}", NS, **override))
        if (message is None) != admitted:
            disagree.append((case, message))
    assert not disagree, disagree


def test_an_object_stored_before_the_policy_stays_deletable(control_plane):
    """An object the policy would refuse, stored before the policy existed (or before a stricter one), must not get
    stuck: taking its finalizer off and deleting it pass; only writing a spec is judged."""
    text = subprocess.run(
        [helm(), "template", "cp", str(CHART), "--kube-version", "1.34.4", "--show-only",
         "templates/admission-policy.yaml", *HELM_SETS],
        capture_output=True, text=True, check=True).stdout
    vap, binding = [d for d in yaml.safe_load_all(text) if d]
    ns = "vap-legacy"
    vap["metadata"]["name"] = binding["metadata"]["name"] = binding["spec"]["policyName"] = "legacy-check"
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    k = Cluster(control_plane.api())
    k.namespace(ns)
    old = sample("old", ns, model__source="hostpath:///etc")
    old["metadata"]["finalizers"] = ["tuner.chunkpilot.io/finalizer"]  # what tuners of earlier versions left
    k.create(old)
    adm = kubernetes.client.AdmissionregistrationV1Api(control_plane.api())
    adm.create_validating_admission_policy(vap)
    adm.create_validating_admission_policy_binding(binding)
    try:
        assert wait_for(lambda: refusal_in(k, ns, sample("probe", ns, model__source="hostpath:///etc")), 30)
        # a spec written is judged, even on the old object
        with pytest.raises(kubernetes.client.ApiException) as e:
            k.patch("old", {"spec": {"replicas": 3}}, ns)
        assert "host path /etc is not allowed" in e.value.body
        # kopf's bookkeeping and the hook's finalizer removal leave the spec alone: admitted
        k.patch("old", {"metadata": {"annotations": {"chunkpilot.io/last-handled-configuration": "{}"}}}, ns)
        k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", ns, "inferencedeployments", "old")
        k.patch("old", {"metadata": {"finalizers": None}}, ns)
        assert wait_for(lambda: k.get("inferencedeployments", ns, "old") is None, 30)
    finally:
        adm.delete_validating_admission_policy_binding("legacy-check")
        adm.delete_validating_admission_policy("legacy-check")
        k.delete_namespace(ns, drop_finalizers=True)  # a failure above may leave the old object's finalizer


def refusal_in(k: Cluster, ns: str, body: dict) -> bool:
    try:
        k.create(body)
    except kubernetes.client.ApiException:
        return True
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", ns, "inferencedeployments",
                                             body["metadata"]["name"])
    return False


SECRETS_NS = "vap-secrets"


def test_the_operator_account_may_write_only_its_own_token_secrets(control_plane, chart_accounts):
    """The chart's Secret policy on the real API server, as the operator's ServiceAccount: its own Opaque
    `<name>-knobs-token` Secrets only; no service-account-token Secret, no other name, no Secret someone else made
    (refused, not adopted: the operator then reports NameConflict)."""
    import json

    from chunkpilot.kube.client import Kube
    from chunkpilot.operator.apply import FIELD_MANAGER
    from chunkpilot.operator.reconciler import NOT_OURS

    text = subprocess.run([helm(), "template", "cp", str(CHART), "--namespace", "chunkpilot", "--kube-version",
                           "1.34.4", "--show-only", "templates/secrets-policy.yaml", *REPOSITORY],
                          capture_output=True, text=True, check=True).stdout
    vap, binding = [d for d in yaml.safe_load_all(text) if d]
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": SECRETS_NS}}}
    adm = kubernetes.client.AdmissionregistrationV1Api(control_plane.api())
    adm.create_validating_admission_policy(vap)
    adm.create_validating_admission_policy_binding(binding)
    admin = Cluster(control_plane.api())
    admin.namespace(SECRETS_NS)
    operator = Kube(kubernetes.config.new_client_from_config(config_file=str(chart_accounts["operator"])),
                    field_manager=FIELD_MANAGER)
    labels = {"app.kubernetes.io/managed-by": "chunkpilot-operator"}

    def secret(name, type_="Opaque", labels=labels, data=None):
        return {"apiVersion": "v1", "kind": "Secret", "type": type_,
                "metadata": {"name": name, "namespace": SECRETS_NS, "labels": labels,
                             **({"annotations": {"kubernetes.io/service-account.name": "default"}}
                                if type_ == "kubernetes.io/service-account-token" else {})},
                "data": data if data is not None else {"token": "dA=="}}

    def refused(obj) -> str | None:
        try:
            operator.apply(obj, force=False)
        except kubernetes.client.ApiException as e:
            return f"{e.status} {json.loads(e.body)['message']}"
        return None
    try:
        # compiled and picked up asynchronously: wait until it bites
        assert wait_for(lambda: refused(secret("probe", labels={})) is not None, 30)
        assert refused(secret("a-knobs-token")) is None  # what the operator writes
        assert refused(secret("a-knobs-token")) is None  # and writes again on every pass
        for bad in (secret("sa-knobs-token", type_="kubernetes.io/service-account-token"),
                    secret("grab"), secret("b-knobs-token", labels={}),
                    secret("c-knobs-token", data={"token": "dA==", "extra": "eA=="})):
            message = refused(bad)
            assert message is not None and message.startswith("403") and "chunkpilot operator" in message, message
        # someone else's Secret of the same name: not taken over
        admin.core.create_namespaced_secret(SECRETS_NS, {"metadata": {"name": "d-knobs-token"},
                                                         "data": {"theirs": "eA=="}})
        message = refused(secret("d-knobs-token"))
        assert message is not None and NOT_OURS in message, message
        theirs = admin.core.read_namespaced_secret("d-knobs-token", SECRETS_NS)
        assert theirs.data == {"theirs": "eA=="} and not theirs.metadata.owner_references
    finally:
        adm.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        adm.delete_validating_admission_policy(vap["metadata"]["name"])
        assert admin.delete_namespace(SECRETS_NS)
