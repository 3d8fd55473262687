"""InferenceDeployment types. Field descriptions become the CRD's (what `kubectl explain` shows); bounds and
defaults become schema bounds and defaults; cross-field rules are CEL `x-kubernetes-validations` on the models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkpilot.contract import engine_settings as defaults
from chunkpilot.contract.knobs import DISAGG_NEVER, Knobs, SchedulerKnobs
from chunkpilot.contract.slo import (CLASS_HEADERS, DEFAULT_QUANTILE, MAX_SLO_CLASSES, LatencyTarget, SLOClass,
                                     SLOClasses, SLOTargets)

GROUP = "chunkpilot.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]

MODEL_SOURCE_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hostpath:///.+|image:///.+|hf://[^@\s]+(@[^\s]+)?)$"
# a draft model comes from a volume or the image; not hf:// (one download init container, one cache claim per pod)
DRAFT_MODEL_SOURCE_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hostpath:///.+|image:///.+)$"
DRAFT_MODEL_RULE_MESSAGE = "draftModel is set exactly when method is draft_model"


def _cel(*rules: tuple[str, str]) -> dict:
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class ModelSpec(_Model):
    source: str = Field(
        ..., pattern=MODEL_SOURCE_PATTERN,
        description="Where the Hugging Face model folder comes from: pvc://CLAIM/PATH (a PersistentVolumeClaim), "
                    "hostpath:///PATH (a node directory), image:///PATH (baked into the engine image), or "
                    "hf://REPO@REVISION (downloaded by an init container; needs internet in the cluster).",
    )
    served_name: str | None = Field(None, alias="servedName", max_length=253,
                                    description="Model name clients send; default: the resource's name.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV-cache dtype; auto = the checkpoint's dtype on GPUs.")
    max_model_len: int | None = Field(None, alias="maxModelLen", ge=16, le=1_048_576,
                                      description="Prompt plus output limit in tokens; default: the model's own.")
    quantization: Literal["none", "int8", "int4", "fp8"] = Field(
        "none", description="Weight-only quantization of the linear layers at load time (the engine's "
                            "--quantization): int8 (per channel) or int4 (groups of 32) on the CPU (resources.gpus "
                            "0), fp8 on Hopper GPUs. The pod refuses to start on a method its device cannot run.")
    cache_claim: str | None = Field(
        None, alias="cacheClaim", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="hf:// only: a PersistentVolumeClaim (ReadWriteMany for more than one replica) to download "
                    "into and keep across restarts; default: an emptyDir of downloadSizeLimit, fetched again on "
                    "every pod start.")
    download_size_limit: str = Field(
        "200Gi", alias="downloadSizeLimit", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$",
        description="hf:// only: the size limit of the emptyDir the model is downloaded into (without cacheClaim).")
    hf_token_secret: str | None = Field(
        None, alias="hfTokenSecret", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[-._a-zA-Z0-9]+)?$",
        description="hf:// only: SECRET or SECRET:KEY (default key: token) holding a Hub token, for gated models.")


class ResourcesSpec(_Model):
    gpus: int = Field(1, ge=0, le=16, description="GPUs per pod, requested as nvidia.com/gpu; 0 runs on the CPU.")
    cpu: str | None = Field(None, description="CPU request and limit, e.g. \"4\".")
    memory: str | None = Field(None, description="Memory request and limit, e.g. \"32Gi\".")


class EnvVar(_Model):
    name: str = Field(..., min_length=1, description="Variable name.")
    value: str = Field("", description="Variable value.")


class LocalObjectReference(_Model):
    name: str = Field(..., min_length=1, description="Name of the Secret.")


class SpeculativeSpec(_Model):
    """Speculative decoding (the engine's --speculative-config): a proposer drafts tokens, the model verifies them
    in one step, the output distribution unchanged."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        ("!has(self.promptLookupMin) || !has(self.promptLookupMax) || self.promptLookupMin <= self.promptLookupMax",
         "promptLookupMin must be <= promptLookupMax"),
        ("(has(self.method) && self.method == 'draft_model') == has(self.draftModel)", DRAFT_MODEL_RULE_MESSAGE)))

    method: Literal[defaults.SPECULATIVE_METHODS] = Field(  # type: ignore[valid-type]
        "ngram", description="ngram: prompt lookup (drafts the tokens that followed the last n tokens' earlier "
                             "occurrence); pays off where outputs repeat their prompt. draft_model: a smaller "
                             "model with the same tokenizer (draftModel) drafts greedily.")
    draft_model: str | None = Field(
        None, alias="draftModel", pattern=DRAFT_MODEL_SOURCE_PATTERN,
        description="method draft_model only: where the draft model's folder comes from, as spec.model.source: "
                    "pvc://CLAIM/PATH, hostpath:///PATH or image:///PATH (hf:// is not offered here: download it "
                    "to a volume). It must share the model's tokenizer; it runs beside the model on rank 0's "
                    "device with a KV pool of as many blocks as the model's (on GPUs leave it room below "
                    "gpuMemoryUtilization).")
    num_speculative_tokens: int = Field(defaults.NUM_SPECULATIVE_TOKENS, alias="numSpeculativeTokens", ge=1,
                                        le=defaults.MAX_SPECULATIVE_TOKENS,
                                        description="Draft tokens a decode verifies per step (each costs a token "
                                                    "of the step's budget).")
    prompt_lookup_min: int = Field(defaults.PROMPT_LOOKUP[0], alias="promptLookupMin", ge=1, le=16,
                                   description="Shortest n-gram the lookup matches.")
    prompt_lookup_max: int = Field(defaults.PROMPT_LOOKUP[1], alias="promptLookupMax", ge=1, le=16,
                                   description="Longest n-gram the lookup matches (tried first).")
    disable_by_batch_size: int | None = Field(None, alias="disableByBatchSize", ge=1, le=4096,
                                              description="No drafts in a step with more decodes than this.")

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeSpec":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("promptLookupMin must be <= promptLookupMax")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError(f"{DRAFT_MODEL_RULE_MESSAGE}: set draftModel with method draft_model, or neither")
        return self

    def engine_config(self, draft_model_path: str | None = None) -> str:
        """The engine's --speculative-config JSON, in vLLM's field names; `draft_model_path`: where the pod mounts
        draftModel."""
        import json

        out: dict = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "draft_model":
            if not draft_model_path:
                raise ValueError("method draft_model needs the draft model's path in the pod")
            out["model"] = draft_model_path
        else:
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(out, separators=(",", ":"))


