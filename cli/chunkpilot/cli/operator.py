"""`chunkpilot operator run`: the kopf operator that turns InferenceDeployments into engine pods."""

from __future__ import annotations

import logging
import re
from typing import Optional

import typer

app = typer.Typer(help="The Kubernetes operator for InferenceDeployment resources.", no_args_is_help=True)


@app.command("run")
def run(
    namespace: list[str] = typer.Option([], "--namespace", "-n", envvar="CHUNKPILOT_OPERATOR_NAMESPACES",
                                        help="Namespace to watch (repeat for more; globs like 'team-*' work). "
                                             "Default: all namespaces."),
    engine_image: str = typer.Option("ghcr.io/chunkpilot/engine:0.1.0", envvar="CHUNKPILOT_ENGINE_IMAGE",
                                     help="Engine image for InferenceDeployments that do not set spec.engine.image."),
    epp_image: str = typer.Option("", envvar="CHUNKPILOT_EPP_IMAGE",
                                  help="The Gateway API Inference Extension's endpoint picker image, for "
                                       "InferenceDeployments with spec.routing (docs/routing.md). Default: the "
                                       "v1.5.0 release's, from registry.k8s.io."),
    envoy_image: str = typer.Option("", envvar="CHUNKPILOT_ENVOY_IMAGE",
                                    help="Envoy's image, for InferenceDeployments with spec.routing.bundledGateway "
                                         "(docs/routing.md). Default: Envoy v1.40.0's, from docker.io."),
    hf_download_image: str = typer.Option("", envvar="CHUNKPILOT_HF_DOWNLOAD_IMAGE",
                                          help="Image of the init container that downloads hf:// models; it runs "
                                               "`chunkpilot model download`. Default: the pod's engine image."),
    hf_endpoint: str = typer.Option("", envvar="CHUNKPILOT_HF_ENDPOINT",
                                    help="Hugging Face Hub endpoint (HF_ENDPOINT) for hf:// downloads, e.g. a mirror "
                                         "inside the cluster. Default: huggingface.co."),
    startup_timeout: int = typer.Option(900, envvar="CHUNKPILOT_STARTUP_TIMEOUT_SECONDS",
                                        help="Seconds an engine pod may take to load its model before it is restarted."),
    engine_api_key_secret: Optional[str] = typer.Option(
        None, envvar="CHUNKPILOT_ENGINE_API_KEY_SECRET",
        help="SECRET:KEY in each InferenceDeployment's namespace; the engines then require that API key."),
    peering: Optional[str] = typer.Option(None, envvar="CHUNKPILOT_OPERATOR_PEERING",
                                          help="kopf peering name, for more than one operator replica (only the "
                                               "highest-priority replica acts). Needs kopf's peering CRDs and a "
                                               "peering object of that name (the chart creates it). "
                                               "Default: standalone."),
    priority: Optional[int] = typer.Option(None, envvar="CHUNKPILOT_OPERATOR_PRIORITY",
                                           help="This replica's peering priority. Default: a random one per process, "
                                                "so that one of a Deployment's identical replicas acts."),
    liveness: str = typer.Option("http://0.0.0.0:8080/healthz", envvar="CHUNKPILOT_OPERATOR_LIVENESS",
                                 help="kopf liveness endpoint for the pod's livenessProbe ('' disables it)."),
    resync: int = typer.Option(300, envvar="CHUNKPILOT_OPERATOR_RESYNC_SECONDS",
                                 help="Every object is re-checked at least this often, in whole seconds (watch re-list)."),
    workers: int = typer.Option(16, envvar="CHUNKPILOT_OPERATOR_WORKERS", help="Threads for reconcile passes."),
    allowed_host_path: list[str] = typer.Option([], "--allowed-host-path", envvar="CHUNKPILOT_ALLOWED_HOST_PATHS",
                                                help="Node directory hostpath:// model sources may name, with "
                                                     "everything below it (repeat for more). Default: none."),
    allowed_image_prefix: list[str] = typer.Option([], "--allowed-image-prefix",
                                                   envvar="CHUNKPILOT_ALLOWED_IMAGE_PREFIXES",
                                                   help="Image prefix spec.engine.image may use (repeat for more; '*' "
                                                        "allows any). Default: the engine image's repository."),
    allowed_priority_class: list[str] = typer.Option([], "--allowed-priority-class",
                                                     envvar="CHUNKPILOT_ALLOWED_PRIORITY_CLASSES",
                                                     help="Priority class specs may name (repeat; '*' any). Default: none."),
    allowed_toleration_key: list[str] = typer.Option(["nvidia.com/gpu"], "--allowed-toleration-key",
                                                     envvar="CHUNKPILOT_ALLOWED_TOLERATION_KEYS",
                                                     help="Taint key specs may tolerate (repeat; '*' any, key-less "
                                                          "tolerations too)."),
    default_cpu_request: str = typer.Option("1", envvar="CHUNKPILOT_DEFAULT_CPU_REQUEST",
                                            help="CPU request of engine pods whose spec sets none."),
    default_memory_request: str = typer.Option("4Gi", envvar="CHUNKPILOT_DEFAULT_MEMORY_REQUEST",
                                               help="Memory request of engine pods whose spec sets none."),
    engine_network_policy: bool = typer.Option(True, "--engine-network-policy/--no-engine-network-policy",
                                               envvar="CHUNKPILOT_ENGINE_NETWORK_POLICY",
                                               help="Render a NetworkPolicy per InferenceDeployment: only its own "
                                                    "namespace and --network-policy-namespace reach the engines "
                                                    "(their /metrics, /docs and probes answer without the API key)."),
    network_policy_namespace: list[str] = typer.Option([], "--network-policy-namespace",
                                                       envvar="CHUNKPILOT_NETWORK_POLICY_NAMESPACES",
                                                       help="Namespace also allowed to reach the engines: Prometheus' (the chart "
                                                            "passes monitoring), the gateway's; repeat for more. "
                                                            "Without any, only each deployment's own namespace."),
    service_monitor_label: list[str] = typer.Option([], "--service-monitor-label",
                                                    envvar="CHUNKPILOT_SERVICE_MONITOR_LABELS",
                                                    help="KEY=VALUE label on every engine ServiceMonitor, so your "
                                                         "Prometheus selects it (kube-prometheus-stack: "
                                                         "release=<its release name>); repeat for more."),
    admin_token_key: str = typer.Option("", envvar="CHUNKPILOT_OPERATOR_ADMIN_TOKEN_KEY",
                                        help="Key the engines' admin tokens are derived from (the operator pushes "
                                             "knobs to each pod's admin port with them). Keep it in a Secret (the "
                                             "chart does) so every replica and restart derives the same tokens. "
                                             "Default: a random one per process."),
    operator_namespace: str = typer.Option("", envvar="CHUNKPILOT_OPERATOR_POD_NAMESPACE",
                                           help="Namespace the operator's pods run in: the engine NetworkPolicy "
                                                "admits them (with --operator-pod-label) to the admin port. "
                                                "Default: none admitted (an operator outside the cluster)."),
    operator_pod_label: list[str] = typer.Option([], "--operator-pod-label", envvar="CHUNKPILOT_OPERATOR_POD_LABELS",
                                                 help="KEY=VALUE label of the operator's pods (repeat)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Watch InferenceDeployments and keep their Deployment, Service, knobs ConfigMap, PDB and ServiceMonitor
    as the spec (and the tuner) say. Uses the in-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    from chunkpilot.operator.builders import OperatorSettings
    from chunkpilot.operator.gateway import ENVOY_IMAGE
    from chunkpilot.operator.routing import EPP_IMAGE
    from chunkpilot.operator.handlers import OperatorConfig, run as run_operator
    from chunkpilot.operator.policy import Policy

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:  # kopf logs every handler run at INFO; with hundreds of objects that drowns the real news
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if engine_api_key_secret and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[-._a-zA-Z0-9]+)?",
                                                  engine_api_key_secret):
        typer.echo(f"error: --engine-api-key-secret must be SECRET or SECRET:KEY (a Secret name, optionally a key "
                   f"in it), got {engine_api_key_secret!r}", err=True)
        raise typer.Exit(2)
    if resync < 5 or workers < 1:
        typer.echo("error: --resync must be >= 5 seconds and --workers >= 1", err=True)
        raise typer.Exit(2)
    def split(values: list[str]) -> tuple[str, ...]:  # repeated flags, or one comma-separated env var
        return tuple(v.strip() for value in values for v in value.split(",") if v.strip())

    names = split(namespace)
    if peering and any(ch in n for n in names for ch in "*?["):
        typer.echo("error: --peering with glob namespaces is not supported (each replica reads the peering object of "
                   "every watched namespace): list the namespaces by name", err=True)
        raise typer.Exit(2)
    policy = Policy(allowed_host_paths=split(allowed_host_path),
                    allowed_image_prefixes=split(allowed_image_prefix) or None,
                    allowed_priority_classes=split(allowed_priority_class),
                    allowed_toleration_keys=split(allowed_toleration_key))
    bad = [p for p in policy.allowed_host_paths if not p.startswith("/")]
    if bad:
        typer.echo(f"error: --allowed-host-path takes absolute paths, got {', '.join(bad)}", err=True)
        raise typer.Exit(2)
    def labels(values: list[str], flag: str) -> tuple[tuple[str, str], ...]:
        out = []
        for item in split(values):
            key, sep, value = item.partition("=")
            if not sep or not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", key) or \
                    not re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value):
                typer.echo(f"error: {flag} takes KEY=VALUE with a Kubernetes label key and value, got {item!r}",
                           err=True)
                raise typer.Exit(2)
            out.append((key, value))
        return tuple(out)

    monitor_labels = labels(service_monitor_label, "--service-monitor-label")
    pod_labels = labels(operator_pod_label, "--operator-pod-label")
    if not admin_token_key:
        import secrets

        logging.getLogger(__name__).warning(
            "no --admin-token-key: engine admin tokens are derived from a random key, so after a restart the pods "
            "take the new token only when the kubelet rewrites their Secret volume (about a minute); knobs still "
            "arrive through the ConfigMap meanwhile")
        admin_token_key = secrets.token_hex(32)
    config = OperatorConfig(
        namespaces=names,
        engine=OperatorSettings(engine_image=engine_image, epp_image=epp_image or EPP_IMAGE,
                                envoy_image=envoy_image or ENVOY_IMAGE,
                                hf_download_image=hf_download_image or None,
                                hf_endpoint=hf_endpoint or None,
                                startup_timeout_seconds=startup_timeout,
                                engine_api_key_secret=engine_api_key_secret or None, policy=policy,
                                default_cpu_request=default_cpu_request, default_memory_request=default_memory_request,
                                engine_network_policy=engine_network_policy,
                                network_policy_namespaces=split(network_policy_namespace),
                                service_monitor_labels=monitor_labels, admin_token_key=admin_token_key,
                                operator_namespace=operator_namespace or None, operator_pod_labels=pod_labels),
        peering=peering, priority=priority, liveness=liveness or None, resync_seconds=resync, workers=workers)
    run_operator(config)
