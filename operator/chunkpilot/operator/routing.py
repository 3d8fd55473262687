"""spec.routing's objects: the Gateway API Inference Extension's InferencePool of the resource's engine pods, the
endpoint picker (EPP) that a Gateway asks which pod serves each request, rendered as GIE's own chart renders it
(a ServiceAccount, a Role to read the pool and its pods, a ConfigMap with the picker's plugins, a Deployment, a
Service), and optionally an HTTPRoute from a named Gateway to the pool (docs/routing.md).

The picker reads chunkpilot's gauges by an engine configuration of its own (`chunkpilot`, the engine-type label the
pods carry, and the default for pods without one): the queue, running requests and KV-cache usage, and the cache
shape it sizes its prefix index from (chunkpilot:cache_config_info). LoRA is not scraped (`loraSpec: ""`), so the
picker does not log a missing metric on every poll."""

from __future__ import annotations

import hashlib
import json

from chunkpilot.api.types import ENGINE_TYPE, ENGINE_TYPE_LABEL, GROUP, InferenceDeployment, RoutingStatus
from chunkpilot.contract import metric_names as m
from chunkpilot.operator import gateway

# GIE's API groups and the version of the picker the operator renders by default (--epp-image)
POOL_API = "inference.networking.k8s.io/v1"
POOL_CRD = "inferencepools.inference.networking.k8s.io"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
ROUTE_API = "gateway.networking.k8s.io/v1"
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
# the picker's ports, as GIE's chart has them: Envoy's ext_proc, the gRPC health service its probes ask, metrics
GRPC_PORT, HEALTH_PORT, EPP_METRICS_PORT = 9002, 9003, 9090
CONFIG_FILE = "plugins.yaml"
CONFIG_DIR = "/config"
EPP_UID = 65532  # the distroless nonroot user of GIE's image
# neither the picker nor Envoy reads its config again: a pod template annotated with the config's hash rolls when
# the config changes
CONFIG_HASH = f"{GROUP}/config-hash"
NO_POOL_CRD = ("spec.routing is set but the cluster has no InferencePool CRD (inferencepools.inference.networking"
               ".k8s.io): install the Gateway API Inference Extension's CRDs (v1.5.0: kubectl apply -f https://github"
               ".com/kubernetes-sigs/gateway-api-inference-extension/releases/download/v1.5.0/manifests.yaml); "
               "until then the clients reach the pods through the Service")


def epp_name(name: str) -> str:
    return f"{name}-epp"


def epp_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "chunkpilot-epp", "app.kubernetes.io/instance": name}


def engine_config() -> dict:
    """The picker's metric names for chunkpilot's engines (its core-metrics-extractor's engineConfigs entry)."""
    return {"name": ENGINE_TYPE, "queuedRequestsSpec": m.NUM_WAITING, "runningRequestsSpec": m.NUM_RUNNING,
            "kvUsageSpec": m.KV_CACHE_USAGE, "loraSpec": "", "cacheInfoSpec": m.CACHE_CONFIG_INFO}


def picker_config(obj: InferenceDeployment) -> dict:
    """The EndpointPickerConfig: the three scorers with the spec's weights (a weight of 0 leaves its scorer out),
    the engines' /metrics as the data source, and chunkpilot's metric names."""
    w = obj.spec.routing.scorer_weights
    scorers = [(t, weight) for t, weight in (("queue-scorer", w.queue), ("kv-cache-utilization-scorer", w.kv_cache),
                                              ("prefix-cache-scorer", w.prefix)) if weight > 0]
    return {
        "apiVersion": f"{OBJECTIVE_GROUP}/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [*({"type": t} for t, _ in scorers),
                    {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
                    {"type": "core-metrics-extractor",
                     "parameters": {"engineLabelKey": ENGINE_TYPE_LABEL, "defaultEngine": ENGINE_TYPE,
                                    "engineConfigs": [engine_config()]}}],
        "schedulingProfiles": [{"name": "default",
                                "plugins": [{"pluginRef": t, "weight": weight} for t, weight in scorers]}],
    }


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def objects(obj: InferenceDeployment, meta, engine_port: int, epp_image: str, engine_selector: dict,
            envoy_image: str = gateway.ENVOY_IMAGE) -> list[dict]:
    """Every routing object of the resource (spec.routing set), with `meta(name)` the operator's metadata (owner
    reference, labels) for a child of that name."""
    name = obj.metadata["name"]
    ns = obj.metadata.get("namespace", "default")
    epp = epp_name(name)
    pool = {"apiVersion": POOL_API, "kind": "InferencePool", "metadata": meta(name),
            "spec": {"selector": {"matchLabels": engine_selector}, "targetPorts": [{"number": engine_port}],
                     "endpointPickerRef": {"name": epp, "port": {"number": GRPC_PORT},
                                           "failureMode": obj.spec.routing.failure_mode}}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(epp)}
    # least privilege, as GIE's chart: the pool, the objectives and rewrites that refine it, and the pods it picks
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(epp),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                      {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
                       "verbs": ["get", "list", "watch"]},
                      {"apiGroups": [OBJECTIVE_GROUP], "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                       "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(epp),
               "subjects": [{"kind": "ServiceAccount", "name": epp, "namespace": ns}],
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": epp}}
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(epp),
              "data": {CONFIG_FILE: json.dumps(picker_config(obj), indent=2)}}  # JSON is YAML
    out = [pool, account, role, binding, config, deployment(obj, meta, epp_image, config["data"][CONFIG_FILE]),
           service(obj, meta)]
    if obj.spec.routing.gateway is not None:
        out.append(http_route(obj, meta))
    if obj.spec.routing.bundled_gateway:
        parts = gateway.objects(name, ns, meta, envoy_image, picker=(epp, GRPC_PORT))
        template = parts[1]["spec"]["template"]["metadata"]
        template["annotations"] = {CONFIG_HASH: config_hash(parts[0]["data"][gateway.CONFIG_FILE])}
        out += parts
    return out