class EngineSpec(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        ("!has(self.tensorParallelSize) || (self.resources.gpus == 0 ? self.tensorParallelSize == 1 : "
         "self.resources.gpus % self.tensorParallelSize == 0)",
         "resources.gpus must divide evenly by tensorParallelSize (each rank runs on a GPU of its own); "
         "without GPUs it must be 1")))

    image: str | None = Field(None, description="Engine image; default: the operator's --engine-image.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Per-pod resources.")
    tensor_parallel_size: int | None = Field(
        None, alias="tensorParallelSize", ge=1, le=16,
        description="GPUs one engine splits the model across (tensor parallelism; the engine starts one worker "
                    "process per GPU in its container). Default: resources.gpus. It must divide the model's "
                    "attention heads; GPUs beyond it stay idle.")
    gpu_memory_utilization: float = Field(0.85, alias="gpuMemoryUtilization", ge=0.05, le=0.99,
                                          description="Fraction of GPU memory for weights plus KV cache.")
    max_num_seqs: int = Field(defaults.MAX_NUM_SEQS, alias="maxNumSeqs", ge=1, le=4096,
                              description="Cap on sequences running at once in one pod.")
    prefix_caching: bool = Field(True, alias="prefixCaching", description="Reuse KV blocks of shared prefixes.")
    speculative: SpeculativeSpec | None = Field(None, description="Speculative decoding; off when absent.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables for the engine.")
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs",
                                  description="Extra `chunkpilot engine serve` arguments.")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector", description="Pod node selector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations (core/v1 Toleration).")
    affinity: dict[str, Any] | None = Field(None, description="Pod affinity (core/v1 Affinity).")
    priority_class_name: str | None = Field(None, alias="priorityClassName", description="Pod priority class.")
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, alias="imagePullSecrets",
                                                           description="Secrets for pulling the engine image.")
    pod_annotations: dict[str, str] = Field(default_factory=dict, alias="podAnnotations",
                                            description="Annotations added to the engine pods.")

    @property
    def effective_tensor_parallel_size(self) -> int:
        return self.tensor_parallel_size or max(1, self.resources.gpus)


class SchedulerSpec(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        ("self.maxChunk <= self.tokenBudget", "maxChunk must be <= tokenBudget")))

    token_budget: int = Field(defaults.TOKEN_BUDGET, alias="tokenBudget", ge=1, le=1_048_576,
                              description="Tokens per engine step: one per running decode, the rest on prefill chunks.")
    max_chunk: int = Field(defaults.MAX_CHUNK, alias="maxChunk", ge=1, le=1_048_576,
                           description="Largest prefill chunk of one prompt in one step.")

    @property
    def knobs(self) -> Knobs:
        return Knobs(self.token_budget, self.max_chunk)


class LatencySLO(_Model):
    percentile: float = Field(DEFAULT_QUANTILE, gt=0, lt=1,
                              description="Quantile the threshold applies to, e.g. 0.99.")
    threshold_seconds: float = Field(..., alias="thresholdSeconds", gt=0, description="Latency limit in seconds.")


class SLOSpec(_Model):
    ttft: LatencySLO | None = Field(None, description="Time-to-first-token objective.")
    itl: LatencySLO | None = Field(None, description="Inter-token latency objective.")

    @property
    def targets(self) -> SLOTargets:
        """The one SLO value type (chunkpilot.contract.slo) every part judges latency against: the spec's
        `percentile` is already a quantile (0.99), so it carries over as it is."""
        def target(t: LatencySLO | None) -> LatencyTarget | None:
            return None if t is None else LatencyTarget(t.percentile, t.threshold_seconds)
        return SLOTargets(ttft=target(self.ttft), itl=target(self.itl))


SLO_CLASS_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"


class SLOClassSpec(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        ("!has(self.queueLimit) || (has(self.priority) && self.priority < 0)",
         "queueLimit is for sheddable classes: set priority below 0, or remove queueLimit")))

    name: str = Field(..., pattern=SLO_CLASS_NAME_PATTERN, max_length=63,
                      description=f"What a request names to be served in this class: the {CLASS_HEADERS[0]} header, "
                                  "the Inference Extension's objective header, or OpenAI's service_tier.")
    priority: int = Field(0, ge=-1000, le=1000, description="Higher is more important; below 0 is sheddable (the "
                                                            "Gateway API Inference Extension's polarity).")
    default: bool = Field(False, description="Requests that name no class are served in this one (at most one "
                                             "class; none marked: the first).")
    ttft: LatencySLO | None = Field(None, description="This class's time-to-first-token objective.")
    itl: LatencySLO | None = Field(None, description="This class's inter-token latency objective: each step is "
                                                     "sized so the tightest running one is kept.")
    share: float = Field(0.0, ge=0, le=1, description="The least share of each step's prompt tokens this class gets "
                                                      "while it has prompt work and others compete (0: none kept).")
    queue_limit: int | None = Field(None, alias="queueLimit", ge=0, description="Sheddable classes: requests of "
                                    "this class allowed to wait; beyond it HTTP 429 with Retry-After.")

    @property
    def slo_class(self) -> SLOClass:
        def target(t: LatencySLO | None) -> LatencyTarget | None:
            return None if t is None else LatencyTarget(t.percentile, t.threshold_seconds)
        return SLOClass(self.name, self.priority, SLOTargets(target(self.ttft), target(self.itl)), self.share,
                        self.queue_limit)


# One class marked default at most, in CEL (cheap: one pass). Distinct names and the shares' sum are the operator's
# (pydantic, SLO_CLASSES_MESSAGE): a pairwise name check in CEL was over the API server's cost budget for a list of
# 8 (the CRD was refused).
SLO_CLASSES_RULE_MESSAGE = "spec.sloClasses: at most one class may be marked default"
SLO_CLASSES_RULE = "!has(self.sloClasses) || self.sloClasses.filter(c, has(c.default) && c.default).size() <= 1"
SLO_CLASSES_MESSAGE = "spec.sloClasses: names must be distinct, and at most one class may be marked default"


def slo_classes(spec: "InferenceDeploymentSpec") -> SLOClasses | None:
    """The spec's classes as the engine, the tuner and the operator take them; None without spec.sloClasses.
    ValueError (the contract's message) for what the schema cannot say."""
    if not spec.slo_classes:
        return None
    default = next((c.name for c in spec.slo_classes if c.default), spec.slo_classes[0].name)
    return SLOClasses(tuple(c.slo_class for c in spec.slo_classes), default)


class Range(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        ("self.min <= self.max", "min must be <= max")))

    min: int = Field(..., ge=1, le=1_048_576, description="Lowest value the tuner may choose.")
    max: int = Field(..., ge=1, le=1_048_576, description="Highest value the tuner may choose; the engine also "
                                                          "refuses budgets its GPU memory cannot hold.")


class TuningBounds(_Model):
    token_budget: Range = Field(default_factory=lambda: Range(min=defaults.TUNING_BUDGET_BOUNDS[0],
                                                              max=defaults.TUNING_BUDGET_BOUNDS[1]), alias="tokenBudget",
                                description="Token budget range.")
    max_chunk: Range = Field(default_factory=lambda: Range(min=defaults.TUNING_CHUNK_BOUNDS[0],
                                                           max=defaults.TUNING_CHUNK_BOUNDS[1]), alias="maxChunk",
                             description="Max chunk range.")


