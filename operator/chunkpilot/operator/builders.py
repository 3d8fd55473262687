"""Pure functions: an InferenceDeployment in, the Kubernetes objects it wants out. No API calls here, so every
object is testable against the real Kubernetes schemas without a cluster."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass

from chunkpilot.api.types import (DISAGGREGATED_ROLES, GROUP, KIND, LLMD_ROLE_LABEL, ROLE_LABEL, VERSION,
                                  InferenceDeployment, desired_knobs, knob_refusal, slo_classes)
from chunkpilot.contract import engine_settings as defaults
from chunkpilot.contract.knobs import dumps_knobs
from chunkpilot.operator import policy, routing, rules
from chunkpilot.operator.policy import Policy

ENGINE_PORT = 8000
# The knobs admin endpoint (engine/serving/admin.py): a port of its own so that the NetworkPolicy admits the operator
# alone.
ADMIN_PORT = 8001
ADMIN_TOKEN_DIR = "/var/run/chunkpilot/admin"
ADMIN_TOKEN_KEY = "token"
KNOBS_DIR = "/etc/chunkpilot"
KNOBS_FILE = "knobs.json"
MODELS_DIR = "/models"
DRAFT_MODEL_DIR = "/draft-model"  # speculative decoding's draft model, beside the model
CACHE_DIR = "/cache"
ENGINE_UID = 10001
# The annotation on the pod template that changes whenever something that needs a restart changes
# (image, model, resources, engine flags) and never when only the knobs do.
CONFIG_HASH = routing.CONFIG_HASH  # one key: the picker's and the bundled gateway's templates carry it too
# Shutdown, in order: preStop sleeps while endpoints stop sending new requests to the pod; then SIGTERM, and the
# engine lets in-flight requests finish for its grace period, aborts the rest with an error event and gives those
# streams a few seconds to flush (engine/serving/server.py FLUSH_SECONDS); the kubelet's grace period covers all of it.
PRESTOP_SECONDS = 5
ENGINE_GRACE_SECONDS = 30
# (+ 5 s for aborted streams to flush, + 15 s for the lifespan's shutdown: the step thread joins within 10 s)
TERMINATION_GRACE_SECONDS = PRESTOP_SECONDS + ENGINE_GRACE_SECONDS + 5 + 15
# NCCL moves data between the ranks of one pod through /dev/shm; the container runtime's default is 64 MiB.
SHM_SIZE_LIMIT = "2Gi"
# The named port of the client Service (and the prefill pods' headless one) that a ServiceMonitor scrapes: the
# engine's own listener serves /metrics.
METRICS_PORT = 9090
# UCX's transports for the KV handover between the pods: TCP, and `self` within a process. Pods on one node do not
# share /dev/shm (each has an IPC namespace of its own), and UCX would otherwise choose shared memory for a peer on
# the same node and fail to map the other pod's segment.
UCX_TLS = "tcp,self"


@dataclass(frozen=True)
class OperatorSettings:
    engine_image: str = "ghcr.io/chunkpilot/engine:0.1.0"
    hf_download_image: str | None = None  # None: the pod's engine image, which has `chunkpilot model download`
    hf_endpoint: str | None = None  # HF_ENDPOINT for hf:// downloads (a mirror); None: huggingface.co
    startup_timeout_seconds: int = 900
    # "secret:key" in each InferenceDeployment's namespace: the engine then requires this API key on /v1/*.
    engine_api_key_secret: str | None = None
    policy: Policy = Policy()
    # Requests for engine pods whose spec sets no cpu or memory: without them the pod would be BestEffort, the
    # first to be evicted under node pressure.
    default_cpu_request: str = "1"
    default_memory_request: str = "4Gi"
    # A NetworkPolicy per InferenceDeployment: only pods of its own namespace, and of these namespaces (e.g. where
    # Prometheus or the gateway run), may reach the engine port. On by default: /metrics, /docs, /openapi.json and
    # the probes answer without the API key (as vLLM's), so only the network keeps other tenants' pods from them.
    engine_network_policy: bool = True
    network_policy_namespaces: tuple[str, ...] = ()
    # Labels on every engine ServiceMonitor, so that the admin's Prometheus selects it (kube-prometheus-stack
    # selects by `release: <its release>`); the chart passes monitoring.prometheus.release and
    # monitoring.serviceMonitor.labels.
    service_monitor_labels: tuple[tuple[str, str], ...] = ()
    # The key each InferenceDeployment's admin token is derived from (HMAC of its uid), so every operator replica
    # and every restart derive the same token without reading Secrets back (the operator may create and patch
    # Secrets, never read them). The chart keeps it in a Secret of its own.
    admin_token_key: str = ""
    # Where the operator runs, so the NetworkPolicy admits exactly its pods to the admin port; None (an operator
    # outside the cluster): no pod is admitted to it, and the knobs arrive through the ConfigMap alone.
    operator_namespace: str | None = None
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    # The endpoint picker of spec.routing (operator/routing.py): an image the admin chose, never the user's spec,
    # since its pod reads the namespace's pods
    epp_image: str = routing.EPP_IMAGE
    # spec.routing.bundledGateway's Envoy (operator/gateway.py), the admin's choice for the same reason
    envoy_image: str = routing.gateway.ENVOY_IMAGE


class SpecError(ValueError):
    """A spec the schema accepted but the operator cannot act on; the message says what to change."""


def labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "chunkpilot-engine", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/managed-by": "chunkpilot-operator", f"{GROUP}/inference-deployment": name}


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "chunkpilot-engine", "app.kubernetes.io/instance": name}


def role_labels(role: str) -> dict[str, str]:
    return {ROLE_LABEL: role, LLMD_ROLE_LABEL: role}


def role_selector(name: str, role: str) -> dict[str, str]:
    """The pods of one role of a disaggregated resource (the Deployment's selector, its Service's, its PDB's)."""
    return {**selector_labels(name), ROLE_LABEL: role}


def role_name(name: str, role: str | None) -> str:
    """A child's name: the resource's own without disaggregation, `<name>-prefill` / `<name>-decode` per role."""
    return name if role is None else f"{name}-{role}"


def prefill_peers(obj: InferenceDeployment) -> str:
    """What decode pods send long prompts to: the prefill pods' headless Service, whose name resolves to every ready
    prefill pod (the engine resolves it again every second), in the `<service>.<namespace>.svc` form the chart uses
    for its own Services (no cluster domain assumed)."""
    ns = obj.metadata.get("namespace", "default")
    return f"{role_name(obj.metadata['name'], 'prefill')}.{ns}.svc:{ENGINE_PORT}"


def live(obj: InferenceDeployment) -> bool:
    """Disaggregation mode auto: one Deployment whose pods switch roles while they serve (role_split.py)."""
    return obj.spec.disaggregation is not None and obj.spec.disaggregation.live


def roles(obj: InferenceDeployment) -> tuple[str | None, ...]:
    """The roles to render Deployments for: (None,) for a single Deployment (no disaggregation, or mode auto's pods
    of either role), the disaggregated roles for mode on's Deployment per role."""
    return DISAGGREGATED_ROLES if obj.spec.disaggregated and not live(obj) else (None,)


def pod_count(obj: InferenceDeployment, role: str | None = None) -> int:
    """The pods a Deployment of the resource should have: spec.replicas, mode auto's pods of both roles, or one
    role's in mode on."""
    if role is not None:
        return obj.spec.disaggregation.role(role).replicas
    return obj.spec.disaggregation.pods if live(obj) else obj.spec.replicas


def owner_reference(obj: InferenceDeployment) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": obj.metadata["name"],
            "uid": obj.metadata["uid"], "controller": True, "blockOwnerDeletion": True}