def deployment(obj: InferenceDeployment, meta, image: str, config: str) -> dict:
    name = obj.metadata["name"]
    epp = epp_name(name)
    health = {"grpc": {"port": HEALTH_PORT, "service": "inference-extension"}}
    container = {
        "name": "epp", "image": image,
        "args": ["--pool-name", name, "--pool-namespace", obj.metadata.get("namespace", "default"),
                 "--pool-group", "inference.networking.k8s.io", "--config-file", f"{CONFIG_DIR}/{CONFIG_FILE}",
                 "--grpc-port", str(GRPC_PORT), "--grpc-health-port", str(HEALTH_PORT),
                 "--metrics-port", str(EPP_METRICS_PORT), "--zap-encoder", "json", "--tracing=false",
                 # the picker's own metrics are scraped like the engines' (no token review: no cluster-wide RBAC)
                 "--metrics-endpoint-auth=false"],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "livenessProbe": {**health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**health, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(epp),
        "spec": {
            # one replica, as GIE's chart: the prefix index lives in the picker's memory, and two pickers would
            # each know half of what went where. A rollout starts the new picker before it stops the old one
            # (GIE's chart recreates, for its leader election, which one replica does not use): no gap
            "replicas": 1, "strategy": {"type": "RollingUpdate",
                                        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": epp_labels(name)},
            "template": {"metadata": {"labels": epp_labels(name), "annotations": {CONFIG_HASH: config_hash(config)}},
                         "spec": {"serviceAccountName": epp,
                                  "securityContext": {"runAsNonRoot": True, "runAsUser": EPP_UID,
                                                      "seccompProfile": {"type": "RuntimeDefault"}},
                                  "containers": [container],
                                  "volumes": [{"name": "config", "configMap": {"name": epp}}],
                                  # as GIE's chart: the longest grace period of the pool's pods, and some
                                  "terminationGracePeriodSeconds": 130}},
        },
    }


def service(obj: InferenceDeployment, meta) -> dict:
    name = obj.metadata["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(epp_name(name)),
            "spec": {"selector": epp_labels(name), "type": "ClusterIP",
                     "ports": [{"name": "grpc-ext-proc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                               {"name": "http-metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def http_route(obj: InferenceDeployment, meta) -> dict:
    """An HTTPRoute from the spec's Gateway to the pool: every path, as GIE's chart's default route."""
    name = obj.metadata["name"]
    gw = obj.spec.routing.gateway
    parent = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gw.name}
    if gw.namespace:
        parent["namespace"] = gw.namespace
    if gw.section_name:
        parent["sectionName"] = gw.section_name
    return {"apiVersion": ROUTE_API, "kind": "HTTPRoute", "metadata": meta(name),
            "spec": {"parentRefs": [parent],
                     "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": name}],
                                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                # a long generation streams for minutes: the Gateway's default timeout would cut it
                                "timeouts": {"request": "0s"}}]}}


def status(obj: InferenceDeployment, pool_crd: bool) -> RoutingStatus | None:
    """status.routing: where to send traffic (the pool a Gateway's route names, the picker's address), or why
    there is no pool; None without spec.routing."""
    if obj.spec.routing is None:
        return None
    if not pool_crd:
        return RoutingStatus(message=NO_POOL_CRD)
    name, ns = obj.metadata["name"], obj.metadata.get("namespace", "default")
    return RoutingStatus(inference_pool=name, endpoint_picker=f"{epp_name(name)}.{ns}.svc:{GRPC_PORT}",
                         http_route=name if obj.spec.routing.gateway is not None else None,
                         url=gateway.url(name, ns) if obj.spec.routing.bundled_gateway else None)


def pod_labels(obj: InferenceDeployment) -> dict[str, str]:
    """The label the picker chooses its metric names by, on the engine pods of a routed resource only (adding it to
    every resource's pod template would roll every pod at the operator's upgrade)."""
    return {ENGINE_TYPE_LABEL: ENGINE_TYPE} if obj.spec.routing is not None else {}


def optional_children(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the routing objects, deleted when spec.routing goes (or its gateway)."""
    epp = epp_name(name)
    return [(POOL_API, "InferencePool", name), ("v1", "ServiceAccount", epp),
            ("rbac.authorization.k8s.io/v1", "Role", epp), ("rbac.authorization.k8s.io/v1", "RoleBinding", epp),
            ("v1", "ConfigMap", epp), ("apps/v1", "Deployment", epp), ("v1", "Service", epp),
            (ROUTE_API, "HTTPRoute", name), *((v, k, gateway.gateway_name(name)) for v, k in (
                ("v1", "ConfigMap"), ("apps/v1", "Deployment"), ("v1", "Service")))]