class TuningSpec(_Model):
    mode: Literal["off", "advisory", "auto"] = Field(
        "off", description="off: knobs stay as in spec.scheduler; advisory: the tuner only recommends; "
                           "auto: the tuner applies its choices to the pods while they serve.")
    bounds: TuningBounds = Field(default_factory=TuningBounds, description="Search space.")
    window_seconds: int = Field(60, alias="windowSeconds", ge=5, le=3600, description="Length of one measurement window.")
    warmup_seconds: int = Field(10, alias="warmupSeconds", ge=0, le=600, description="Skipped after every change.")
    max_trials: int = Field(30, alias="maxTrials", ge=1, le=1000, description="Trials before exploiting the best.")
    objective: Literal["goodput", "throughput"] = Field("goodput", description="What to maximize within the SLOs.")
    guidance: Literal["model", "blackbox"] = Field(
        "model", description="model: try only knobs a step-time model, fitted on the engines' own steps while they "
                             "serve, predicts to keep the SLOs (and say NoFeasibleKnobs when none can); blackbox: "
                             "Optuna alone, for comparison. With spec.sloClasses the search is Optuna's (the "
                             "model predicts a first-come-first-served step).")


class AutoscalingSpec(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        ("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas")))

    mode: Literal["off", "recommend", "auto"] = Field(
        "off", description="off: replicas stay as in spec.replicas; recommend: the tuner writes "
                           "status.autoscaling.desiredReplicas and the chunkpilot:tuner_desired_replicas metric for "
                           "an HPA (external metrics) or KEDA to act on; auto: the tuner sets spec.replicas itself "
                           "through the scale subresource, knobs first, replicas when no knobs meet the SLOs. auto "
                           "is refused while a HorizontalPodAutoscaler targets this resource.")
    min_replicas: int = Field(1, alias="minReplicas", ge=1, le=1000, description="Fewest replicas the tuner asks for.")
    max_replicas: int = Field(4, alias="maxReplicas", ge=1, le=1000, description="Most replicas the tuner asks for.")
    scale_up_stabilization_seconds: int = Field(
        0, alias="scaleUpStabilizationSeconds", ge=0, le=3600,
        description="As an HPA's behavior.scaleUp.stabilizationWindowSeconds: scale up to the lowest "
                    "recommendation of this window.")
    scale_down_stabilization_seconds: int = Field(
        300, alias="scaleDownStabilizationSeconds", ge=0, le=3600,
        description="As an HPA's behavior.scaleDown.stabilizationWindowSeconds: scale down to the highest "
                    "recommendation of this window.")
    target_prefill_utilization: float = Field(
        0.8, alias="targetPrefillUtilization", gt=0, le=0.95,
        description="Prompt tokens arriving per second over the prefill capacity of the replicas at the best "
                    "knobs: the tuner asks for the fewest replicas that keep it at or below this share and the "
                    "SLOs predicted met.")


# The autoscaling modes each tuning mode allows: the one rule, checked by the CRD's CEL (admission) and by the
# tuner (for objects stored before the rule). Advisory tuning changes nothing, so it may only recommend replicas.
AUTOSCALING_ALLOWED = {"off": ("off",), "advisory": ("off", "recommend"), "auto": ("off", "recommend", "auto")}
AUTOSCALING_RULE_MESSAGE = ("autoscaling needs the tuner, and auto scaling needs auto tuning (advisory tuning "
                            "changes nothing, so it only recommends): set tuning.mode to auto, or autoscaling.mode "
                            "to recommend (with advisory tuning) or off")
# (schema defaults fill both fields on the API server; the has() guards keep the rule total without them)
AUTOSCALING_RULE = "!has(self.autoscaling) || " + " || ".join(
    f"((has(self.tuning) ? self.tuning.mode : 'off') == '{t}' && "
    f"self.autoscaling.mode in [{', '.join(repr(m) for m in ms)}])" for t, ms in AUTOSCALING_ALLOWED.items())


def autoscaling_refusal(tuning_mode: str, autoscaling_mode: str) -> str:
    """Why this pair of modes is refused ("" when allowed): the CEL rule AUTOSCALING_RULE, in Python."""
    return "" if autoscaling_mode in AUTOSCALING_ALLOWED.get(tuning_mode, ()) else AUTOSCALING_RULE_MESSAGE


class MonitoringSpec(_Model):
    service_monitor: bool = Field(False, alias="serviceMonitor",
                                  description="Create a Prometheus Operator ServiceMonitor (when its CRD exists).")


# Prefill/decode disaggregation (spec.disaggregation): the roles a disaggregated deployment runs pods of, in the
# engine's own names (engine_settings.ROLES without "both", which is every pod of a deployment without it).
DISAGGREGATED_ROLES: tuple[str, ...] = tuple(r for r in defaults.ROLES if r != "both")
# Each role's pods carry their role twice, in our label and in llm-d's, whose inference scheduler's prefill/decode
# filters select pods by `llm-d.ai/role`; the Services select by ours. In mode auto the operator moves both as a pod
# switches roles.
ROLE_LABEL = f"{GROUP}/role"
LLMD_ROLE_LABEL = "llm-d.ai/role"
DISAGG_REPLICAS_RULE_MESSAGE = ("disaggregation.mode on needs at least one pod of each role (prefill pods compute "
                                "the long prompts, decode pods serve the clients), and mode auto at least one "
                                "decode pod (it may start with no prefill pod: colocated): set "
                                "disaggregation.decode.replicas (and, with mode on, disaggregation.prefill.replicas) "
                                "to 1 or more, or disaggregation.mode to off")
DISAGG_REPLICAS_RULE = ("!has(self.mode) || self.mode == 'off' || "
                        "((self.mode == 'auto' || "
                        "(has(self.prefill) && has(self.prefill.replicas) ? self.prefill.replicas : 1) >= 1) && "
                        "(has(self.decode) && has(self.decode.replicas) ? self.decode.replicas : 1) >= 1)")


class RoleSpec(_Model):
    """The pods of one role of a disaggregated deployment."""

    replicas: int = Field(1, ge=0, le=1000, description="Pods of this role (at least 1 with mode on, and decode "
                                                          "pods with mode auto; in mode auto the split the pods "
                                                          "start in, which the tuner may move).")
    knobs: SchedulerSpec | None = Field(
        None, description="This role's initial scheduler knobs, in place of spec.scheduler for its pods (a prefill "
                          "pod runs long prompts alone and can take a larger budget and chunk than a decode pod). As "
                          "spec.scheduler's, the tuner's knobs replace the decode pods' in tuning.mode auto; the "
                          "prefill pods keep these (the tuner measures the clients' latencies on the decode pods "
                          "and has nothing to tune a prefill pod's knobs by).")


