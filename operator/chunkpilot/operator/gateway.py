"""spec.routing.bundledGateway: an Envoy in front of the endpoint picker, for a cluster without a Gateway that
speaks the Gateway API Inference Extension, as GIE's own end-to-end test runs one. Every request's headers and body
go to the picker over ext_proc (FULL_DUPLEX_STREAMED); it answers with the pod in `x-gateway-destination-endpoint`,
and an ORIGINAL_DST cluster sends the request there (docs/routing.md).

While no picker answers (its pod restarts, or is replaced), Envoy holds each request and tries the picker again,
for about HOLD_SECONDS; then it answers 500. It cannot fail open (send the request on without a pick) in
FULL_DUPLEX_STREAMED, whatever failure_mode_allow says: the body has gone to the picker (Envoy 1.40 answers 500,
checked), so the pool's failureMode is for Gateways that can. Envoy drops a destination header a client sent
before anything reads it, so no client picks the address a request goes to."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

DESTINATION_HEADER = "x-gateway-destination-endpoint"
ENVOY_IMAGE = "docker.io/envoyproxy/envoy:v1.40.0"
PORT = 8000  # the engine's: a client moves from the Service to the gateway by its host name alone
ADMIN_PORT = 19000  # on the loopback only: the admin API can stop Envoy
CONFIG_FILE = "envoy.yaml"
ENVOY_UID = 65532
TYPES = "type.googleapis.com/envoy.extensions"
NO_PICK = ('{"error": {"message": "the endpoint picker chose no pod for this request", '
           '"type": "service_unavailable", "code": 503}}')
# how long a request waits for a picker: a picker pod's replacement is Ready in a few seconds. Envoy's back-off is
# jittered (each wait random up to the cap), so the hold is about half of retries x cap
PICKER_RETRIES, PICKER_BACKOFF_MAX = 30, 1.0
HOLD_SECONDS = PICKER_RETRIES * PICKER_BACKOFF_MAX / 2


@dataclass(frozen=True)
class Upstream:
    """Where Envoy sends something: host addresses (IPs, or names with `dns`) on one port."""

    hosts: tuple[str, ...]
    port: int
    dns: bool = False


def gateway_name(name: str) -> str:
    return f"{name}-gateway"


def gateway_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "chunkpilot-gateway", "app.kubernetes.io/instance": name}


def _cluster(name: str, to: Upstream, protocol: dict, **extra) -> dict:
    return {"name": name, "type": "STRICT_DNS" if to.dns else "STATIC", "connect_timeout": "5s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{TYPES}.upstreams.http.v3.HttpProtocolOptions", **protocol}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": h, "port_value": to.port}}}}
                for h in to.hosts]}]},
            **extra}


def envoy_config(listen_port: int, admin_port: int, picker: Upstream) -> dict:
    """Envoy's bootstrap: a listener on `listen_port` and the picker at `picker` over TLS without verification (its
    certificate is self-signed, as in GIE's e2e)."""
    # idle connections to the pods closed by Envoy first (the engine keeps them 75 s): a request sent on one the
    # engine is closing would be reset before its headers, a 503 (bench/routing.py saw it)
    http1 = {"common_http_protocol_options": {"idle_timeout": "60s"}, "explicit_http_config": {
        "http_protocol_options": {}}}
    # no route timeout: a generation streams for minutes. A request reset before any response (a kept connection
    # the pod closed as it drained, a pod gone) is sent again on a new connection: nothing of it ran
    to = {"timeout": "0s", "idle_timeout": "3600s",
          "retry_policy": {"retry_on": "reset-before-request,connect-failure,refused-stream", "num_retries": 2}}
    placed = {"match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
              "route": {"cluster": "original_destination_cluster", **to}}
    # the picker always places a request or answers it itself: this is a guard, never a way around it
    unplaced = {"match": {"prefix": "/"}, "direct_response": {"status": 503, "body": {"inline_string": NO_PICK}}}
    clusters = [
        {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "connect_timeout": "5s",
         "lb_policy": "CLUSTER_PROVIDED",
         "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
             "@type": f"{TYPES}.upstreams.http.v3.HttpProtocolOptions", **http1}},
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
        _cluster("ext_proc", picker, {"explicit_http_config": {"http2_protocol_options": {}}},
                 transport_socket={"name": "envoy.transport_sockets.tls", "typed_config": {
                     "@type": f"{TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
                     "common_tls_context": {"validation_context": {}}}}),
    ]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": f"{TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        # before routing and every filter: only the picker sets where a request goes
                        "early_header_mutation_extensions": [{
                            "name": "envoy.http.early_header_mutation.header_mutation",
                            "typed_config": {
                                "@type": f"{TYPES}.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                                "mutations": [{"remove": DESTINATION_HEADER}]}}],
                        "route_config": {"name": "pool", "virtual_hosts": [{
                            "name": "pool", "domains": ["*"], "routes": [placed, unplaced]}]},
                        "http_filters": [
                            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                                "@type": f"{TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
                                "grpc_service": {
                                    "envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s",
                                    # no picker listening (a restart): try again, the request held meanwhile
                                    "retry_policy": {
                                        "retry_on": "connect-failure,refused-stream,unavailable,reset",
                                        "num_retries": PICKER_RETRIES,
                                        "retry_back_off": {"base_interval": "0.25s",
                                                           "max_interval": f"{PICKER_BACKOFF_MAX}s"}}},
                                "processing_mode": {
                                    "request_header_mode": "SEND", "response_header_mode": "SEND",
                                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                                    "response_body_mode": "FULL_DUPLEX_STREAMED",
                                    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
                                "message_timeout": "1000s"}},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": f"{TYPES}.filters.http.router.v3.Router",
                                "suppress_envoy_headers": True}}]}}]}]}],
            "clusters": clusters}}


