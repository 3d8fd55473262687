"""One table of InferenceDeployment specs, judged by both sides that check them: the operator (its parse of the
types and builders.validate, tests/operator/test_crd_and_builders.py) and the real API server
(tests/chart/test_admission_policy.py), where the CRD's own schema and CEL rules and the chart's
ValidatingAdmissionPolicy judge it. Each row says whether the spec is admitted; both sides must say the same, so an
admitted spec is never refused later (Degraded) and a refused one never reaches the operator.

The policy both sides run with: the chart values in HELM_SETS, the operator settings in settings().
"""

from __future__ import annotations

HOST_PATHS = ("/mnt/models", "/srv/weights/")
PRIORITY_CLASSES = ("batch",)
# the repository of settings()' default engine image (the chart has no default repository)
HELM_SETS = ("--set", "image.repository=ghcr.io/chunkpilot",
             "--set", "operator.policy.allowedHostPaths={" + ",".join(HOST_PATHS) + "}",
             "--set", "operator.policy.allowedPriorityClasses={" + ",".join(PRIORITY_CLASSES) + "}")


def settings():
    from chunkpilot.operator import builders as b
    from chunkpilot.operator.policy import Policy

    return b.OperatorSettings(policy=Policy(allowed_host_paths=HOST_PATHS, allowed_priority_classes=PRIORITY_CLASSES))


def _env(name: str, value: str = "1") -> dict:
    return {"engine__env": [{"name": name, "value": value}]}


def _args(*args: str) -> dict:
    return {"engine__extraArgs": list(args)}


def _source(path: str) -> dict:
    return {"model__source": "hostpath://" + path}


def _draft(path: str) -> dict:
    return {"engine__speculative": {"method": "draft_model", "draftModel": "hostpath://" + path}}


def _disagg(mode: str, **roles: dict) -> dict:
    return {"disaggregation": {"mode": mode, **roles}}