class DisaggregationSpec(_Model):
    """Prefill/decode disaggregation: prefill pods compute long prompts and hand their KV blocks to decode pods,
    which serve the clients, so a long prompt never stalls the running decodes of the pod it arrives at."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        (DISAGG_REPLICAS_RULE, DISAGG_REPLICAS_RULE_MESSAGE)))

    mode: Literal["off", "on", "auto"] = Field(
        "off", description="off: every pod prefills and decodes (spec.replicas pods; absent is off); on: "
                           "prefill.replicas prefill pods behind a headless Service and decode.replicas decode pods "
                           "behind the client Service, a Deployment per role; auto: one Deployment of "
                           "prefill.replicas + decode.replicas pods whose roles switch while they serve (no "
                           "restart): the operator keeps prefill.replicas of them prefill pods, or with tuning.mode "
                           "auto the tuner's split (status.scheduler.prefillPods, 0 for colocated); the tuner "
                           "searches the decode pods' threshold beside the knobs and the split (colocated measured "
                           "first; status.scheduler.disaggThreshold). "
                           "Quote it in YAML (\"on\", \"off\"): YAML 1.1, which kubectl reads, "
                           "takes a bare on or off for a boolean, and the API server then refuses it as one.")
    threshold: int = Field(defaults.DISAGG_THRESHOLD, ge=0, le=1_048_576,
                           description="Uncached prompt tokens above which a decode pod has a prefill pod compute "
                                       "the prompt; at or below it the decode pod prefills it itself, chunked. "
                                       "The pods' start-up value: in mode auto with tuning.mode auto the tuner's "
                                       "choice replaces it.")
    transport: Literal[defaults.KV_TRANSPORTS] = Field(  # type: ignore[valid-type]
        defaults.KV_TRANSPORTS[0], description="How KV blocks move between the pods: nixl (NVIDIA's transfer "
                                               "library over UCX; between pods over TCP).")
    lease_seconds: float = Field(defaults.KV_LEASE_SECONDS, alias="leaseSeconds", gt=0, le=3600,
                                 description="Seconds a prefill pod holds the blocks of a prompt it computed until "
                                             "the decode pod that asked takes them; released earlier on "
                                             "acknowledgement or abort.")
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="The prefill pods.")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="The decode pods, which the clients reach.")

    @model_validator(mode="after")
    def _both_roles_run(self) -> "DisaggregationSpec":
        if self.enabled and (self.prefill.replicas < (0 if self.live else 1) or self.decode.replicas < 1):
            raise ValueError(DISAGG_REPLICAS_RULE_MESSAGE)
        return self

    @property
    def enabled(self) -> bool:
        """on and auto alike: prefill and decode pods."""
        return self.mode != "off"

    @property
    def live(self) -> bool:
        """auto: one Deployment whose pods switch roles while they serve (--live-roles), split by the operator."""
        return self.mode == "auto"

    @property
    def pods(self) -> int:
        """Every engine pod of both roles."""
        return self.prefill.replicas + self.decode.replicas

    def role(self, name: str) -> RoleSpec:
        if name not in DISAGGREGATED_ROLES:
            raise ValueError(f"no role {name!r}: one of {', '.join(DISAGGREGATED_ROLES)}")
        return self.prefill if name == "prefill" else self.decode


# Prefix- and load-aware routing (spec.routing) through the Gateway API Inference Extension (GIE): an InferencePool of
# the resource's pods and an endpoint picker (EPP) a Gateway asks for every request (docs/routing.md).
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"  # the EPP picks its metric names by this pod label
ENGINE_TYPE = "chunkpilot"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


ROUTING_WEIGHTS_RULE_MESSAGE = ("routing.scorerWeights leaves no scorer (all three are 0): give queue, kvCache or "
                                "prefix a weight of 1 or more, or remove spec.routing to use the Service")
ROUTING_WEIGHTS_RULE = ("(has(self.queue) ? self.queue : 2) + (has(self.kvCache) ? self.kvCache : 2) + "
                        "(has(self.prefix) ? self.prefix : 3) > 0")


class ScorerWeights(_Model):
    """How much each of the endpoint picker's scorers counts when it ranks the pods for a request (GIE's default
    profile: 2, 2, 3). 0 leaves a scorer out."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        (ROUTING_WEIGHTS_RULE, ROUTING_WEIGHTS_RULE_MESSAGE)))

    queue: int = Field(2, ge=0, le=100, description="Fewer requests waiting (chunkpilot:num_requests_waiting) "
                                                    "scores higher.")
    kv_cache: int = Field(2, alias="kvCache", ge=0, le=100,
                          description="More free KV cache (chunkpilot:kv_cache_usage_perc) scores higher.")
    prefix: int = Field(3, ge=0, le=100, description="A pod that most likely holds the longest prefix of the "
                                                     "prompt in its prefix cache (the picker's own index of what "
                                                     "it sent where, sized from chunkpilot:cache_config_info) "
                                                     "scores higher.")

    @model_validator(mode="after")
    def _some_scorer(self) -> "ScorerWeights":
        if self.queue + self.kv_cache + self.prefix == 0:
            raise ValueError(ROUTING_WEIGHTS_RULE_MESSAGE)
        return self


class GatewayRef(_Model):
    """A Gateway (Envoy Gateway, kgateway, Istio, GKE) whose traffic for this model an HTTPRoute sends to the
    resource's InferencePool."""

    name: str = Field(..., pattern=_DNS_SUBDOMAIN, max_length=253, description="The Gateway's name.")
    namespace: str | None = Field(None, pattern=_DNS_LABEL, max_length=63,
                                  description="The Gateway's namespace (absent: the resource's).")
    section_name: str | None = Field(None, alias="sectionName", pattern=_DNS_SUBDOMAIN, max_length=253,
                                     description="One of the Gateway's listeners (absent: all of them).")


class RoutingSpec(_Model):
    """Prefix- and load-aware routing: the operator renders an InferencePool of the engine pods and an endpoint
    picker for it; a Gateway that supports the Gateway API Inference Extension asks the picker which pod serves
    each request. Without it the clients reach the pods through the Service, which picks one at random."""

    scorer_weights: ScorerWeights = Field(default_factory=ScorerWeights, alias="scorerWeights",
                                          description="The endpoint picker's scorers and their weights.")
    gateway: GatewayRef | None = Field(None, description="Also an HTTPRoute from this Gateway to the pool (absent: "
                                                         "route to the InferencePool yourself).")
    bundled_gateway: bool = Field(False, alias="bundledGateway",
                                  description="Also an Envoy in front of the picker, for a cluster without a Gateway "
                                              "that supports the Inference Extension: clients send their requests "
                                              "to the Service <name>-gateway on port 8000 (status.routing.url).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailOpen", alias="failureMode",
        description="What a Gateway does with a request while the picker cannot answer (it restarts, or is gone): "
                    "FailOpen sends it to a pod of its own choosing, FailClose refuses it (the InferencePool's "
                    "endpointPickerRef.failureMode). The bundled gateway holds the request and asks the picker "
                    "again for about 15 s, in either mode.")