def objects(name: str, namespace: str, meta, image: str, *, picker: tuple[str, int]) -> list[dict]:
    """The bundled gateway of resource `name`: Envoy's bootstrap in a ConfigMap, a Deployment of it and a Service on
    PORT, with `meta(name)` the operator's metadata for a child. The picker by its Service's name in the cluster's
    DNS (the pod's search domains complete `<service>.<namespace>.svc`)."""
    gw = gateway_name(name)
    bootstrap = envoy_config(PORT, ADMIN_PORT, Upstream((f"{picker[0]}.{namespace}.svc",), picker[1], dns=True))
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(gw),
              "data": {CONFIG_FILE: yaml.safe_dump(bootstrap, sort_keys=False)}}
    container = {
        "name": "envoy", "image": image,
        # the official image's entrypoint runs envoy with arguments that start with a dash; ours is envoy itself
        "args": ["-c", f"/etc/envoy/{CONFIG_FILE}", "--log-level", "warn", "--disable-hot-restart",
                 # on SIGTERM stop taking new connections at once; the kubelet's grace period lets streams finish
                 "--drain-strategy", "immediate", "--drain-time-s", "60"],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy", "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(gw),
              "spec": {"replicas": 1, "selector": {"matchLabels": gateway_labels(name)},
                       "template": {"metadata": {"labels": gateway_labels(name)},
                                    "spec": {"containers": [container], "automountServiceAccountToken": False,
                                             "securityContext": {"runAsNonRoot": True, "runAsUser": ENVOY_UID,
                                                                 "seccompProfile": {"type": "RuntimeDefault"}},
                                             "volumes": [{"name": "config", "configMap": {"name": gw}}],
                                             "terminationGracePeriodSeconds": 130}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(gw),
               "spec": {"selector": gateway_labels(name), "type": "ClusterIP",
                        "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}]}}
    return [config, deploy, service]


def url(name: str, namespace: str) -> str:
    """The OpenAI base URL of the bundled gateway, inside the cluster."""
    return f"http://{gateway_name(name)}.{namespace}.svc:{PORT}/v1"