# (case, spec overrides for operator_proc.sample, admitted)
CASES = [
    ("defaults", {}, True),
    # environment: an allowlist (review: these loaded code from the tenant's volume and passed both checks)
    ("env-pycache", _env("PYTHONPYCACHEPREFIX", "/models/pyc"), False),
    ("env-openssl", _env("OPENSSL_CONF", "/models/openssl.cnf"), False),
    ("env-nccl-plugin", _env("NCCL_NET_PLUGIN", "/models/p.so"), False),
    ("env-pywarnings", _env("PYTHONWARNINGS", "error::evil.Category"), False),
    ("env-preload", _env("LD_PRELOAD", "/models/x.so"), False),
    ("env-home", _env("HOME", "/models"), False),
    ("env-inductor", _env("TORCHINDUCTOR_CACHE_DIR", "/models/c"), False),
    ("env-operator", _env("CHUNKPILOT_API_KEY", ""), False),
    ("env-expand", _env("TZ", "$(CHUNKPILOT_API_KEY)"), False),
    ("env-tz", _env("TZ", "UTC"), True),
    ("env-nccl-debug", _env("NCCL_DEBUG", "INFO"), True),
    # extraArgs: the engine's own options the operator does not set, aliases included
    ("arg-tp-alias", _args("-tp", "8"), False),
    ("arg-tp-alias-eq", _args("-tp=8"), False),
    ("arg-key-off", _args("--api-key="), False),
    ("arg-port", _args("--port", "9000"), False),
    ("arg-no-prefix-cache", _args("--no-enable-prefix-caching"), False),
    ("arg-end-of-options", _args("--", "--port", "1"), False),
    ("arg-unknown", _args("--bogus"), False),
    ("arg-help", _args("--help"), False),
    ("arg-expand", _args("--max-waiting=$(CHUNKPILOT_API_KEY)"), False),
    ("arg-free", _args("--max-waiting", "64"), True),
    ("arg-free-eq", _args("--stall-timeout=60", "--seed=-1"), True),
    # host paths: canonical, under an allowed prefix, a trailing slash on either side alike
    ("path-exact", _source("/mnt/models"), True),
    ("path-trailing-slash", _source("/mnt/models/"), True),
    ("path-below", _source("/mnt/models/smollm2"), True),
    ("path-prefix-with-slash", _source("/srv/weights"), True),
    ("path-below-prefix-with-slash", _source("/srv/weights/x"), True),
    ("path-sibling", _source("/mnt/models-evil"), False),
    ("path-double-slash", _source("//mnt/models"), False),
    ("path-dotdot", _source("/mnt/models/../../etc"), False),
    ("path-dot", _source("/mnt/models/./x"), False),
    ("path-etc", _source("/etc"), False),
    # the draft model's host path: the same rules as the model's
    ("draft-path-allowed", _draft("/mnt/models/draft"), True),
    ("draft-path-etc", _draft("/etc"), False),
    ("draft-path-dotdot", _draft("/mnt/models/../../etc"), False),
    ("draft-pvc", {"engine__speculative": {"method": "draft_model", "draftModel": "pvc://drafts/small"}}, True),
    # priority classes, images, tolerations: "" is unset on both sides
    ("priority-empty", {"engine__priorityClassName": ""}, True),
    ("priority-allowed", {"engine__priorityClassName": "batch"}, True),
    ("priority-other", {"engine__priorityClassName": "system-node-critical"}, False),
    ("image-empty", {"engine__image": ""}, True),
    ("image-own-repo", {"engine__image": "ghcr.io/chunkpilot/engine:0.2.0"}, True),
    ("image-other", {"engine__image": "evil.example/miner:1"}, False),
    ("image-look-alike", {"engine__image": "ghcr.io/chunkpilot/engine-evil:1"}, False),
    ("toleration-gpu", {"engine__tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"}]}, True),
    ("toleration-keyless", {"engine__tolerations": [{"operator": "Exists"}]}, False),
    ("toleration-empty-key", {"engine__tolerations": [{"key": "", "operator": "Exists"}]}, False),
    # prefill/decode disaggregation (the CRD's CEL rules, api.types): what the engine cannot disaggregate yet
    ("disagg-on", _disagg("on"), True),
    ("disagg-auto-split", _disagg("auto", prefill={"replicas": 2, "knobs": {"tokenBudget": 2048, "maxChunk": 1024}},
                                  decode={"replicas": 3}), True),
    ("disagg-off-no-pods", _disagg("off", prefill={"replicas": 0}), True),
    ("disagg-on-no-prefill", _disagg("on", prefill={"replicas": 0}), False),
    ("disagg-on-no-decode", _disagg("on", decode={"replicas": 0}), False),
    ("disagg-on-tp2", {**_disagg("on"), "engine__resources": {"gpus": 2}, "engine__tensorParallelSize": 2}, False),
    ("disagg-on-gpus4", {**_disagg("on"), "engine__resources": {"gpus": 4}}, False),
    ("disagg-on-tp1-gpus2", {**_disagg("on"), "engine__resources": {"gpus": 2}, "engine__tensorParallelSize": 1},
     True),
    ("disagg-on-draft", {**_disagg("on"), **_draft("/mnt/models/draft")}, False),
    ("disagg-on-ngram", {**_disagg("on"), "engine__speculative": {"method": "ngram"}}, True),
    ("disagg-on-autoscaling", {**_disagg("on"), "tuning__mode": "auto",
                               "autoscaling": {"mode": "recommend", "minReplicas": 1, "maxReplicas": 2}}, False),
    ("disagg-transport", {"disaggregation": {"mode": "on", "transport": "tcp"}}, False),
    ("disagg-lease-zero", {"disaggregation": {"mode": "on", "leaseSeconds": 0}}, False),
    # prefix- and load-aware routing (spec.routing): the picker's weights, the Gateway's reference
    ("routing", {"routing": {}}, True),
    ("routing-gateway", {"routing": {"scorerWeights": {"prefix": 5, "queue": 0},
                                     "gateway": {"name": "inference-gateway", "namespace": "gw",
                                                 "sectionName": "http"}}}, True),
    ("routing-no-scorer", {"routing": {"scorerWeights": {"prefix": 0, "queue": 0, "kvCache": 0}}}, False),
    ("routing-negative-weight", {"routing": {"scorerWeights": {"prefix": -1}}}, False),
    ("routing-gateway-bad-name", {"routing": {"gateway": {"name": "Inference_Gateway"}}}, False),
    ("routing-disagg", {"routing": {}, **_disagg("on")}, False),
]
