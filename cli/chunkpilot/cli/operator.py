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
    hf_download_image: str = typer.Option("python:3.12-slim", envvar="CHUNKPILOT_HF_DOWNLOAD_IMAGE",
                                          help="Image of the init container that downloads hf:// models."),
    startup_timeout: int = typer.Option(900, envvar="CHUNKPILOT_STARTUP_TIMEOUT_SECONDS",
                                        help="Seconds an engine pod may take to load its model before it is restarted."),
    engine_api_key_secret: Optional[str] = typer.Option(
        None, envvar="CHUNKPILOT_ENGINE_API_KEY_SECRET",
        help="SECRET:KEY in each InferenceDeployment's namespace; the engines then require that API key."),
    peering: Optional[str] = typer.Option(None, envvar="CHUNKPILOT_OPERATOR_PEERING",
                                          help="kopf peering name, for more than one operator replica (only the "
                                               "highest-priority replica acts). Needs kopf's peering CRDs. "
                                               "Default: standalone."),
    priority: int = typer.Option(0, envvar="CHUNKPILOT_OPERATOR_PRIORITY", help="This replica's peering priority."),
    liveness: str = typer.Option("http://0.0.0.0:8080/healthz", envvar="CHUNKPILOT_OPERATOR_LIVENESS",
                                 help="kopf liveness endpoint for the pod's livenessProbe ('' disables it)."),
    resync: int = typer.Option(300, envvar="CHUNKPILOT_OPERATOR_RESYNC_SECONDS",
                                 help="Every object is re-checked at least this often, in whole seconds (watch re-list)."),
    workers: int = typer.Option(16, envvar="CHUNKPILOT_OPERATOR_WORKERS", help="Threads for reconcile passes."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Watch InferenceDeployments and keep their Deployment, Service, knobs ConfigMap, PDB and ServiceMonitor
    as the spec (and the tuner) say. Uses the in-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    from chunkpilot.operator.builders import OperatorSettings
    from chunkpilot.operator.handlers import OperatorConfig, run as run_operator

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
    names = tuple(n for ns in namespace for n in ns.split(",") if n)
    config = OperatorConfig(
        namespaces=names,
        engine=OperatorSettings(engine_image=engine_image, hf_download_image=hf_download_image,
                                startup_timeout_seconds=startup_timeout,
                                engine_api_key_secret=engine_api_key_secret or None),
        peering=peering, priority=priority, liveness=liveness or None, resync_seconds=resync, workers=workers)
    run_operator(config)