def _meta(obj: InferenceDeployment, name: str) -> dict:
    return {"name": name, "namespace": obj.metadata.get("namespace", "default"), "labels": labels(obj.metadata["name"]),
            "ownerReferences": [owner_reference(obj)]}


def knobs_configmap_name(name: str) -> str:
    return f"{name}-knobs"


def knobs_file(role: str | None) -> str:
    """The key of the knobs ConfigMap a pod reads: one for every pod, or one per role (each role's own knobs)."""
    return KNOBS_FILE if role is None else f"knobs-{role}.json"


def served_name(obj: InferenceDeployment) -> str:
    return obj.spec.model.served_name or obj.metadata["name"]


def admin_token_secret_name(name: str) -> str:
    return f"{name}-knobs-token"


def admin_token(obj: InferenceDeployment, settings: OperatorSettings) -> str:
    """The bearer token of this resource's admin endpoints: derived, never stored in the operator, and bound to
    the uid, so a resource recreated under the same name gets another."""
    msg = f"{obj.metadata.get('namespace', 'default')}/{obj.metadata['name']}/{obj.metadata.get('uid', '')}"
    return hmac.new(settings.admin_token_key.encode(), msg.encode(), hashlib.sha256).hexdigest()


def admin_token_secret(obj: InferenceDeployment, settings: OperatorSettings) -> dict:
    token = base64.b64encode(admin_token(obj, settings).encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(obj, admin_token_secret_name(obj.metadata["name"])), "data": {ADMIN_TOKEN_KEY: token}}