# What the engine cannot disaggregate yet, refused by the CRD's CEL (admission) and by the Python check below
# (objects stored before the rule, and the operator's own parse), with one message each. The has() guards keep each
# rule total where schema defaults were not filled in.
_DISAGG_ON = ("has(self.disaggregation) && has(self.disaggregation.mode) && self.disaggregation.mode != 'off'")
DISAGG_TP_RULE_MESSAGE = ("disaggregation needs tensorParallelSize 1 for now (the engine moves the KV blocks of "
                          "one rank): set engine.tensorParallelSize to 1 (or leave it unset with "
                          "engine.resources.gpus 1, or 0 for the CPU), or disaggregation.mode to off")
DISAGG_TP_RULE = (f"!({_DISAGG_ON}) || (has(self.engine) && has(self.engine.tensorParallelSize) ? "
                  "self.engine.tensorParallelSize : (has(self.engine) && has(self.engine.resources) && "
                  "has(self.engine.resources.gpus) ? self.engine.resources.gpus : 1)) <= 1")
DISAGG_DRAFT_RULE_MESSAGE = ("disaggregation does not work with a draft model yet (the draft model's KV cache is "
                             "not handed over with the model's): use engine.speculative.method ngram, remove "
                             "engine.speculative, or set disaggregation.mode to off")
DISAGG_DRAFT_RULE = (f"!({_DISAGG_ON}) || !(has(self.engine) && has(self.engine.speculative) && "
                     "has(self.engine.speculative.method) && self.engine.speculative.method == 'draft_model')")
DISAGG_AUTOSCALING_RULE_MESSAGE = ("autoscaling sets spec.replicas, which a disaggregated deployment does not use "
                                   "(it runs disaggregation.prefill.replicas and disaggregation.decode.replicas "
                                   "pods): set autoscaling.mode to off, or disaggregation.mode to off")
DISAGG_AUTOSCALING_RULE = (f"!({_DISAGG_ON}) || !has(self.autoscaling) || !has(self.autoscaling.mode) || "
                           "self.autoscaling.mode == 'off'")
ROUTING_DISAGG_RULE_MESSAGE = ("routing does not work with disaggregation yet (the pool would have to follow the "
                               "pods' roles): remove spec.routing, or set disaggregation.mode to off")
ROUTING_DISAGG_RULE = f"!has(self.routing) || !({_DISAGG_ON})"


def disaggregation_refusal(spec: "InferenceDeploymentSpec") -> str:
    """Why this spec cannot be disaggregated ("" when it can, or when it is not): the CEL rules above, in Python."""
    d = spec.disaggregation
    if d is None or not d.enabled:
        return ""
    if spec.engine.effective_tensor_parallel_size > 1:
        return DISAGG_TP_RULE_MESSAGE
    if spec.engine.speculative is not None and spec.engine.speculative.method == "draft_model":
        return DISAGG_DRAFT_RULE_MESSAGE
    if spec.autoscaling.mode != "off":
        return DISAGG_AUTOSCALING_RULE_MESSAGE
    if spec.routing is not None:
        return ROUTING_DISAGG_RULE_MESSAGE
    return ""


# Which device each quantization method runs on (chunkpilot.engine.model.quantization): one rule for the CRD's CEL and
# the Python check below (objects stored before the rule, and the operator's own parse).
QUANTIZATION_RULE_MESSAGE = ("model.quantization int8 and int4 run on the CPU (engine.resources.gpus 0) and fp8 on "
                             "Hopper GPUs (engine.resources.gpus 1 or more): change one of them, or set it to none")
QUANTIZATION_RULE = ("!has(self.model.quantization) || self.model.quantization == 'none' || "
                     "((has(self.engine) && has(self.engine.resources) && has(self.engine.resources.gpus) ? "
                     "self.engine.resources.gpus : 1) > 0) == (self.model.quantization == 'fp8')")


