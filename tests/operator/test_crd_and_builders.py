"""The CRD generated from the API types, the samples, and every object the pure builders render, checked against
the real Kubernetes schemas (kubernetes-validate, strict) and the CRD's own schema and CEL rules."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from chunkpilot.api import InferenceDeployment
from chunkpilot.api.types import EnvVar, SchedulerStatus
from chunkpilot.api.crd import CRD_FILENAME, crd_manifest, render
from chunkpilot.operator import builders as b
from chunkpilot.operator.policy import Policy

from .admission_cases import CASES
from .admission_cases import settings as admission_settings
from .operator_proc import sample

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
# The GPU sample's priority class needs the admin's allowance (operator/policy.py); the NetworkPolicy is on.
SAMPLE_SETTINGS = b.OperatorSettings(policy=Policy(allowed_priority_classes=("inference-critical",)),
                                     engine_network_policy=True, network_policy_namespaces=("monitoring",))
SMOL = ROOT / "crds" / "samples" / "smollm2.yaml"  # auto tuning, CPU
GPU = ROOT / "crds" / "samples" / "llama-70b-gpu.yaml"  # advisory tuning, 4 GPUs, hf:// source
K8S_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"]


def load(path: Path, uid: str = "1234-abcd") -> InferenceDeployment:
    raw = yaml.safe_load(path.read_text())
    raw["metadata"] |= {"namespace": "ml", "uid": uid}
    return InferenceDeployment.model_validate(raw)


def openapi_schema() -> dict:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_matches_the_types():
    committed = (ROOT / "crds" / CRD_FILENAME).read_text()
    assert committed == render(), "crds/ is stale: run `chunkpilot crds generate`"


def test_committed_crd_reference_matches_the_types():
    from chunkpilot.api import reference

    committed = (ROOT / reference.REFERENCE_PATH).read_text()
    assert committed == reference.render(), "docs/crd-reference.md is stale: run `chunkpilot crds generate`"
    # every spec field is in it, so a new field cannot go undocumented
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert all(f"`.spec.{name}`" in committed for name in spec)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_is_a_valid_customresourcedefinition(version):
    import kubernetes_validate

    kubernetes_validate.validate(crd_manifest(), version, strict=True)


def test_every_schema_field_has_a_description():
    missing = []

    def walk(node, path):
        if not isinstance(node, dict):
            return
        if path and "description" not in node and not path.endswith((".apiVersion", ".kind", ".metadata")):
            missing.append(path)
        for k, v in node.get("properties", {}).items():
            walk(v, f"{path}.{k}")
        if "items" in node:
            walk(node["items"], path + "[]")

    walk(openapi_schema()["properties"]["spec"], "spec")
    walk(openapi_schema()["properties"]["status"], "status")
    assert not [m for m in missing if not m.endswith("[]")], missing


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_samples_pass_the_crd_schema(sample):
    # Kubernetes schemas are OpenAPI 3.0 (draft-4 style: boolean exclusiveMinimum)
    jsonschema.Draft4Validator(openapi_schema()).validate(yaml.safe_load(sample.read_text()))
    load(sample)  # and the operator's own types


def _cel_rules(node, obj, path="spec"):
    """Yield (rule, message, value) for every x-kubernetes-validations rule that applies to `obj`."""
    for rule in node.get("x-kubernetes-validations", []):
        yield rule["rule"], rule["message"], obj, path
    for key, sub in node.get("properties", {}).items():
        if isinstance(obj, dict) and key in obj:
            yield from _cel_rules(sub, obj[key], f"{path}.{key}")
    if "items" in node and isinstance(obj, list):  # a list's items have rules of their own (spec.sloClasses[i])
        for i, item in enumerate(obj):
            yield from _cel_rules(node["items"], item, f"{path}[{i}]")


def _cel_ok(rule: str, value) -> bool:
    import celpy

    env = celpy.Environment()
    return bool(env.program(env.compile(rule)).evaluate({"self": celpy.json_to_cel(value)}))


def test_cel_rules_accept_samples_and_reject_crossed_fields():
    spec_schema = openapi_schema()["properties"]["spec"]
    for sample in SAMPLES:
        spec = yaml.safe_load(sample.read_text())["spec"]
        rules = list(_cel_rules(spec_schema, spec))
        assert rules, "the samples should exercise the CEL rules"
        assert all(_cel_ok(r, v) for r, _, v, _ in rules)
    bad = yaml.safe_load(SMOL.read_text())["spec"]
    bad["scheduler"] = {"tokenBudget": 64, "maxChunk": 128}
    bad["tuning"]["bounds"]["tokenBudget"] = {"min": 512, "max": 256}
    failed = {m for r, m, v, _ in _cel_rules(spec_schema, bad) if not _cel_ok(r, v)}
    assert failed == {"maxChunk must be <= tokenBudget", "min must be <= max"}


def test_the_spec_slo_is_the_one_slo_type_every_part_judges_by():
    """spec.slo converts through SLOSpec.targets alone: the quantile stays a fraction, an absent objective stays
    unjudged, and the default quantile is the contract's."""
    from chunkpilot.contract.slo import DEFAULT_QUANTILE, LatencyTarget, SLOTargets

    from chunkpilot.api.types import SLOSpec

    spec = SLOSpec.model_validate({"ttft": {"percentile": 0.9, "thresholdSeconds": 2},
                                   "itl": {"thresholdSeconds": 0.2}})
    assert spec.targets == SLOTargets(ttft=LatencyTarget(0.9, 2.0), itl=LatencyTarget(DEFAULT_QUANTILE, 0.2))
    assert SLOSpec.model_validate({"itl": {"thresholdSeconds": 0.2}}).targets == SLOTargets.p99(itl=0.2)
    assert SLOSpec().targets == SLOTargets()
    assert openapi_schema()["properties"]["spec"]["properties"]["slo"]["properties"]["itl"]["properties"][
        "percentile"]["default"] == DEFAULT_QUANTILE


