"""spec.disaggregation (issue 53, section 4): the types and the CRD's CEL rules that admit or refuse it, what the
builders render for each mode (off: byte for byte what they rendered before), the status and printer columns,
and a reconciler switching a resource between the modes without leaving anything behind. No API server here
(tests/operator/test_operator_apiserver.py runs the switch on a real one)."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from pydantic import ValidationError

from chunkpilot.api import InferenceDeployment
from chunkpilot.api import types as t
from chunkpilot.api.crd import PRINTER_COLUMNS
from chunkpilot.contract import engine_settings as es
from chunkpilot.contract.knobs import DISAGG_NEVER, SchedulerKnobs, parse_knobs
from chunkpilot.operator import builders as b
from chunkpilot.operator.conditions import Problem, RolePods, role_conditions, status_patch

from . import off_mode
from .test_crd_and_builders import K8S_VERSIONS, SMOL, _cel_ok, _cel_rules, openapi_schema

ON = {"mode": "on", "prefill": {"replicas": 2}, "decode": {"replicas": 3}}


def disaggregated(disaggregation: dict | None = None, **spec: object) -> InferenceDeployment:
    """The SmolLM2 sample (CPU, tuning auto) in namespace ml with spec.disaggregation."""
    raw = yaml.safe_load(SMOL.read_text())
    raw["metadata"] |= {"namespace": "ml", "uid": "1234-abcd", "generation": 2}
    raw["spec"] |= spec
    raw["spec"]["disaggregation"] = copy.deepcopy(ON if disaggregation is None else disaggregation)
    return InferenceDeployment.model_validate(raw)


def by_kind_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def env_of(deploy: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}


# ---- mode off: exactly what was rendered before --------------------------------------------------------------
def test_without_disaggregation_the_builders_render_byte_for_byte_what_they_rendered_before():
    """Every fixture of off_mode.py (the samples under several operator settings and tuner states, every admitted
    row of the admission table): the digests of the objects the builders render now equal those the builders of
    550c8e4, before disaggregation, rendered (off_mode_digests.json, written by that commit's builders and by these
    alike); with disaggregation absent, and with mode off however its other fields are set."""
    committed = json.loads(off_mode.OFF_MODE_DIGESTS.read_text())
    assert off_mode.digests() == committed
    off = {"mode": "off", "threshold": 1, "leaseSeconds": 3, "prefill": {"replicas": 0, "knobs": {"tokenBudget": 4096}},
           "decode": {"replicas": 9}}
    for name, obj, settings in off_mode.fixtures():
        switched_off = obj.model_copy(deep=True)
        switched_off.spec.disaggregation = t.DisaggregationSpec.model_validate(off)
        assert off_mode.digest(off_mode._objects(switched_off, settings)) == committed[name], name


# ---- the types and the CEL rules agree -----------------------------------------------------------------------
# (case, spec overrides of the SmolLM2 sample, the message both refuse it with; None: admitted)
CASES = [
    ("absent", {}, None),
    ("off", {"disaggregation": {"mode": "off"}}, None),
    ("off-no-pods", {"disaggregation": {"mode": "off", "prefill": {"replicas": 0}}}, None),
    ("on-defaults", {"disaggregation": {"mode": "on"}}, None),
    ("on", {"disaggregation": ON}, None),
    ("auto", {"disaggregation": {**ON, "mode": "auto"}}, None),
    ("auto-colocated-start", {"disaggregation": {"mode": "auto", "prefill": {"replicas": 0}}}, None),
    ("on-role-knobs", {"disaggregation": {**ON, "prefill": {"replicas": 1, "knobs": {"tokenBudget": 2048,
                                                                                     "maxChunk": 1024}}}}, None),
    ("on-ngram", {"disaggregation": ON, "engine": {"speculative": {"method": "ngram"}}}, None),
    ("on-one-gpu", {"disaggregation": ON, "engine": {"resources": {"gpus": 1}}}, None),
    ("on-tp1-of-two-gpus", {"disaggregation": ON, "engine": {"resources": {"gpus": 2}, "tensorParallelSize": 1}},
     None),
    ("tp2-off", {"disaggregation": {"mode": "off"}, "engine": {"resources": {"gpus": 2}, "tensorParallelSize": 2}},
     None),
    ("on-no-prefill", {"disaggregation": {"mode": "on", "prefill": {"replicas": 0}}}, t.DISAGG_REPLICAS_RULE_MESSAGE),
    ("auto-no-decode", {"disaggregation": {"mode": "auto", "decode": {"replicas": 0}}},
     t.DISAGG_REPLICAS_RULE_MESSAGE),
    ("on-tp2", {"disaggregation": ON, "engine": {"resources": {"gpus": 2}, "tensorParallelSize": 2}},
     t.DISAGG_TP_RULE_MESSAGE),
    ("on-four-gpus", {"disaggregation": ON, "engine": {"resources": {"gpus": 4}}}, t.DISAGG_TP_RULE_MESSAGE),
    ("on-draft-model", {"disaggregation": ON, "engine": {"speculative": {"method": "draft_model",
                                                                          "draftModel": "pvc://drafts/small"}}},
     t.DISAGG_DRAFT_RULE_MESSAGE),
    ("on-autoscaling", {"disaggregation": ON, "autoscaling": {"mode": "recommend", "minReplicas": 1,
                                                               "maxReplicas": 4}}, t.DISAGG_AUTOSCALING_RULE_MESSAGE),
]


def _spec(overrides: dict) -> dict:
    spec = yaml.safe_load(SMOL.read_text())["spec"]
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) and key != "disaggregation" else value
    return spec


@pytest.mark.parametrize("case, overrides, message", CASES, ids=[c[0] for c in CASES])
def test_the_crd_and_the_types_refuse_the_same_disaggregations_with_one_message(case, overrides, message):
    """Each row through the CRD's CEL rules (cel-python here; tests/chart/test_admission_policy.py sends the same
    rows to the real API server) and through the types, which the operator parses with: the same verdict, the same
    message, and one that says what to change."""
    spec = _spec(overrides)
    failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], spec) if not _cel_ok(r, v)}
    assert failed == ({message} if message else set()), case
    if message is None:
        t.InferenceDeploymentSpec.model_validate(spec)
        return
    with pytest.raises(ValidationError) as refused:
        t.InferenceDeploymentSpec.model_validate(spec)
    assert message in str(refused.value)
    assert " or " in message and "set " in message  # names the change that admits it


def test_values_out_of_bounds_are_refused_by_the_schema():
    for bad in ({"mode": "sometimes"}, {"threshold": -1}, {"transport": "tcp"}, {"leaseSeconds": 0},
                {"prefill": {"replicas": -1}}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            t.DisaggregationSpec.model_validate({"mode": "on", **bad})
    schema = openapi_schema()["properties"]["spec"]["properties"]["disaggregation"]
    assert schema["properties"]["transport"]["enum"] == list(es.KV_TRANSPORTS)
    assert schema["properties"]["threshold"]["default"] == es.DISAGG_THRESHOLD
    assert schema["properties"]["leaseSeconds"]["default"] == es.KV_LEASE_SECONDS
    assert schema["properties"]["leaseSeconds"]["exclusiveMinimum"] is True
    assert schema["properties"]["prefill"]["default"] == {"replicas": 1}  # filled once the user writes the section
    assert "default" not in schema  # absent stays absent (off): stored objects do not change
    # a role's knobs are the spec's knob type, with its own rule
    knobs = schema["properties"]["decode"]["properties"]["knobs"]
    assert knobs["x-kubernetes-validations"] == \
        openapi_schema()["properties"]["spec"]["properties"]["scheduler"]["x-kubernetes-validations"]


def test_a_roles_knobs_are_held_to_the_rules_of_the_spec_knobs():
    obj = disaggregated({**ON, "decode": {"replicas": 1, "knobs": {"tokenBudget": 8, "maxChunk": 8}}})
    with pytest.raises(b.SpecError, match=r"spec\.disaggregation\.decode\.knobs\.tokenBudget 8 .*maxNumSeqs 16"):
        b.validate(obj)
    obj = disaggregated({**ON, "prefill": {"replicas": 1, "knobs": {"tokenBudget": 64, "maxChunk": 128}}})
    with pytest.raises(b.SpecError, match=r"spec\.disaggregation\.prefill\.knobs\.tokenBudget 64 and maxChunk 128"):
        b.validate(obj)
    # (the CEL rule of the knob type refuses it at admission already)
    failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], _spec(
        {"disaggregation": {**ON, "prefill": {"knobs": {"tokenBudget": 64, "maxChunk": 128}}}})) if not _cel_ok(r, v)}
    assert failed == {"maxChunk must be <= tokenBudget"}


def test_the_operator_owns_the_disaggregation_settings():
    """role, prefill peers, threshold, transport and lease are set by the operator: a spec may not set them
    through extraArgs (rules.py derives it from the settings table) nor through CHUNKPILOT_* env."""
    for flag in ("--role=prefill", "--prefill-peers=x:1", "--disagg-threshold=1", "--kv-transport=nixl",
                 "--kv-lease-seconds=1"):
        assert "is set by the operator" in b.rules.arg_refusal(flag), flag
    assert b.rules.arg_refusal("--prefill-max-waiting=4") is None  # the engine's own, not rendered
    assert b.rules.env_refusal("UCX_TLS", "shm") is not None


# ---- mode on: what is rendered per role -------------------------------------------------------------------------
def test_on_renders_a_deployment_per_role_and_a_headless_service_for_the_prefill_pods():
    import kubernetes_validate

    obj = disaggregated(ON)
    objs = b.desired_objects(obj, off_mode.SETTINGS["everything"], service_monitor_crd=True)
    got = by_kind_name(objs)
    assert set(got) == {("ConfigMap", "smollm2-knobs"), ("Deployment", "smollm2-prefill"),
                        ("Deployment", "smollm2-decode"), ("Service", "smollm2"), ("Service", "smollm2-prefill"),
                        ("PodDisruptionBudget", "smollm2-prefill"), ("PodDisruptionBudget", "smollm2-decode"),
                        ("NetworkPolicy", "smollm2"), ("ServiceMonitor", "smollm2")}
    base = b.labels("smollm2")
    for role, replicas in (("prefill", 2), ("decode", 3)):
        dep = got[("Deployment", f"smollm2-{role}")]
        roles = {"chunkpilot.io/role": role, "llm-d.ai/role": role}
        assert dep["spec"]["replicas"] == replicas
        assert dep["spec"]["selector"]["matchLabels"] == {**b.selector_labels("smollm2"), "chunkpilot.io/role": role}
        assert dep["spec"]["template"]["metadata"]["labels"] == {**base, **roles}  # today's labels, and the role's
        assert dep["metadata"]["labels"] == {**base, **roles}
        assert dep["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
        env = env_of(dep)
        assert env["CHUNKPILOT_ROLE"] == role and env["CHUNKPILOT_KV_TRANSPORT"] == "nixl"
        assert env["UCX_TLS"] == "tcp,self"
        assert env["CHUNKPILOT_KNOBS_FILE"] == f"/etc/chunkpilot/knobs-{role}.json"
        # everything else as today's pods have it
        assert env["CHUNKPILOT_API_KEY"] is None and env["CHUNKPILOT_MAX_NUM_SEQS"] == "16"
        pdb = got[("PodDisruptionBudget", f"smollm2-{role}")]
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    prefill, decode = env_of(got[("Deployment", "smollm2-prefill")]), env_of(got[("Deployment", "smollm2-decode")])
    assert prefill["CHUNKPILOT_KV_LEASE_SECONDS"] == str(es.KV_LEASE_SECONDS)
    assert "CHUNKPILOT_PREFILL_PEERS" not in prefill and "CHUNKPILOT_DISAGG_THRESHOLD" not in prefill
    assert decode["CHUNKPILOT_PREFILL_PEERS"] == "smollm2-prefill.ml.svc:8000"
    assert decode["CHUNKPILOT_DISAGG_THRESHOLD"] == str(es.DISAGG_THRESHOLD)
    assert "CHUNKPILOT_KV_LEASE_SECONDS" not in decode
    # every CHUNKPILOT_* name is a setting the operator owns (so a spec cannot set it past the operator)
    owned = {s.env for s in es.operator_settings()}
    assert {n for n in {**prefill, **decode} if n.startswith("CHUNKPILOT_")} <= owned

    headless = got[("Service", "smollm2-prefill")]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["selector"] == {**b.selector_labels("smollm2"), "chunkpilot.io/role": "prefill"}
    assert {p["name"]: p["port"] for p in headless["ports"]} == {"http": b.ENGINE_PORT, "metrics": b.METRICS_PORT}
    client = got[("Service", "smollm2")]["spec"]
    assert client["selector"] == {**b.selector_labels("smollm2"), "chunkpilot.io/role": "decode"}
    assert "clusterIP" not in client
    # the ServiceMonitor selects both Services by label: prefill pods are scraped too
    monitor = got[("ServiceMonitor", "smollm2")]["spec"]["selector"]["matchLabels"]
    assert all(got[("Service", n)]["metadata"]["labels"].items() >= monitor.items()
               for n in ("smollm2", "smollm2-prefill"))
    for o in objs:
        if o["kind"] != "ServiceMonitor":
            for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
                kubernetes_validate.validate(o, version, strict=True)


def test_the_network_policy_lets_the_engine_pods_of_one_resource_reach_each_other_on_any_tcp_port():
    off = next(o for o in b.desired_objects(disaggregated({"mode": "off"})) if o["kind"] == "NetworkPolicy")
    on = next(o for o in b.desired_objects(disaggregated(ON)) if o["kind"] == "NetworkPolicy")
    assert on["spec"]["ingress"][: len(off["spec"]["ingress"])] == off["spec"]["ingress"]
    (ucx,) = on["spec"]["ingress"][len(off["spec"]["ingress"]):]
    # UCX's TCP transport listens on ephemeral ports: every TCP port, from this resource's engine pods alone
    assert ucx == {"from": [{"podSelector": {"matchLabels": b.selector_labels("smollm2")}}],
                   "ports": [{"protocol": "TCP"}]}
    assert on["spec"]["podSelector"] == off["spec"]["podSelector"]  # both roles' pods


# ---- mode auto: one Deployment whose pods switch roles while they serve ----------------------------------------------
def test_auto_renders_one_deployment_of_live_roles_pods_and_the_services_select_by_role():
    import kubernetes_validate

    objs = b.desired_objects(disaggregated({**ON, "mode": "auto"}), off_mode.SETTINGS["everything"])
    got = by_kind_name(objs)
    assert set(got) == {("ConfigMap", "smollm2-knobs"), ("Deployment", "smollm2"), ("Service", "smollm2"),
                        ("Service", "smollm2-prefill"), ("PodDisruptionBudget", "smollm2"), ("NetworkPolicy", "smollm2")}
    dep = got[("Deployment", "smollm2")]
    assert dep["spec"]["replicas"] == 5  # both roles' pods
    # the selector leaves the role out (a pod whose role label moves stays its ReplicaSet's); a new pod starts as
    # a decode pod
    assert dep["spec"]["selector"]["matchLabels"] == b.selector_labels("smollm2")
    assert dep["spec"]["template"]["metadata"]["labels"] == {**b.labels("smollm2"), "chunkpilot.io/role": "decode",
                                                             "llm-d.ai/role": "decode"}
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    # the role a (re)started engine begins in is its pod's label, read when the container starts
    assert env["CHUNKPILOT_ROLE"] == {"name": "CHUNKPILOT_ROLE", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['chunkpilot.io/role']"}}}
    assert {n: env[n]["value"] for n in ("CHUNKPILOT_LIVE_ROLES", "CHUNKPILOT_PREFILL_PEERS",
                                         "CHUNKPILOT_DISAGG_THRESHOLD", "CHUNKPILOT_KV_LEASE_SECONDS", "UCX_TLS",
                                         "CHUNKPILOT_KNOBS_FILE")} == {
        "CHUNKPILOT_LIVE_ROLES": "true", "CHUNKPILOT_PREFILL_PEERS": "smollm2-prefill.ml.svc:8000",
        "CHUNKPILOT_DISAGG_THRESHOLD": str(es.DISAGG_THRESHOLD), "CHUNKPILOT_KV_LEASE_SECONDS": str(es.KV_LEASE_SECONDS),
        "UCX_TLS": "tcp,self", "CHUNKPILOT_KNOBS_FILE": "/etc/chunkpilot/knobs.json"}
    assert got[("Service", "smollm2")]["spec"]["selector"] == {**b.selector_labels("smollm2"),
                                                               "chunkpilot.io/role": "decode"}
    assert got[("Service", "smollm2-prefill")]["spec"]["selector"] == {**b.selector_labels("smollm2"),
                                                                       "chunkpilot.io/role": "prefill"}
    assert got[("PodDisruptionBudget", "smollm2")]["spec"]["selector"]["matchLabels"] == b.selector_labels("smollm2")
    assert set(b.knobs_configmap(disaggregated({**ON, "mode": "auto"}))["data"]) == {"knobs.json"}
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSIONS[-1], strict=True)


def test_auto_a_new_split_at_the_same_pod_count_restarts_and_rescales_nothing():
    auto = disaggregated({**ON, "mode": "auto"})
    moved = disaggregated({**ON, "mode": "auto", "prefill": {"replicas": 4}, "decode": {"replicas": 1}})
    assert b.deployment(moved) == b.deployment(auto)


def test_the_split_keeps_roles_where_it_can_moves_the_newest_pods_and_never_leaves_no_decode_pod():
    from chunkpilot.operator.role_split import split_roles

    old, new = "2026-12-07T00:00:00Z", "2026-12-07T01:00:00Z"
    pods = [("a", "decode", old), ("b", "decode", new), ("c", "prefill", old), ("d", None, old)]
    assert split_roles(pods, 1) == {"a": "decode", "b": "decode", "c": "prefill", "d": "decode"}
    # one more prefill pod: the newest decode pod
    assert split_roles(pods, 2) == {"a": "decode", "b": "prefill", "c": "prefill", "d": "decode"}
    assert split_roles(pods, 0) == {"a": "decode", "b": "decode", "c": "decode", "d": "decode"}
    assert split_roles(pods, 9) == {"a": "decode", "b": "prefill", "c": "prefill", "d": "prefill"}
    # of pods as old as each other, the last by name
    assert split_roles([("a", "prefill", old), ("b", "prefill", old)], 1) == {"a": "prefill", "b": "decode"}
    assert split_roles([], 2) == {}
    assert split_roles(reversed(pods), 2) == split_roles(pods, 2)  # the same pods, the same answer


def test_one_pod_of_a_role_has_no_pdb_and_the_settings_reach_the_pods():
    obj = disaggregated({"mode": "on", "threshold": 1024, "leaseSeconds": 2.5, "prefill": {"replicas": 1},
                         "decode": {"replicas": 2}})
    got = by_kind_name(b.desired_objects(obj))
    assert ("PodDisruptionBudget", "smollm2-prefill") not in got and ("PodDisruptionBudget", "smollm2-decode") in got
    assert ("PodDisruptionBudget", "smollm2") not in got and ("Deployment", "smollm2") not in got
    assert env_of(got[("Deployment", "smollm2-decode")])["CHUNKPILOT_DISAGG_THRESHOLD"] == "1024"
    assert env_of(got[("Deployment", "smollm2-prefill")])["CHUNKPILOT_KV_LEASE_SECONDS"] == "2.5"


def test_a_setting_of_the_roles_rolls_their_pods_and_their_split_or_knobs_do_not():
    obj = disaggregated(ON)
    hashes = {r: b.deployment(obj, role=r)["spec"]["template"]["metadata"]["annotations"][b.CONFIG_HASH]
              for r in ("prefill", "decode")}
    assert hashes["prefill"] != hashes["decode"] != b.config_hash(obj, b.OperatorSettings())
    split = disaggregated({**ON, "prefill": {"replicas": 5, "knobs": {"tokenBudget": 4096, "maxChunk": 2048}}})
    assert all(b.deployment(split, role=r)["spec"]["template"] == b.deployment(obj, role=r)["spec"]["template"]
               for r in ("prefill", "decode"))
    threshold = disaggregated({**ON, "threshold": 64})
    assert b.deployment(threshold, role="decode")["spec"]["template"]["metadata"]["annotations"][b.CONFIG_HASH] != \
        hashes["decode"]


def test_each_role_starts_from_its_own_knobs_until_the_tuner_chooses():
    obj = disaggregated({**ON, "prefill": {"replicas": 1, "knobs": {"tokenBudget": 2048, "maxChunk": 1024}}})
    data = b.knobs_configmap(obj)["data"]
    assert set(data) == {"knobs-prefill.json", "knobs-decode.json"}
    assert parse_knobs(data["knobs-prefill.json"]) == SchedulerKnobs(2048, 1024, 2)
    assert parse_knobs(data["knobs-decode.json"]) == SchedulerKnobs(128, 64, 2)  # spec.scheduler's
    assert t.desired_knobs(obj) == (SchedulerKnobs(128, 64, 2), "spec")  # the resource's, as before
    # tuning auto: the tuner's knobs, once chosen, go to the decode pods (whose latencies it measured) under its
    # generation; the prefill pods keep their role's own, under the spec's generation counted past the tuner's
    obj.status.scheduler = t.SchedulerStatus(tokenBudget=256, maxChunk=32, source="tuner", generation=9)
    data = b.knobs_configmap(obj)["data"]
    assert parse_knobs(data["knobs-decode.json"]) == SchedulerKnobs(256, 32, 9)
    assert parse_knobs(data["knobs-prefill.json"]) == SchedulerKnobs(2048, 1024, 2 + 9)
    assert t.desired_knobs(obj, "prefill")[1] == "spec" and t.desired_knobs(obj, "decode")[1] == "tuner"
    # a knob change touches only the ConfigMap: no role's pods restart
    before = b.desired_objects(disaggregated(ON))
    changed = disaggregated({**ON, "decode": {"replicas": 3, "knobs": {"tokenBudget": 512, "maxChunk": 256}}})
    assert [x["kind"] for x, y in zip(before, b.desired_objects(changed)) if x != y] == ["ConfigMap"]


# ---- status ------------------------------------------------------------------------------------------------------
def test_printer_columns_show_each_roles_ready_pods():
    by_name = {c["name"]: c for c in PRINTER_COLUMNS}
    assert by_name["Prefill"]["jsonPath"] == ".status.disaggregation.prefill.readyReplicas"
    assert by_name["Decode"]["jsonPath"] == ".status.disaggregation.decode.readyReplicas"
    status = openapi_schema()["properties"]["status"]["properties"]["disaggregation"]["properties"]
    for role in ("prefill", "decode"):  # the columns' paths exist in the schema
        assert status[role]["properties"]["readyReplicas"]["type"] == "integer"


def _deploy(replicas: int, ready: int, generation: int = 1) -> dict:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
                       "readyReplicas": ready}}


def test_status_counts_each_role_and_is_ready_when_every_role_is():
    roles = [RolePods("prefill", _deploy(2, 2), 2), RolePods("decode", _deploy(3, 1), 3)]
    ready, progressing, degraded = role_conditions(roles, 4, None)
    assert (ready.status, ready.reason) == ("False", "ReplicasNotReady")
    assert ready.message == "prefill: 2/2 engine pods ready; decode: 1/3 engine pods ready"
    assert progressing.status == "True" and progressing.message.startswith("decode: ")
    assert degraded.status == "False"
    patch = status_patch({}, deploy=None, desired_replicas=0, generation=4, selector="s", knobs=None, problem=None,
                         now="t", roles=roles)
    assert (patch["replicas"], patch["readyReplicas"]) == (5, 3)
    assert patch["disaggregation"] == {"prefill": {"replicas": 2, "readyReplicas": 2, "appliedReplicas": 0},
                                       "decode": {"replicas": 3, "readyReplicas": 1, "appliedReplicas": 0}}
    t.InferenceDeploymentStatus.model_validate(patch)  # the one status type reads it back
    assert status_patch(patch, deploy=None, desired_replicas=0, generation=4, selector="s", knobs=None,
                        problem=None, now="later", roles=roles) is None
    # every role ready: Ready, and Progressing complete
    done = [RolePods("prefill", _deploy(2, 2), 2), RolePods("decode", _deploy(3, 3), 3)]
    ready, progressing, _ = role_conditions(done, 4, None)
    assert (ready.status, progressing.reason) == ("True", "RolloutComplete")
    # a rollout that failed in one role degrades the resource and says which
    failed = _deploy(3, 1)
    failed["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                       "message": "deadline exceeded"}]
    _, progressing, degraded = role_conditions([RolePods("prefill", _deploy(2, 2), 2), RolePods("decode", failed, 3)],
                                               4, None)
    assert (progressing.reason, degraded.reason) == ("RolloutFailed", "RolloutFailed")
    assert degraded.message.startswith("decode: deadline exceeded")
    # a spec problem is the resource's, said once
    _, _, degraded = role_conditions(done, 4, Problem("InvalidSpec", "spec.x: fix it"))
    assert (degraded.reason, degraded.message) == ("InvalidSpec", "spec.x: fix it")
    # switched off: status.disaggregation goes
    off = status_patch(patch, deploy=_deploy(1, 1), desired_replicas=1, generation=5, selector="s", knobs=None,
                       problem=None, now="t")
    assert off["disaggregation"] is None and off["replicas"] == 1


def test_the_reference_pages_example_is_admitted_and_rendered():
    """docs/crd-reference.md's example (api.reference.DISAGGREGATION_EXAMPLE): the CRD's CEL rules and the types
    admit it, and the objects it renders pass the Kubernetes schemas."""
    import kubernetes_validate

    from chunkpilot.api.reference import DISAGGREGATION_EXAMPLE

    raw = yaml.safe_load(DISAGGREGATION_EXAMPLE)
    assert raw["spec"]["disaggregation"]["mode"] == "on"  # quoted: a string, not YAML 1.1's true
    assert not [m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], raw["spec"]) if not _cel_ok(r, v)]
    raw["metadata"] |= {"namespace": "serving", "uid": "u-1"}
    obj = InferenceDeployment.model_validate(raw)
    got = by_kind_name(b.desired_objects(obj, off_mode.SETTINGS["everything"]))
    assert got[("Deployment", "llama-8b-prefill")]["spec"]["replicas"] == 2
    assert got[("Deployment", "llama-8b-decode")]["spec"]["replicas"] == 4
    assert env_of(got[("Deployment", "llama-8b-decode")])["CHUNKPILOT_PREFILL_PEERS"] == \
        "llama-8b-prefill.serving.svc:8000"
    for o in got.values():
        kubernetes_validate.validate(o, K8S_VERSIONS[-1], strict=True)
    # a bare `on` is YAML 1.1's true: refused, by the schema's type and by the types
    with pytest.raises(ValidationError, match="mode"):
        t.DisaggregationSpec.model_validate(yaml.safe_load("mode: on"))


# ---- the tuner's threshold (disaggregation auto, tuning auto) ------------------------------------------------------
def test_the_tuners_threshold_goes_to_the_decode_pods_alone():
    obj = disaggregated({**ON, "mode": "auto"})
    # before the tuner chooses: the spec's knobs, no threshold (the pods' --disagg-threshold holds)
    assert t.desired_knobs(obj, "decode") == (SchedulerKnobs(128, 64, 2), "spec")
    obj.status.scheduler = t.SchedulerStatus.of(t.Knobs(256, 32, 512), source="tuner", generation=9)
    assert obj.status.scheduler.disagg_threshold == 512
    assert t.desired_knobs(obj, "decode") == (SchedulerKnobs(256, 32, 9, 512), "tuner")
    # a prefill pod routes nothing and is not what the tuner measured: its role's own knobs (here spec.scheduler's)
    assert t.desired_knobs(obj, "prefill") == (SchedulerKnobs(128, 64, 2 + 9), "spec")
    assert t.desired_knobs(obj) == (SchedulerKnobs(256, 32, 9, 512), "tuner")  # the tuner's own view: whole
    # the durable copy, which every pod of mode auto's one Deployment starts from, carries it
    data = b.knobs_configmap(obj)["data"]
    assert json.loads(data["knobs.json"])["disagg_threshold"] == 512
    # never: the number the engine takes, shown as never where people read it
    obj.status.scheduler = t.SchedulerStatus.of(t.Knobs(256, 32, DISAGG_NEVER), source="tuner", generation=10)
    assert parse_knobs(b.knobs_configmap(obj)["data"]["knobs.json"]).disagg_threshold == DISAGG_NEVER
    # out of auto, a threshold left in status.scheduler is not delivered: the spec's threshold holds again
    on = disaggregated(ON)
    on.status.scheduler = obj.status.scheduler
    assert t.desired_knobs(on, "decode") == (SchedulerKnobs(256, 32, 10), "tuner")
    plain = disaggregated({"mode": "off"})
    plain.status.scheduler = obj.status.scheduler
    assert t.desired_knobs(plain) == (SchedulerKnobs(256, 32, 10), "tuner")
    # status' dump leaves the fields out where they are not set (status.scheduler of every other resource as before)
    assert not {"disaggThreshold", "prefillPods", "prefillTokenBudget"} & t.SchedulerStatus.of(
        t.Knobs(256, 32), source="tuner", generation=1).model_dump(by_alias=True, exclude_none=True).keys()


def test_the_tuners_prefill_budget_goes_to_the_prefill_pods_alone():
    obj = disaggregated({**ON, "mode": "auto"})
    obj.status.scheduler = t.SchedulerStatus.of(t.Knobs(256, 32, 512, 1, 1024), source="tuner", generation=9)
    assert obj.status.scheduler.model_dump(by_alias=True)["prefillTokenBudget"] == 1024
    # the prefill pods: the tuner's budget as their chunk too, under the tuner's generation; no threshold
    assert t.desired_knobs(obj, "prefill") == (SchedulerKnobs(1024, 1024, 9), "tuner")
    assert t.desired_knobs(obj, "decode") == (SchedulerKnobs(256, 32, 9, 512), "tuner")
    # the tuner back on colocated (no prefill budget): the prefill role's own knobs again, under a newer generation
    obj.status.scheduler = t.SchedulerStatus.of(t.Knobs(256, 32, DISAGG_NEVER, 0), source="tuner", generation=10)
    assert t.desired_knobs(obj, "prefill") == (SchedulerKnobs(128, 64, 2 + 10), "spec")
    # out of auto (mode on: the spec's split and its roles' knobs), a budget left in status is not delivered
    on = disaggregated(ON)
    on.status.scheduler = t.SchedulerStatus.of(t.Knobs(256, 32, 512, 1, 1024), source="tuner", generation=11)
    assert t.desired_knobs(on, "prefill") == (SchedulerKnobs(128, 64, 2 + 11), "spec")
    with pytest.raises(ValidationError, match="prefillTokenBudget"):
        t.SchedulerStatus.model_validate({"tokenBudget": 256, "maxChunk": 32, "prefillTokenBudget": 0})


def test_the_tuners_wait_counts_each_pod_at_its_roles_knobs():
    """applied_everywhere: decode pods must acknowledge the tuner's knobs with the threshold; prefill pods run their
    role's own knobs, which the wait does not hold them to."""
    want = SchedulerKnobs(256, 32, 9, 512)
    pods = [t.PodKnobs(pod="d", role="decode", tokenBudget=256, maxChunk=32, generation=9, disaggThreshold=512),
            t.PodKnobs(pod="p", role="prefill", tokenBudget=2048, maxChunk=1024, generation=11)]
    status = t.KnobsStatus(tokenBudget=256, maxChunk=32, generation=9, disaggThreshold=512, pods=pods)
    assert status.applied_everywhere(want, ready_replicas=2)
    dropped = [pods[0].model_copy(update={"disagg_threshold": None}), pods[1]]  # a decode pod without it
    assert not status.model_copy(update={"pods": dropped}).applied_everywhere(want, ready_replicas=2)
    assert not status.applied_everywhere(SchedulerKnobs(256, 32, 9, 1024), ready_replicas=2)