def validate(obj: InferenceDeployment, settings: OperatorSettings = OperatorSettings()) -> None:
    """What the CRD schema cannot check; raises SpecError naming the field and the fix, or PolicyError when the
    operator's settings forbid it."""
    spec = obj.spec
    for i, e in enumerate(spec.engine.env):
        if why := rules.env_refusal(e.name, e.value):
            raise SpecError(f"spec.engine.env[{i}] {e.name}: {why}")
    for i, arg in enumerate(spec.engine.extra_args):
        if why := rules.arg_refusal(arg):
            raise SpecError(f"spec.engine.extraArgs[{i}]: {why}")
    policy.check(spec, settings.policy, settings.engine_image)
    if why := knob_refusal(spec):
        raise SpecError(why)
    model_source(obj)
    draft_model_source(obj)


def model_source(obj: InferenceDeployment, settings: OperatorSettings = OperatorSettings(),
                 ) -> tuple[str, list[dict], list[dict], list[dict]]:
    """(model path inside the pod, volumes, volume mounts, init containers) for spec.model.source."""
    src = obj.spec.model.source
    if src.startswith("hf://"):
        return _hub_download(obj, settings)
    mounted = _mounted_source(src, "model", MODELS_DIR)
    if mounted is None:
        raise SpecError(f"spec.model.source {src!r} has an unknown scheme; use pvc://, hostpath://, image:// or hf://")
    return (*mounted, [])


def draft_model_source(obj: InferenceDeployment) -> tuple[str | None, list[dict], list[dict]]:
    """(draft model path inside the pod, volumes, volume mounts) for spec.engine.speculative.draftModel; no path
    without a draft model."""
    spec = obj.spec.engine.speculative
    if spec is None or spec.draft_model is None:
        return None, [], []
    mounted = _mounted_source(spec.draft_model, "draft-model", DRAFT_MODEL_DIR)
    if mounted is None:
        raise SpecError(f"spec.engine.speculative.draftModel {spec.draft_model!r} has an unknown scheme; use "
                        "pvc://, hostpath:// or image://")
    return mounted