@pytest.mark.parametrize("tuning", ["off", "advisory", "auto"])
@pytest.mark.parametrize("scaling", ["off", "recommend", "auto"])
def test_the_crd_and_the_tuner_share_one_autoscaling_rule(tuning, scaling):
    """advisory tuning may only recommend replicas (it changes nothing); the CEL rule and autoscaling_refusal
    agree on every pair of modes."""
    from chunkpilot.api.types import AUTOSCALING_RULE_MESSAGE, autoscaling_refusal

    spec = yaml.safe_load(SMOL.read_text())["spec"]
    spec["tuning"]["mode"], spec["autoscaling"] = tuning, {"mode": scaling, "minReplicas": 1, "maxReplicas": 4}
    failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], spec) if not _cel_ok(r, v)}
    assert (AUTOSCALING_RULE_MESSAGE in failed) == bool(autoscaling_refusal(tuning, scaling))
    assert failed <= {AUTOSCALING_RULE_MESSAGE}


@pytest.mark.parametrize("method", ["none", "int8", "int4", "fp8"])
@pytest.mark.parametrize("gpus", [0, 1])
def test_quantization_fits_the_device_in_the_crd_and_in_the_operator_alike(method, gpus):
    """int8 and int4 run on the CPU, fp8 on GPUs: the CEL rule and the operator's parse agree on every pair, and an
    admitted method reaches the engine as CHUNKPILOT_QUANTIZATION."""
    from pydantic import ValidationError

    from chunkpilot.api.types import QUANTIZATION_RULE_MESSAGE

    spec = yaml.safe_load(SMOL.read_text())["spec"]
    spec["model"]["quantization"] = method
    spec.setdefault("engine", {}).setdefault("resources", {})["gpus"] = gpus
    failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], spec) if not _cel_ok(r, v)}
    fits = method == "none" or (gpus > 0) == (method == "fp8")
    assert (QUANTIZATION_RULE_MESSAGE in failed) == (not fits)
    doc = yaml.safe_load(SMOL.read_text())
    doc["spec"] = spec
    if not fits:
        with pytest.raises(ValidationError, match="run on the CPU"):
            InferenceDeployment.model_validate(doc)
        return
    env = {e["name"]: e.get("value") for e in b.engine_env(InferenceDeployment.model_validate(doc), "/models")}
    assert env.get("CHUNKPILOT_QUANTIZATION") == (None if method == "none" else method)
    # and the engine option is the operator's: a spec cannot set it past the field
    assert "is set by the operator" in b.rules.arg_refusal("--quantization=int8")