class InferenceDeploymentSpec(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", json_schema_extra=_cel(
        (AUTOSCALING_RULE, AUTOSCALING_RULE_MESSAGE), (QUANTIZATION_RULE, QUANTIZATION_RULE_MESSAGE),
        (DISAGG_TP_RULE, DISAGG_TP_RULE_MESSAGE), (DISAGG_DRAFT_RULE, DISAGG_DRAFT_RULE_MESSAGE),
        (DISAGG_AUTOSCALING_RULE, DISAGG_AUTOSCALING_RULE_MESSAGE), (ROUTING_DISAGG_RULE, ROUTING_DISAGG_RULE_MESSAGE),
        (SLO_CLASSES_RULE, SLO_CLASSES_RULE_MESSAGE)))

    replicas: int = Field(1, ge=0, le=1000, description="Engine pods (with disaggregation on or auto: "
                                                        "disaggregation.prefill.replicas and decode.replicas "
                                                        "instead).")
    model: ModelSpec = Field(..., description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine pod settings.")
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec, description="Initial scheduler knobs.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency objectives.")
    slo_classes: list[SLOClassSpec] | None = Field(
        None, alias="sloClasses", max_length=MAX_SLO_CLASSES,
        description="Per-request SLO classes (docs/slo-classes.md): each request is served in the class it names "
                    "(or the default), each step is sized by the tightest running deadline; absent: one class, "
                    "spec.slo, first come first served. Changing them restarts the engine pods.")
    tuning: TuningSpec = Field(default_factory=TuningSpec, description="Online tuning of the scheduler knobs.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec,
                                         description="Replicas as the tuner's last knob (needs tuning.mode auto).")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Prometheus integration.")
    disaggregation: DisaggregationSpec | None = Field(
        None, description="Prefill/decode disaggregation; off when absent.")
    routing: RoutingSpec | None = Field(
        None, description="Prefix- and load-aware routing through the Gateway API Inference Extension (an "
                          "InferencePool and its endpoint picker); absent: the Service picks a pod at random.")

    @model_validator(mode="after")
    def _quantization_fits_the_device(self) -> "InferenceDeploymentSpec":
        q = self.model.quantization
        if q != "none" and (self.engine.resources.gpus > 0) != (q == "fp8"):
            raise ValueError(QUANTIZATION_RULE_MESSAGE)
        return self

    @model_validator(mode="after")
    def _slo_classes_are_consistent(self) -> "InferenceDeploymentSpec":
        if self.slo_classes:
            names = [c.name for c in self.slo_classes]
            if len(set(names)) != len(names) or sum(c.default for c in self.slo_classes) > 1:
                raise ValueError(SLO_CLASSES_MESSAGE)
            slo_classes(self)  # the contract's own checks (shares)
        return self

    @model_validator(mode="after")
    def _disaggregation_fits_the_engine(self) -> "InferenceDeploymentSpec":
        if why := disaggregation_refusal(self):
            raise ValueError(why)
        return self

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode in pods of their own (mode on or auto)."""
        return self.disaggregation is not None and self.disaggregation.enabled


def knob_refusal(spec: InferenceDeploymentSpec) -> str:
    """Why the spec's knobs, bounds and SLOs cannot be served or tuned ("" when they can): the cross-field rules the
    schema does not express, in one place. The operator refuses such a spec (InvalidSpec) and the tuner holds it
    (InvalidTuningSpec) with the same message; neither clamps it into something the user did not ask for."""
    seqs = spec.engine.max_num_seqs
    knobs = [("spec.scheduler", spec.scheduler)]
    if spec.disaggregated:  # a role's own start-up knobs go to its pods as spec.scheduler's go to all of them
        knobs += [(f"spec.disaggregation.{r}.knobs", k) for r in DISAGGREGATED_ROLES
                  if (k := spec.disaggregation.role(r).knobs) is not None]
    for where, scheduler in knobs:
        try:  # the knobs' own rules are the contract's one validation, the engine's and the knobs file's
            SchedulerKnobs.of(scheduler.knobs).validated(min_token_budget=seqs)
        except ValueError as e:
            return (f"{where}.tokenBudget {scheduler.token_budget} and maxChunk {scheduler.max_chunk} "
                    f"with spec.engine.maxNumSeqs {seqs}: {e}")
    if spec.tuning.mode == "off":
        return ""
    bounds = spec.tuning.bounds
    if bounds.token_budget.min < seqs:
        return (f"spec.tuning.bounds.tokenBudget.min ({bounds.token_budget.min}) must be >= spec.engine.maxNumSeqs "
                f"({seqs}): the engine refuses smaller budgets")
    if bounds.max_chunk.min > bounds.token_budget.max:
        return "spec.tuning.bounds.maxChunk.min must be <= spec.tuning.bounds.tokenBudget.max"
    if spec.slo.ttft is None and spec.slo.itl is None:
        return "tuning needs at least one SLO: set spec.slo.ttft or spec.slo.itl (or tuning.mode: off)"
    return ""


class ConditionType:
    """The types of status.conditions, each with one writer: the operator sets Ready, Progressing and Degraded,
    the tuner Tuning, Autoscaling and SLOMet (chunkpilot.kube.conditions replaces only the writer's own). Alerts,
    dashboards and users' `kubectl wait --for=condition=...` match these strings: they are the API."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    TUNING = "Tuning"
    AUTOSCALING = "Autoscaling"
    SLO_MET = "SLOMet"
    # with spec.sloClasses, one more per class: SLOMet.<class> (a valid condition type: class names begin and end
    # with a letter or digit), so `kubectl wait --for=condition=SLOMet.interactive` and alerts see each class
    CLASS_SLO_MET_PREFIX = SLO_MET + "."

    @staticmethod
    def slo_met_of(slo_class: str) -> str:
        return ConditionType.CLASS_SLO_MET_PREFIX + slo_class


class Condition(_Model):
    type: str = Field(..., description="Ready, Progressing, Degraded, Tuning, Autoscaling, SLOMet, and with "
                                        "spec.sloClasses SLOMet.<class> for each class.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="Condition status.")
    reason: str = Field("", description="CamelCase reason.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str | None = Field(None, alias="lastTransitionTime", description="RFC 3339 time.")
    observed_generation: int | None = Field(None, alias="observedGeneration", description="Generation seen.")


# status' words for a threshold: the number, or DISAGG_NEVER for "never" (chunkpilot.contract.knobs owns both)
_THRESHOLD_WORDS = (f"Uncached prompt tokens above which the decode pods send a prompt to a prefill pod; "
                    f"{DISAGG_NEVER} means never (every prompt prefilled on the decode pod, as colocated).")


class SchedulerStatus(_Model):
    token_budget: int = Field(..., alias="tokenBudget", description="Token budget the pods should apply.")
    max_chunk: int = Field(..., alias="maxChunk", description="Max chunk the pods should apply.")
    source: Literal["spec", "tuner"] = Field("spec", description="Who chose these knobs.")
    generation: int = Field(0, ge=0, description="Knob generation; pods export the one they applied.")
    disagg_threshold: int | None = Field(
        None, alias="disaggThreshold", ge=0, le=DISAGG_NEVER,
        description="Disaggregation mode auto with tuning mode auto: the threshold the tuner chose for the decode "
                    "pods (absent: disaggregation.threshold, the pods' start-up setting, holds). " + _THRESHOLD_WORDS)
    prefill_pods: int | None = Field(
        None, alias="prefillPods", ge=0,
        description="Disaggregation mode auto with tuning mode auto: how many of the pods the tuner chose to serve as "
                    "prefill pods, the rest decode (0: colocated); the operator switches roles to match, at most all "
                    "pods but one. Absent: disaggregation.prefill.replicas.")
    prefill_token_budget: int | None = Field(
        None, alias="prefillTokenBudget", ge=1,
        description="Disaggregation mode auto with tuning mode auto, on a split: the token budget the tuner chose for "
                    "the prefill pods, which is their max chunk too (tokenBudget and maxChunk go to the decode "
                    "pods). Absent: the prefill pods run disaggregation.prefill.knobs, else spec.scheduler.")

    @classmethod
    def of(cls, knobs: Knobs, *, source: str, generation: int) -> "SchedulerStatus":
        return cls(token_budget=knobs.token_budget, max_chunk=knobs.max_chunk, source=source, generation=generation,
                   disagg_threshold=knobs.disagg_threshold, prefill_pods=knobs.prefill_pods,
                   prefill_token_budget=knobs.prefill_budget)

    @property
    def knobs(self) -> Knobs:
        return Knobs(self.token_budget, self.max_chunk, self.disagg_threshold, self.prefill_pods,
                     self.prefill_token_budget)


class PodKnobs(_Model):
    pod: str = Field(..., description="Engine pod.")
    role: Literal[DISAGGREGATED_ROLES] | None = Field(  # type: ignore[valid-type]
        None, description="With disaggregation: the pod's role, whose knobs it should run.")
    started: str | None = Field(None, description="When its engine container started (a restart voids the "
                                                  "acknowledgement: the pod is asked again).")
    token_budget: int = Field(..., alias="tokenBudget", description="Token budget the pod reported applying.")
    max_chunk: int = Field(..., alias="maxChunk", description="Max chunk the pod reported applying.")
    generation: int = Field(0, ge=0, description="Knob generation the pod reported applying.")
    disagg_threshold: int | None = Field(None, alias="disaggThreshold", ge=0,
                                         description="Decode pods: the disaggregation threshold the pod reported "
                                                     "applying, where its knobs carry one. " + _THRESHOLD_WORDS)

    @property
    def scheduler_knobs(self) -> SchedulerKnobs:
        return SchedulerKnobs(self.token_budget, self.max_chunk, self.generation, self.disagg_threshold)


class KnobsStatus(_Model):
    """What the operator delivered and what each ready pod acknowledged: written by the operator alone."""

    token_budget: int = Field(..., alias="tokenBudget", description="Token budget delivered to the pods.")
    max_chunk: int = Field(..., alias="maxChunk", description="Max chunk delivered to the pods.")
    generation: int = Field(0, ge=0, description="Generation of the knobs delivered.")
    disagg_threshold: int | None = Field(None, alias="disaggThreshold", ge=0,
                                         description="The disaggregation threshold delivered to the decode pods, "
                                                     "where the tuner chose one. " + _THRESHOLD_WORDS)
    source: Literal["spec", "tuner"] = Field("spec", description="Whose knobs: spec.scheduler, or the tuner's "
                                                                 "status.scheduler (tuning.mode auto).")
    applied_replicas: int = Field(0, alias="appliedReplicas", ge=0,
                                  description="Ready pods that acknowledged these knobs.")
    pods: list[PodKnobs] = Field(default_factory=list, description="What each ready pod acknowledged applying.")

    @property
    def scheduler_knobs(self) -> SchedulerKnobs:
        return SchedulerKnobs(self.token_budget, self.max_chunk, self.generation, self.disagg_threshold)

    def applied_everywhere(self, knobs: SchedulerKnobs, ready_replicas: int,
                           prefill: SchedulerKnobs | None = None) -> bool:
        """Every ready pod acknowledged exactly `knobs` (values and generation) as its role runs them: the tuner's
        wait. A prefill pod runs its role's own knobs (desired_knobs): `prefill` where the tuner chose them, else
        whatever the spec gives it."""
        return (self.scheduler_knobs == knobs and len(self.pods) >= max(1, ready_replicas)
                and all(p.scheduler_knobs == knobs for p in self.pods if p.role != "prefill")
                and (prefill is None or all(p.scheduler_knobs == prefill for p in self.pods if p.role == "prefill")))


class KnobsMeasurement(_Model):
    token_budget: int = Field(..., alias="tokenBudget", description="Token budget.")
    max_chunk: int = Field(..., alias="maxChunk", description="Max chunk.")
    disagg_threshold: int | None = Field(None, alias="disaggThreshold", ge=0,
                                         description="Disaggregation threshold of the decode pods, where the tuner "
                                                     "searches it. " + _THRESHOLD_WORDS)
    prefill_pods: int | None = Field(None, alias="prefillPods", ge=0,
                                     description="Pods serving as prefill pods, where the tuner searches the split "
                                                 "(0: colocated).")
    prefill_token_budget: int | None = Field(None, alias="prefillTokenBudget", ge=1,
                                             description="The prefill pods' token budget and max chunk, where the "
                                                         "tuner searches the split.")
    objective: float | None = Field(None, description="Objective value measured.")
    ttft_seconds: float | None = Field(None, alias="ttftSeconds", description="Measured TTFT at the SLO percentile.")
    itl_seconds: float | None = Field(None, alias="itlSeconds", description="Measured ITL at the SLO percentile.")
    feasible: bool | None = Field(None, description="The tuner's judgement: every SLO met within its margin (90 % of "
                                  "each threshold), the queue keeping up, and prompt demand within 80 % of the "
                                  "prefill capacity. The SLOMet condition judges the SLOs themselves.")


class TuningStatus(_Model):
    mode: str = Field("off", description="Mode in effect.")
    phase: Literal["Exploring", "Exploiting", "Holding", "Advisory", "Scaling", "Off"] = Field(
        "Off", description="Tuner phase (Scaling: the replicas change or not every pod is ready; no trial runs).")
    trial: int = Field(0, ge=0, description="Trials recorded so far.")
    current: KnobsMeasurement | None = Field(None, description="Knobs being measured now.")
    best: KnobsMeasurement | None = Field(None, description="Best feasible knobs so far.")
    recommendation: KnobsMeasurement | None = Field(None, description="Advisory mode: what the tuner would apply.")
    last_change: str | None = Field(None, alias="lastChange", description="When the knobs last changed.")
    reason: str = Field("", description="Why the tuner is in this phase.")
    feasible: bool | None = Field(None, description="Model-guided tuning: whether any knobs in bounds are predicted "
                                                    "(or were measured) to keep the SLOs at the measured load.")
    replicas_needed: int | None = Field(None, alias="replicasNeeded", ge=1,
                                        description="When no knobs are feasible: the replicas predicted to meet the "
                                                    "SLOs at the closest knobs (absent: more would not help).")


class AutoscalingStatus(_Model):
    mode: str = Field("off", description="Mode in effect (auto falls back to recommend while refused).")
    desired_replicas: int | None = Field(None, alias="desiredReplicas", ge=0,
                                         description="Replicas the tuner recommends now, within min and max, after "
                                                     "stabilization.")
    needed_replicas: int | None = Field(None, alias="neededReplicas", ge=0,
                                        description="Replicas predicted to keep the SLOs at the best knobs, before the "
                                                    "bounds (above maxReplicas: the bound is too low for the load).")
    current_replicas: int | None = Field(None, alias="currentReplicas", ge=0, description="spec.replicas seen.")
    last_scale_time: str | None = Field(None, alias="lastScaleTime", description="When the tuner last scaled.")
    reason: str = Field("", description="Why the tuner recommends these replicas.")


class ClassSLOStatus(_Model):
    """One SLO class (spec.sloClasses) as the tuner's last window measured it."""

    name: str = Field(..., description="The class.")
    ttft_seconds: float | None = Field(None, alias="ttftSeconds", description="Measured TTFT at the class's "
                                                                              "percentile.")
    itl_seconds: float | None = Field(None, alias="itlSeconds", description="Measured ITL at the class's percentile.")
    attainment: float | None = Field(None, ge=0, le=1, description="Fraction of the class's finished requests "
                                                                   "that kept its SLOs.")
    met: bool | None = Field(None, description="The class's latency SLOs held over the window (unset: no traffic "
                                               "to judge). A sheddable class's is reported; it never makes SLOMet "
                                               "False.")


class SLOStatus(_Model):
    ttft_seconds: float | None = Field(None, alias="ttftSeconds", description="Measured TTFT at its percentile.")
    itl_seconds: float | None = Field(None, alias="itlSeconds", description="Measured ITL at its percentile.")
    attainment: float | None = Field(None, ge=0, le=1, description="Fraction of requests within the SLOs.")
    window_seconds: int | None = Field(None, alias="windowSeconds", description="Window measured.")
    classes: list[ClassSLOStatus] | None = Field(
        None, max_length=MAX_SLO_CLASSES, description="With spec.sloClasses: each class's latencies and attainment; "
                                                      "SLOMet is True when every non-sheddable class kept its SLOs.")


class RoleStatus(_Model):
    """One role's pods of a disaggregated deployment, and the knobs delivered to them."""

    replicas: int = Field(0, ge=0, description="Pods of this role that exist.")
    ready_replicas: int = Field(0, alias="readyReplicas", ge=0, description="Pods of this role ready to serve.")
    knobs: SchedulerStatus | None = Field(None, description="The knobs delivered to this role's pods: the role's "
                                                            "own, spec.scheduler's or the tuner's.")
    applied_replicas: int = Field(0, alias="appliedReplicas", ge=0,
                                  description="Ready pods of this role that acknowledged these knobs.")


class DisaggregationStatus(_Model):
    """The pods of each role (spec.disaggregation mode on or auto): written by the operator alone."""

    prefill: RoleStatus = Field(default_factory=RoleStatus, description="The prefill pods.")
    decode: RoleStatus = Field(default_factory=RoleStatus, description="The decode pods, which the clients reach.")


class RoutingStatus(_Model):
    """Where the clients' traffic goes with spec.routing: written by the operator alone."""

    inference_pool: str | None = Field(None, alias="inferencePool", description="The InferencePool "
                                       "(inference.networking.k8s.io/v1) of the engine pods: a Gateway's HTTPRoute "
                                       "names it as its backend.")
    endpoint_picker: str | None = Field(None, alias="endpointPicker",
                                        description="The endpoint picker's ext_proc address (host:port).")
    http_route: str | None = Field(None, alias="httpRoute", description="The HTTPRoute the operator renders "
                                                                        "(spec.routing.gateway).")
    url: str | None = Field(None, description="The bundled gateway's OpenAI base URL inside the cluster "
                                              "(spec.routing.bundledGateway).")
    message: str = Field("", description="Why there is no pool yet (the cluster lacks the InferencePool CRD).")


class InferenceDeploymentStatus(_Model):
    observed_generation: int | None = Field(None, alias="observedGeneration", description="Spec generation reconciled.")
    replicas: int = Field(0, description="Engine pods that exist.")
    ready_replicas: int = Field(0, alias="readyReplicas", description="Engine pods ready to serve.")
    selector: str | None = Field(None, description="Label selector of the pods (for the scale subresource).")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, Tuning, SLOMet.")
    scheduler: SchedulerStatus | None = Field(None, description="The tuner's knobs (tuning.mode auto): written by "
                                              "the tuner alone; the pods run them while the mode is auto.")
    knobs: KnobsStatus | None = Field(None, description="The knobs delivered to the pods and each ready pod's "
                                                        "acknowledgement: written by the operator alone.")
    tuning: TuningStatus | None = Field(None, description="Written by the tuner.")
    slo: SLOStatus | None = Field(None, description="Written by the tuner.")
    autoscaling: AutoscalingStatus | None = Field(None, description="Written by the tuner.")
    disaggregation: DisaggregationStatus | None = Field(
        None, description="Each role's pods and knobs (disaggregation on or auto): written by the operator alone.")
    routing: RoutingStatus | None = Field(None, description="The InferencePool and endpoint picker "
                                                            "(spec.routing): written by the operator alone.")


class InferenceDeployment(_Model):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    api_version: str = Field(f"{GROUP}/{VERSION}", alias="apiVersion")
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)


def prefill_pods(obj: InferenceDeployment) -> int:
    """Disaggregation mode auto: how many pods should serve as prefill pods now, one owner per mode as for the knobs:
    the tuner's choice (status.scheduler.prefillPods) once it chose one in tuning mode auto, else the spec's
    prefill.replicas. The operator switches roles to match (operator/role_split.py)."""
    d = obj.spec.disaggregation
    if d is None or not d.live:
        raise ValueError("only disaggregation mode auto splits its pods while they serve")
    st = obj.status.scheduler
    if obj.spec.tuning.mode == "auto" and st is not None and st.source == "tuner" and st.prefill_pods is not None:
        return st.prefill_pods
    return d.prefill.replicas


def desired_knobs(obj: InferenceDeployment,
                  role: str | None = None) -> tuple[SchedulerKnobs, Literal["spec", "tuner"]]:
    """The knobs the pods should run now, and whose they are: one owner per mode. In tuning mode auto, once the
    tuner has chosen, its status.scheduler; otherwise the spec's, under generation metadata.generation plus the
    tuner's last generation, so that every change of owner or of spec knobs gives a newer generation than any
    before it (a pod's acknowledgement of an older generation never passes for the new knobs). The operator
    delivers these; the tuner counts its next generation from them.

    With `role` (a disaggregated deployment's prefill or decode pods), the spec's knobs are the role's own
    (spec.disaggregation.<role>.knobs) where it has them, under the same generation (they are part of the spec);
    the tuner's budget and chunk, once chosen, go to the decode pods: the tuner measures the clients' TTFT and ITL
    on the decode pods and chose them (and, in disaggregation mode auto, the threshold) for them. A prefill pod
    computes prompts alone: in disaggregation mode auto, the tuner's prefill budget (status.scheduler.
    prefillTokenBudget, budget and chunk alike) where it chose one for a split; otherwise its role's own knobs (a
    large chunk, for its throughput). The spec's knobs carry no threshold: the pods' start-up --disagg-threshold
    (spec.disaggregation.threshold) holds until the tuner chooses one."""
    st = obj.status.scheduler
    d = obj.spec.disaggregation
    tuned = obj.spec.tuning.mode == "auto" and st is not None and st.source == "tuner"
    if tuned and role != "prefill":
        knobs = SchedulerKnobs.of(st.knobs, st.generation)
        if d is None or d.mode != "auto":  # a threshold left from an earlier auto: the spec's threshold holds now
            knobs = SchedulerKnobs(knobs.token_budget, knobs.max_chunk, knobs.generation)
        return knobs, "tuner"
    if tuned and d is not None and d.mode == "auto" and st.knobs.prefill_knobs is not None:
        return SchedulerKnobs.of(st.knobs.prefill_knobs, st.generation), "tuner"
    generation = int(obj.metadata.get("generation") or 0) + (st.generation if st is not None else 0)
    scheduler = obj.spec.scheduler
    if role is not None and obj.spec.disaggregation is not None:
        scheduler = obj.spec.disaggregation.role(role).knobs or scheduler
    return SchedulerKnobs.of(scheduler.knobs, generation), "spec"