def _mounted_source(src: str, volume: str, mount_dir: str) -> tuple[str, list[dict], list[dict]] | None:
    """A model folder on a volume or in the image: (its path in the pod, volumes, mounts); None for other schemes."""
    mount = [{"name": volume, "mountPath": mount_dir, "readOnly": True}]
    if src.startswith("pvc://"):
        claim, _, sub = src.removeprefix("pvc://").partition("/")
        vol = {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return f"{mount_dir}/{sub}".rstrip("/"), [vol], mount
    if src.startswith("hostpath://"):
        vol = {"name": volume, "hostPath": {"path": src.removeprefix("hostpath://"), "type": "Directory"}}
        return mount_dir, [vol], mount
    if src.startswith("image://"):
        return src.removeprefix("image://"), [], []
    return None


def _hub_download(obj: InferenceDeployment, settings: OperatorSettings) -> tuple[str, list[dict], list[dict], list[dict]]:
    """hf://REPO@REV: an init container of the engine image runs `chunkpilot model download` (huggingface_hub,
    pinned with the engine; nothing is installed at run time) into a size-limited emptyDir, or into a PVC that
    keeps the files across restarts (a complete file is not fetched again)."""
    model = obj.spec.model
    repo, _, rev = model.source.removeprefix("hf://").partition("@")
    rev = rev or "main"
    if model.cache_claim:
        dest = f"{MODELS_DIR}/hf/{repo}/{rev}"
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": model.cache_claim}}
    else:
        dest = f"{MODELS_DIR}/model"
        volume = {"name": "model", "emptyDir": {"sizeLimit": model.download_size_limit}}
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf-home"},
           {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if settings.hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": settings.hf_endpoint})
    if model.hf_token_secret:
        secret, _, key = model.hf_token_secret.partition(":")
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": key or "token"}}})
    init = {
        "name": "download-model", "image": settings.hf_download_image or obj.spec.engine.image or settings.engine_image,
        # an argv, no shell; "--" so that a repository name cannot pass for an option
        "command": ["chunkpilot", "model", "download", f"--revision={rev}", f"--dest={dest}", "--", repo],
        "env": env,
        "volumeMounts": [{"name": "model", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",  # a failed download says why in the pod status
    }
    return dest, [volume], [{"name": "model", "mountPath": MODELS_DIR, "readOnly": True}], [init]


def _container_security() -> dict:
    return {"runAsNonRoot": True, "runAsUser": ENGINE_UID, "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def knobs_configmap(obj: InferenceDeployment) -> dict:
    """The durable copy of the desired knobs, which a (re)started pod begins from; running pods get them pushed.
    Disaggregated, a file per role: each role may start from knobs of its own."""
    data = {knobs_file(role): dumps_knobs(desired_knobs(obj, role)[0]) for role in roles(obj)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(obj, knobs_configmap_name(obj.metadata["name"])),
            "data": data}


def engine_env(obj: InferenceDeployment, model_path: str,
               settings: OperatorSettings = OperatorSettings(), role: str | None = None) -> list[dict]:
    """The engine container's env; with `role`, that of a disaggregated resource's prefill or decode pods."""
    spec = obj.spec
    values = {
        "model": model_path,
        "grace_period": str(ENGINE_GRACE_SECONDS),
        "port": str(ENGINE_PORT),
        "served_model_name": served_name(obj),
        "knobs_file": f"{KNOBS_DIR}/{knobs_file(role)}",
        "admin_port": str(ADMIN_PORT),
        "admin_token_file": f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
        # Start-up knobs only: the mounted knobs file is applied before the first request, and the knobs must
        # stay out of the pod template so that changing them never restarts pods.
        "token_budget": str(max(defaults.TOKEN_BUDGET, spec.engine.max_num_seqs)),
        "max_chunk": str(defaults.MAX_CHUNK),
        "max_num_seqs": str(spec.engine.max_num_seqs),
        "dtype": spec.model.dtype,
        "device": "cuda" if spec.engine.resources.gpus > 0 else "cpu",
        "gpu_memory_utilization": str(spec.engine.gpu_memory_utilization),
        "enable_prefix_caching": "true" if spec.engine.prefix_caching else "false",
        "tensor_parallel_size": str(spec.engine.effective_tensor_parallel_size),
        # a model that cannot load ends the container with its error as the termination message (pod_trouble.py)
        "exit_on_load_failure": "true",
    }
    if spec.model.max_model_len:
        values["max_model_len"] = str(spec.model.max_model_len)
    if spec.model.quantization != "none":
        values["quantization"] = spec.model.quantization
    if spec.engine.speculative is not None:
        values["speculative_config"] = spec.engine.speculative.engine_config(draft_model_source(obj)[0])
    if (classes := slo_classes(spec)) is not None:
        values["slo_classes"] = classes.to_json()
    if role is not None:
        values.update(_role_settings(obj, role))
    elif live(obj):
        values.update(_live_settings(obj))
    # the env names come from the settings' one declaration (a KeyError here is a setting that does not exist)
    env = {defaults.BY_NAME[name].env: value for name, value in values.items()}
    out = [{"name": k, "value": v} for k, v in env.items()]
    if live(obj):
        # the role a (re)started engine begins in is its pod's role label, which the operator moves (role_split.py):
        # a container that restarts comes back in the role its pod serves in, read at its start
        out.append({"name": defaults.BY_NAME["role"].env,
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{ROLE_LABEL}']"}}})
    if role is not None or live(obj):
        out.append({"name": "UCX_TLS", "value": UCX_TLS})  # UCX's own variable, no engine setting (see UCX_TLS)
    if settings.engine_api_key_secret:
        secret, _, key = settings.engine_api_key_secret.partition(":")
        out.append({"name": defaults.BY_NAME["api_key"].env,
                    "valueFrom": {"secretKeyRef": {"name": secret, "key": key or "api-key"}}})
    # The user's first: of two entries with one name the last wins, so the operator's would, even if validate()
    # had let a clash through.
    return [{"name": e.name, "value": e.value} for e in spec.engine.env] + out


def _role_settings(obj: InferenceDeployment, role: str) -> dict[str, str]:
    """The disaggregation settings of one role's pods: a prefill pod holds what it computed for its lease; a decode
    pod knows its prefill peers and when to use them. Both ends of a KV handover name the transport."""
    d = obj.spec.disaggregation
    if d is None or not d.enabled:  # roles(obj) names roles only for a disaggregated spec
        raise ValueError(f"role {role!r} needs spec.disaggregation.mode on or auto")
    out = {"role": role, "kv_transport": d.transport}
    if role == "prefill":
        out["kv_lease_seconds"] = str(d.lease_seconds)
    else:  # the engine refuses peers on a prefill pod, and a decode pod without them
        out.update(prefill_peers=prefill_peers(obj), disagg_threshold=str(d.threshold))
    return out


def _live_settings(obj: InferenceDeployment) -> dict[str, str]:
    """Mode auto's pods: both roles' settings, and --live-roles (the role itself comes from the pod's label)."""
    d = obj.spec.disaggregation
    return {"live_roles": "true", "kv_transport": d.transport, "kv_lease_seconds": str(d.lease_seconds),
            "prefill_peers": prefill_peers(obj), "disagg_threshold": str(d.threshold)}


def deployment(obj: InferenceDeployment, settings: OperatorSettings = OperatorSettings(),
               role: str | None = None) -> dict:
    """The engine pods: every pod of the resource, or with `role` those of one role of a disaggregated one."""
    name, spec = obj.metadata["name"], obj.spec
    model_path, volumes, mounts, inits = model_source(obj, settings)
    _, draft_volumes, draft_mounts = draft_model_source(obj)
    volumes, mounts = volumes + draft_volumes, mounts + draft_mounts
    res = spec.engine.resources
    limits: dict[str, str] = {}
    if res.gpus:
        limits["nvidia.com/gpu"] = str(res.gpus)
    if res.cpu:
        limits["cpu"] = res.cpu
    if res.memory:
        limits["memory"] = res.memory
    requests = {"cpu": settings.default_cpu_request, "memory": settings.default_memory_request, **limits}
    # Liveness on /health: it fails only when a restart helps (the load failed, the step loop died or hangs).
    # Start-up waits on /ready, so a load that fails or hangs past the start-up timeout restarts the pod.
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 3}
    ready = {"httpGet": {"path": "/ready", "port": "http"}, "timeoutSeconds": 3}
    container = {
        "name": "engine",
        "image": spec.engine.image or settings.engine_image,
        "args": list(spec.engine.extra_args),
        "env": engine_env(obj, model_path, settings, role),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
                  {"name": "admin", "containerPort": ADMIN_PORT, "protocol": "TCP"}],
        "resources": {"limits": limits, "requests": requests},
        "startupProbe": {**ready, "periodSeconds": 10,
                         "failureThreshold": max(1, settings.startup_timeout_seconds // 10)},
        "livenessProbe": {**probe, "failureThreshold": 3},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 2},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "volumeMounts": mounts + [{"name": "knobs", "mountPath": KNOBS_DIR, "readOnly": True},
                                  {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
                                  {"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": _container_security(),
        # an empty termination-log file: the kubelet takes the log's tail, which ends with the error
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    extra_volumes = []
    if spec.engine.effective_tensor_parallel_size > 1:
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        extra_volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}})
    template_annotations = dict(spec.engine.pod_annotations)
    template_annotations[CONFIG_HASH] = config_hash(obj, settings, role)
    pod_spec = {
        # The engine never calls the Kubernetes API: no token for whoever gets code to run in it.
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": ENGINE_UID, "fsGroup": ENGINE_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": inits,
        "containers": [container],
        "volumes": volumes + [
            {"name": "knobs", "configMap": {"name": knobs_configmap_name(name)}},
            {"name": "admin-token", "secret": {"secretName": admin_token_secret_name(name), "defaultMode": 0o440}},
            {"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}, *extra_volumes],
        "nodeSelector": dict(spec.engine.node_selector),
        "tolerations": list(spec.engine.tolerations),
        "imagePullSecrets": [{"name": s.name} for s in spec.engine.image_pull_secrets],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
    }
    if spec.engine.affinity:
        pod_spec["affinity"] = spec.engine.affinity
    if spec.engine.priority_class_name:
        pod_spec["priorityClassName"] = spec.engine.priority_class_name
    pod_spec = {k: v for k, v in pod_spec.items() if v not in ([], {})}
    meta, pod_labels = _meta(obj, role_name(name, role)), {**labels(name), **routing.pod_labels(obj)}
    if role is not None:
        meta["labels"] = pod_labels = {**pod_labels, **role_labels(role)}
    elif live(obj):
        # a new pod serves clients first; the operator then moves it to prefill if the split wants one more. The
        # selector leaves the role out, so a pod whose label moves stays its ReplicaSet's.
        pod_labels = {**pod_labels, **role_labels("decode")}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": pod_count(obj, role),
            "selector": {"matchLabels": selector_labels(name) if role is None else role_selector(name, role)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": pod_labels, "annotations": template_annotations}, "spec": pod_spec},
        },
    }


def config_hash(obj: InferenceDeployment, settings: OperatorSettings, role: str | None = None) -> str:
    """Everything in the pod that needs a restart to change; the knobs are deliberately left out (a role's replicas
    and knobs, and on versus auto, too)."""
    spec = obj.spec
    relevant = {"model": spec.model.model_dump(by_alias=True), "engine": spec.engine.model_dump(by_alias=True),
                "default_image": settings.engine_image}
    if role is not None:
        relevant["role"] = role
        relevant["disaggregation"] = _role_settings(obj, role)
    elif live(obj):
        relevant["disaggregation"] = _live_settings(obj)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def service(obj: InferenceDeployment) -> dict:
    """The Service clients reach: every engine pod, or disaggregated the decode pods alone (a prefill pod takes
    prompts from decode pods, never from a client)."""
    name = obj.metadata["name"]
    selector = role_selector(name, "decode") if obj.spec.disaggregated else selector_labels(name)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(obj, name),
            "spec": {"selector": selector, "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                # the same listener serves /metrics; a named port lets a ServiceMonitor select it
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def prefill_service(obj: InferenceDeployment) -> dict | None:
    """Disaggregated: the prefill pods' headless Service. Its name resolves to the address of every ready prefill
    pod, which is what a decode pod's --prefill-peers wants (it spreads prompts over them itself); a ClusterIP
    would hide them behind one address. It carries the metrics port too, with the client Service's labels, so the
    ServiceMonitor scrapes the prefill pods as well (as service `<name>-prefill`)."""
    if not obj.spec.disaggregated:
        return None
    name = obj.metadata["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(obj, role_name(name, "prefill")),
            "spec": {"clusterIP": "None", "selector": role_selector(name, "prefill"), "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def pod_disruption_budget(obj: InferenceDeployment, role: str | None = None) -> dict | None:
    """One pod at a time may be evicted, where there is more than one (one pod alone must stay evictable, or no
    node would drain); disaggregated, per role: evicting the last pod of either role stops the whole service."""
    name = obj.metadata["name"]
    replicas = pod_count(obj, role)
    if replicas <= 1:
        return None
    selector = selector_labels(name) if role is None else role_selector(name, role)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(obj, role_name(name, role)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}


def service_monitor(obj: InferenceDeployment, settings: OperatorSettings = OperatorSettings()) -> dict | None:
    if not obj.spec.monitoring.service_monitor:
        return None
    name = obj.metadata["name"]
    meta = _meta(obj, name)
    meta["labels"] = {**dict(settings.service_monitor_labels), **meta["labels"]}  # ours win: selectors use them
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
            "spec": {"selector": {"matchLabels": selector_labels(name)},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def network_policy(obj: InferenceDeployment, settings: OperatorSettings) -> dict | None:
    if not settings.engine_network_policy:
        return None
    name = obj.metadata["name"]
    peers = [{"podSelector": {}}] + [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
        for ns in settings.network_policy_namespaces]
    ingress = [{"from": peers, "ports": [{"port": "http", "protocol": "TCP"}]}]
    if settings.operator_namespace and settings.operator_pod_labels:  # else no one reaches the admin port
        ingress.append({"from": [{"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": settings.operator_namespace}},
                                  "podSelector": {"matchLabels": dict(settings.operator_pod_labels)}}],
                        "ports": [{"port": "admin", "protocol": "TCP"}]})
    if obj.spec.disaggregated:
        # The KV handover: decode pods reach prefill pods on the engine port (above), and UCX then connects the two
        # on ports it picks at random (its TCP transport listens on ephemeral ports, in either direction): every
        # TCP port between this resource's own engine pods, and no one else's.
        ingress.append({"from": [{"podSelector": {"matchLabels": selector_labels(name)}}],
                        "ports": [{"protocol": "TCP"}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(obj, name),
            "spec": {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def desired_objects(obj: InferenceDeployment, settings: OperatorSettings = OperatorSettings(),
                    *, service_monitor_crd: bool = False, pool_crd: bool = False) -> list[dict]:
    """All objects for one InferenceDeployment, after validate() passed (no half-applied sets). `pool_crd`: the
    cluster has GIE's InferencePool CRD, without which spec.routing renders nothing (the reconciler says so)."""
    validate(obj, settings)
    out = [knobs_configmap(obj), *(deployment(obj, settings, role) for role in roles(obj)), service(obj)]
    optionals = [prefill_service(obj), *(pod_disruption_budget(obj, role) for role in roles(obj)),
                 network_policy(obj, settings)]
    for optional in optionals:
        if optional:
            out.append(optional)
    sm = service_monitor(obj, settings) if service_monitor_crd else None
    if sm:
        out.append(sm)
    if obj.spec.routing is not None and pool_crd:
        out += routing.objects(obj, lambda n: _meta(obj, n), ENGINE_PORT, settings.epp_image,
                               selector_labels(obj.metadata["name"]), settings.envoy_image)
    return out


def optional_children(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child some spec of this resource may want and another may not, which a
    pass deletes when its spec does not (the knobs ConfigMap, the token Secret and the client Service exist as long
    as the resource): today's Deployment and each role's (disaggregation switched on or off), the prefill Service,
    the PDBs, the ServiceMonitor, the NetworkPolicy and the routing objects (spec.routing)."""
    per_role = [role_name(name, r) for r in DISAGGREGATED_ROLES]
    return [("apps/v1", "Deployment", n) for n in (name, *per_role)] + \
        [("v1", "Service", role_name(name, "prefill"))] + \
        [("policy/v1", "PodDisruptionBudget", n) for n in (name, *per_role)] + \
        [("monitoring.coreos.com/v1", "ServiceMonitor", name), ("networking.k8s.io/v1", "NetworkPolicy", name)] + \
        routing.optional_children(name)