def test_speculative_decoding_reaches_the_engine_as_the_config_it_parses():
    """spec.engine.speculative becomes CHUNKPILOT_SPECULATIVE_CONFIG, vLLM-style JSON that the engine's own parser
    reads back field for field; a lookup range upside down is refused by the CEL rule and the operator alike; no
    speculative field, no variable (off)."""
    from pydantic import ValidationError

    from chunkpilot.engine.speculation.speculative import SpeculativeConfig

    doc = yaml.safe_load(SMOL.read_text())
    assert "CHUNKPILOT_SPECULATIVE_CONFIG" not in {e["name"] for e in b.engine_env(InferenceDeployment.model_validate(doc), "/models")}
    doc["spec"].setdefault("engine", {})["speculative"] = {"numSpeculativeTokens": 3, "promptLookupMax": 3,
                                                           "disableByBatchSize": 16}
    env = {e["name"]: e.get("value") for e in b.engine_env(InferenceDeployment.model_validate(doc), "/models")}
    parsed = SpeculativeConfig.parse(env["CHUNKPILOT_SPECULATIVE_CONFIG"])
    assert parsed == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                       prompt_lookup_max=3, disable_by_batch_size=16)
    spec = doc["spec"]
    spec["engine"]["speculative"] = {"promptLookupMin": 4, "promptLookupMax": 2}
    failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], spec) if not _cel_ok(r, v)}
    assert failed == {"promptLookupMin must be <= promptLookupMax"}
    with pytest.raises(ValidationError, match="promptLookupMin must be <= promptLookupMax"):
        InferenceDeployment.model_validate(doc)
    spec["engine"]["speculative"] = {"method": "eagle"}
    with pytest.raises(ValidationError, match="ngram"):
        InferenceDeployment.model_validate(doc)
    assert "is set by the operator" in b.rules.arg_refusal("--speculative-config={}")


def test_a_draft_model_is_mounted_beside_the_model_and_named_in_the_engine_config():
    """method draft_model with draftModel pvc://CLAIM/PATH: the claim is mounted read-only at /draft-model and the
    engine's config names the folder in the pod; draftModel without the method, or the method without it, is
    refused by the CEL rule and the operator alike; a host path goes through the same policy as the model's."""
    from pydantic import ValidationError

    from chunkpilot.api.types import DRAFT_MODEL_RULE_MESSAGE
    from chunkpilot.engine.speculation.speculative import SpeculativeConfig
    from chunkpilot.operator.policy import Policy, PolicyError

    doc = yaml.safe_load(SMOL.read_text())
    doc["metadata"]["uid"] = "1234-abcd"
    doc["spec"].setdefault("engine", {})["speculative"] = {"method": "draft_model", "draftModel": "pvc://drafts/smol-4l",
                                                           "numSpeculativeTokens": 3}
    obj = InferenceDeployment.model_validate(doc)
    env = {e["name"]: e.get("value") for e in b.engine_env(obj, "/models")}
    assert SpeculativeConfig.parse(env["CHUNKPILOT_SPECULATIVE_CONFIG"]) == SpeculativeConfig(
        method="draft_model", model="/draft-model/smol-4l", num_speculative_tokens=3)
    pod = b.deployment(obj)["spec"]["template"]["spec"]
    assert {"name": "draft-model", "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}} in pod["volumes"]
    assert {"name": "draft-model", "mountPath": "/draft-model", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    spec = doc["spec"]
    for bad in ({"method": "draft_model"}, {"draftModel": "image:///draft"}):
        spec["engine"]["speculative"] = bad
        failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], spec) if not _cel_ok(r, v)}
        assert failed == {DRAFT_MODEL_RULE_MESSAGE}, bad
        with pytest.raises(ValidationError, match=DRAFT_MODEL_RULE_MESSAGE):
            InferenceDeployment.model_validate(doc)
    spec["engine"]["speculative"] = {"method": "draft_model", "draftModel": "hf://HuggingFaceTB/SmolLM2-135M"}
    with pytest.raises(ValidationError, match="pattern"):
        InferenceDeployment.model_validate(doc)
    spec["engine"]["speculative"] = {"method": "draft_model", "draftModel": "hostpath:///srv/drafts"}
    with pytest.raises(PolicyError, match="spec.engine.speculative.draftModel .*not allowed"):
        b.validate(InferenceDeployment.model_validate(doc), b.OperatorSettings(policy=Policy(allowed_host_paths=("/models",))))


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_pass_kubernetes_schemas(sample, version):
    import kubernetes_validate

    obj = load(sample)
    objs = b.desired_objects(obj, SAMPLE_SETTINGS, service_monitor_crd=True)
    kinds = {o["kind"] for o in objs}
    assert {"ConfigMap", "Deployment", "Service"} <= kinds
    assert ("PodDisruptionBudget" in kinds) == (obj.spec.replicas > 1)
    for o in objs:
        assert o["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
        if o["kind"] == "ServiceMonitor":  # a Prometheus Operator CRD: not in the Kubernetes schemas
            continue
        kubernetes_validate.validate(o, version, strict=True)


def test_pods_are_locked_down_and_probed():
    dep = b.deployment(load(SMOL))
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["CHUNKPILOT_KNOBS_FILE"] == "/etc/chunkpilot/knobs.json"
    assert {"name": "knobs", "mountPath": "/etc/chunkpilot", "readOnly": True} in c["volumeMounts"]
    gpu = b.deployment(load(GPU), SAMPLE_SETTINGS)
    gc = gpu["spec"]["template"]["spec"]
    assert gc["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert gc["initContainers"][0]["name"] == "download-model"


def test_tensor_parallel_size_reaches_the_engine_with_a_memory_backed_dev_shm():
    gpu = b.deployment(load(GPU), SAMPLE_SETTINGS)["spec"]["template"]["spec"]
    c = gpu["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CHUNKPILOT_TENSOR_PARALLEL_SIZE"] == "4" and env["CHUNKPILOT_DEVICE"] == "cuda"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": b.SHM_SIZE_LIMIT}} in gpu["volumes"]
    # default: the GPU count; one GPU (or the CPU) gets no dshm volume
    obj = load(GPU)
    obj.spec.engine.tensor_parallel_size = None
    assert obj.spec.engine.effective_tensor_parallel_size == 4
    obj.spec.engine.resources.gpus = 1
    one = b.deployment(obj, SAMPLE_SETTINGS)["spec"]["template"]["spec"]
    assert {e["name"]: e.get("value") for e in one["containers"][0]["env"]}["CHUNKPILOT_TENSOR_PARALLEL_SIZE"] == "1"
    assert not any(v["name"] == "dshm" for v in one["volumes"])
    cpu = b.deployment(load(SMOL))["spec"]["template"]["spec"]
    assert {e["name"]: e.get("value") for e in cpu["containers"][0]["env"]}["CHUNKPILOT_TENSOR_PARALLEL_SIZE"] == "1"


@pytest.mark.parametrize("gpus, tp, ok", [(4, 4, True), (4, 2, True), (8, 4, True), (4, 3, False), (2, 4, False),
                                          (0, 2, False), (0, 1, True), (4, None, True)])
def test_cel_checks_that_the_gpus_divide_by_the_tensor_parallel_size(gpus, tp, ok):
    engine_schema = openapi_schema()["properties"]["spec"]["properties"]["engine"]
    (rule,) = engine_schema["x-kubernetes-validations"]
    engine = {"resources": {"gpus": gpus}} | ({"tensorParallelSize": tp} if tp is not None else {})
    assert _cel_ok(rule["rule"], engine) is ok
    assert "divide evenly by tensorParallelSize" in rule["message"]


def test_knob_change_touches_only_the_configmap():
    obj = load(SMOL)
    before = b.desired_objects(obj)
    tuned = copy.deepcopy(obj)
    tuned.status.scheduler = SchedulerStatus(tokenBudget=256, maxChunk=32, source="tuner", generation=7)
    after = b.desired_objects(tuned)
    changed = [x["kind"] for x, y in zip(before, after) if x != y]
    assert changed == ["ConfigMap"]  # not the Deployment: a knob change never restarts a pod
    advisory = load(GPU)  # advisory mode: the tuner's knobs are never applied
    advisory.status.scheduler = tuned.status.scheduler
    assert '"max_chunk": 512, "token_budget": 2048' in b.desired_objects(advisory, SAMPLE_SETTINGS)[0]["data"]["knobs.json"]
    assert '"generation": 7' in after[0]["data"]["knobs.json"] and '"token_budget": 256' in after[0]["data"]["knobs.json"]
    spec_change = copy.deepcopy(obj)
    spec_change.spec.scheduler.token_budget = 512
    assert [x["kind"] for x, y in zip(before, b.desired_objects(spec_change)) if x != y] == ["ConfigMap"]


def test_image_model_or_resource_change_rolls_the_pods():
    obj = load(SMOL)
    base = b.deployment(obj)["spec"]["template"]["metadata"]["annotations"][b.CONFIG_HASH]
    for change in (lambda o: setattr(o.spec.engine, "image", "registry/engine:2"),
                   lambda o: setattr(o.spec.model, "source", "pvc://models/other"),
                   lambda o: setattr(o.spec.engine.resources, "memory", "8Gi")):
        o = copy.deepcopy(obj)
        change(o)
        assert b.deployment(o)["spec"]["template"]["metadata"]["annotations"][b.CONFIG_HASH] != base


def test_single_replica_has_no_pdb_and_monitor_needs_its_crd():
    obj = load(SMOL)
    obj.spec.replicas = 1
    kinds = [o["kind"] for o in b.desired_objects(obj, service_monitor_crd=False)]
    assert "PodDisruptionBudget" not in kinds and "ServiceMonitor" not in kinds


@pytest.mark.parametrize("mutate, field", [
    (lambda s: s.scheduler.__setattr__("token_budget", 8), "spec.scheduler.tokenBudget"),
    (lambda s: s.tuning.bounds.token_budget.__setattr__("min", 4), "spec.tuning.bounds.tokenBudget.min"),
    (lambda s: (s.slo.__setattr__("ttft", None), s.slo.__setattr__("itl", None)), "spec.slo"),
    (lambda s: s.model.__setattr__("source", "s3://bucket/model"), "spec.model.source"),
])
def test_specs_the_schema_cannot_catch_raise_a_spec_error(mutate, field):
    obj = load(SMOL)
    mutate(obj.spec)
    with pytest.raises(b.SpecError, match=field.replace(".", r"\.")):
        b.desired_objects(obj)


def test_engine_api_key_comes_from_a_secret_and_validates():
    import kubernetes_validate

    obj = load(SMOL)
    dep = b.deployment(obj, b.OperatorSettings(engine_api_key_secret="engine-key:token"))
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["CHUNKPILOT_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "engine-key", "key": "token"}}
    kubernetes_validate.validate(dep, "1.33.0", strict=True)
    assert "CHUNKPILOT_API_KEY" not in str(b.deployment(obj))  # off by default


@pytest.mark.parametrize("args, words", [
    (["--engine-api-key-secret", "Bad_Name:key"], "SECRET:KEY"),
    (["--engine-api-key-secret", "s:k:extra"], "SECRET:KEY"),
    (["--resync", "1"], "--resync"),
])
def test_operator_cli_rejects_bad_settings_before_connecting(args, words):
    from typer.testing import CliRunner

    from chunkpilot.cli.main import app

    res = CliRunner().invoke(app, ["operator", "run", *args])
    assert res.exit_code == 2 and words in res.output


def test_watch_timeout_is_whole_seconds():
    """kopf sends settings.watching.server_timeout as the watch's `timeoutSeconds`; a real API server parses it as
    an integer and refuses "300.0" with 400, so no watch would ever start (the emulator accepted it)."""
    from chunkpilot.operator.handlers import OperatorConfig, kopf_settings

    w = kopf_settings(OperatorConfig()).watching
    assert type(w.server_timeout) is int and w.server_timeout == 300
    assert type(w.client_timeout) is int


# ---- what InferenceDeployment authors may not ask for (operator/policy.py) ----------------------------------
@pytest.mark.parametrize("mutate, allow, words", [
    (lambda e, m: setattr(m, "source", "hostpath:///"), Policy(allowed_host_paths=("/mnt/models",)), "host path /"),
    (lambda e, m: setattr(m, "source", "hostpath:///mnt/models/../../etc"), Policy(allowed_host_paths=("/mnt",)),
     "'..'"),
    (lambda e, m: setattr(m, "source", "hostpath:///mnt/models-evil/x"), Policy(allowed_host_paths=("/mnt/models",)),
     "not allowed"),
    (lambda e, m: setattr(e, "image", "evil.example/miner:1"), Policy(allowed_image_prefixes=("registry.corp/",)),
     "spec.engine.image"),
    (lambda e, m: setattr(e, "image", "ghcr.io/chunkpilot/engine-evil:1"), Policy(), "spec.engine.image"),
    (lambda e, m: setattr(e, "image", "registry.corp/ml-untrusted/miner:1"),
     Policy(allowed_image_prefixes=("registry.corp/ml",)), "spec.engine.image"),
    (lambda e, m: setattr(e, "priority_class_name", "system-node-critical"), Policy(allowed_priority_classes=("batch",)),
     "priorityClassName"),
    (lambda e, m: setattr(e, "tolerations", [{"operator": "Exists"}]), Policy(), "tolerates every taint"),
    (lambda e, m: setattr(e, "tolerations", [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]),
     Policy(), "tolerations[0]"),
])
def test_the_admin_policy_refuses_host_paths_images_priorities_and_tolerations(mutate, allow, words):
    obj = load(SMOL)
    mutate(obj.spec.engine, obj.spec.model)
    with pytest.raises(b.policy.PolicyError, match=words.replace(".", r"\.").replace("[", r"\[")):
        b.desired_objects(obj, b.OperatorSettings(policy=allow))


def test_the_admin_policy_allows_what_it_lists():
    obj = load(SMOL)
    obj.spec.model.source = "hostpath:///mnt/models/smollm2"
    obj.spec.engine.image = "registry.corp/engine:2"
    obj.spec.engine.priority_class_name = "batch"
    obj.spec.engine.tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    allow = Policy(allowed_host_paths=("/mnt/models",), allowed_image_prefixes=("registry.corp/",),
                   allowed_priority_classes=("batch",))
    dep = b.deployment(obj, b.OperatorSettings(policy=allow))
    assert dep["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] == "/mnt/models/smollm2"
    default = load(SMOL)
    default.spec.engine.image = "ghcr.io/chunkpilot/engine:0.2.0"  # the operator's own repository, another tag
    b.desired_objects(default)
    assert b.policy.image_prefixes(Policy(), "host:5000/team/engine:1") == ("host:5000/team/engine:",
                                                                            "host:5000/team/engine@")


@pytest.mark.parametrize("mutate, field", [
    (lambda e: setattr(e, "env", [EnvVar(name="CHUNKPILOT_API_KEY", value="")]), "spec.engine.env[0]"),
    (lambda e: setattr(e, "extra_args", ["--max-waiting", "64", "--api-key="]), "spec.engine.extraArgs[2]"),
    (lambda e: setattr(e, "extra_args", ["--port", "9000"]), "spec.engine.extraArgs[0]"),
    (lambda e: setattr(e, "extra_args", ["--no-enable-prefix-caching"]), "spec.engine.extraArgs[0]"),
    (lambda e: setattr(e, "extra_args", ["--max-waiting=$(CHUNKPILOT_API_KEY)"]), "spec.engine.extraArgs[0]"),
    (lambda e: setattr(e, "env", [EnvVar(name="LD_PRELOAD", value="/models/x.so")]), "spec.engine.env[0]"),
    (lambda e: setattr(e, "env", [EnvVar(name="PYTHONPATH", value="/models")]), "spec.engine.env[0]"),
    (lambda e: setattr(e, "env", [EnvVar(name="X", value="$(CHUNKPILOT_API_KEY)")]), "spec.engine.env[0]"),
    (lambda e: setattr(e, "env", [EnvVar(name="PYTHONPYCACHEPREFIX", value="/models/pyc")]), "spec.engine.env[0]"),
    (lambda e: setattr(e, "extra_args", ["--max-waiting", "64", "-tp", "8"]), "spec.engine.extraArgs[2]"),
])
def test_env_and_args_cannot_override_what_the_operator_sets(mutate, field):
    obj = load(SMOL)
    mutate(obj.spec.engine)
    with pytest.raises(b.SpecError, match=field.replace(".", r"\.").replace("[", r"\[")):
        b.desired_objects(obj)


@pytest.mark.parametrize("case, overrides, admitted", CASES, ids=[c[0] for c in CASES])
def test_the_operator_judges_the_shared_table_of_specs(case, overrides, admitted):
    """The same rows tests/chart/test_admission_policy.py sends through the real API server's admission; the
    operator refuses a row in its parse (the types: what the CRD's schema and CEL refuse) or in validate()."""
    from pydantic import ValidationError

    try:
        b.validate(InferenceDeployment.model_validate(sample(case, "default", **overrides)), admission_settings())
        verdict = None
    except (b.SpecError, b.policy.PolicyError, ValidationError) as e:
        verdict = str(e)
    assert (verdict is None) == admitted, (case, verdict)


def test_the_engine_options_are_read_from_the_engine_settings():
    """Owned and free options come from the engine settings' one declaration (the CLI's options are built from it,
    tests/test_package.py holds them together): the -tp alias is owned with its long name, every operator setting
    has an option, the chart's copy of the lists is the generated one, and the operator does not load the CLI."""
    from chunkpilot.operator import rules

    free, owned = rules.engine_options()
    assert {"-tp", "--tensor-parallel-size", "--api-key", "--no-enable-prefix-caching"} <= set(owned)
    assert {"--max-waiting", "--stall-timeout", "--seed"} <= set(free) and not set(free) & set(owned)
    assert len(owned) >= len(rules.OPERATOR_ENGINE_SETTINGS)
    committed = (ROOT / "helm" / "chunkpilot" / "files" / "engine-rules.json").read_text()
    assert committed == rules.render(), "helm/chunkpilot/files/engine-rules.json is stale: run `chunkpilot crds generate`"
    import subprocess
    import sys
    loaded = subprocess.run([sys.executable, "-c", "import sys, chunkpilot.operator.builders, chunkpilot.operator.rules;"
                             "chunkpilot.operator.rules.engine_options();"
                             "print(sorted(m for m in sys.modules if m.startswith(('chunkpilot.cli', 'typer'))))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded


def test_every_engine_setting_the_operator_renders_is_reserved():
    obj = load(GPU)
    obj.spec.model.max_model_len = 4096
    obj.spec.engine.extra_args = ["--max-waiting", "64", "--stall-timeout=60"]  # flags it does not set are fine
    env = b.engine_env(obj, "/models/m", b.OperatorSettings(engine_api_key_secret="k"))
    names = {e["name"].removeprefix("CHUNKPILOT_") for e in env if e["name"].startswith("CHUNKPILOT_")}
    assert names <= set(b.rules.OPERATOR_ENGINE_SETTINGS)
    b.desired_objects(obj, SAMPLE_SETTINGS)


def test_engine_pods_are_closed_by_default_and_drain_before_they_stop():
    spec = b.deployment(load(SMOL))["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert spec["automountServiceAccountToken"] is False
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]  # not BestEffort
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"  # a failed or hung load restarts the pod
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(b.PRESTOP_SECONDS)]
    grace = next(int(e["value"]) for e in c["env"] if e["name"] == "CHUNKPILOT_GRACE_PERIOD")
    assert spec["terminationGracePeriodSeconds"] > b.PRESTOP_SECONDS + grace
    # on by default (/metrics and /docs answer without the API key); an admin may turn it off
    assert "NetworkPolicy" in [o["kind"] for o in b.desired_objects(load(SMOL))]
    assert "NetworkPolicy" not in [o["kind"] for o in b.desired_objects(
        load(SMOL), b.OperatorSettings(engine_network_policy=False))]
    netpol = next(o for o in b.desired_objects(load(SMOL), SAMPLE_SETTINGS) if o["kind"] == "NetworkPolicy")
    peers = netpol["spec"]["ingress"][0]["from"]
    assert {"podSelector": {}} in peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in peers


@pytest.mark.parametrize("classes, refusal", [
    ([{"name": "chat", "priority": 10, "ttft": {"thresholdSeconds": 1}, "itl": {"thresholdSeconds": 0.2}},
      {"name": "batch", "priority": -1, "default": True, "queueLimit": 8, "share": 0.2}], None),
    ([{"name": "chat"}, {"name": "chat", "priority": 1}], "names must be distinct"),
    ([{"name": "a", "default": True}, {"name": "b", "default": True}], "at most one class may be marked default"),
    ([{"name": "batch", "priority": 0, "queueLimit": 8}], "queueLimit is for sheddable classes"),
    ([{"name": "a", "share": 0.7}, {"name": "b", "share": 0.6}], "shares add up to 1.3"),
    ([{"name": "bad name"}], "String should match pattern"),
    ([{"name": "chat-"}], "String should match pattern"),  # SLOMet.<class> is a condition type: ends alphanumeric
])
def test_slo_classes_reach_the_engine_as_the_json_it_parses_and_bad_ones_are_refused(classes, refusal):
    """spec.sloClasses: the CEL rules and the operator's parse agree; an admitted list becomes
    CHUNKPILOT_SLO_CLASSES, which the engine's own parser (the contract's SLOClasses.from_json) reads back: the
    default is the class marked so (else the first), a sheddable class keeps its queue limit."""
    from pydantic import ValidationError

    from chunkpilot.contract.slo import SLOClasses

    doc = yaml.safe_load(SMOL.read_text())
    doc["spec"]["sloClasses"] = classes
    failed = {m for r, m, v, _ in _cel_rules(openapi_schema()["properties"]["spec"], doc["spec"]) if not _cel_ok(r, v)}
    if refusal is None:
        assert not failed
        env = {e["name"]: e.get("value") for e in b.engine_env(InferenceDeployment.model_validate(doc), "/models")}
        parsed = SLOClasses.from_json(env["CHUNKPILOT_SLO_CLASSES"])
        assert parsed.default == "batch" and parsed.names == ["chat", "batch"]
        assert parsed.get("batch").queue_limit == 8 and parsed.get("batch").sheddable
        assert parsed.get("chat").slo.itl.threshold == 0.2 and parsed.get("chat").slo.ttft.quantile == 0.99
        assert "is set by the operator" in b.rules.arg_refusal("--slo-classes={}")
        return
    with pytest.raises(ValidationError, match=refusal.replace(".", r"\.")):
        InferenceDeployment.model_validate(doc)
    if "pattern" not in refusal and "shares" not in refusal and "distinct" not in refusal:  # CEL says so too
        assert any(refusal in m for m in failed), failed
    # without classes: no variable, today's engine
    plain = yaml.safe_load(SMOL.read_text())
    assert "CHUNKPILOT_SLO_CLASSES" not in {e["name"] for e in b.engine_env(InferenceDeployment.model_validate(plain),
                                                                             "/models")}
