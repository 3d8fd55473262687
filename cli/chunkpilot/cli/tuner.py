"""`chunkpilot tuner ...`: the online tuner (cluster or local), and the cost-model fit for its simulator."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from chunkpilot.contract import engine_settings as defaults

app = typer.Typer(help="The Optuna tuner that moves token budget and max chunk while the engines serve.",
                  no_args_is_help=True)


@app.command("run")
def run(
    local: bool = typer.Option(False, "--local", help="Tune engines on this machine through a knobs file instead "
                                                      "of InferenceDeployments in a cluster."),
    prometheus_url: str = typer.Option("http://127.0.0.1:9090", envvar="CHUNKPILOT_PROMETHEUS_URL",
                                       help="Prometheus that scrapes the engines."),
    storage: str = typer.Option("sqlite:///chunkpilot-tuner.db", envvar="CHUNKPILOT_TUNER_STORAGE",
                                help="Optuna storage (any SQLAlchemy URL); one study per deployment, resumed on restart."),
    metrics_port: int = typer.Option(9400, envvar="CHUNKPILOT_TUNER_METRICS_PORT",
                                     help="Port for the tuner's own /metrics (0 = off)."),
    # local mode
    knobs_file: Optional[Path] = typer.Option(None, help="--local: the knobs file the engines watch."),
    selector: str = typer.Option('job="chunkpilot"', help="--local: PromQL label matchers of the engines."),
    name: str = typer.Option("local/engines", help="--local: study name (namespace/name)."),
    ttft_slo: Optional[str] = typer.Option(None, help="--local: TTFT SLO as PERCENTILE:SECONDS, e.g. 0.99:2."),
    itl_slo: Optional[str] = typer.Option(None, help="--local: inter-token latency SLO, e.g. 0.99:0.2."),
    budget_bounds: str = typer.Option("{}:{}".format(*defaults.TUNING_BUDGET_BOUNDS), help="--local: token budget MIN:MAX."),
    chunk_bounds: str = typer.Option("{}:{}".format(*defaults.TUNING_CHUNK_BOUNDS), help="--local: max chunk MIN:MAX."),
    start: str = typer.Option(f"{defaults.TOKEN_BUDGET}:{defaults.MAX_CHUNK}", help="--local: knobs before the first trial, BUDGET:CHUNK."),
    mode: str = typer.Option("auto", help="--local: auto (apply) or advisory (recommend only)."),
    objective: str = typer.Option("goodput", help="goodput or throughput."),
    guidance: str = typer.Option("model", help="--local: model (try only knobs the step-time model predicts keep "
                                               "the SLOs) or blackbox (Optuna alone)."),
    window: float = typer.Option(60.0, help="--local: seconds per measurement window."),
    warmup: float = typer.Option(10.0, help="--local: seconds skipped after each change."),
    max_trials: int = typer.Option(30, help="--local: trials before exploiting the best."),
    min_requests: int = typer.Option(20, help="A window with fewer finished requests is not a trial result."),
    apply_timeout: Optional[float] = typer.Option(
        None, min=1, help="Seconds every pod may take to apply new knobs before the trial is given up. Default: 180 "
                          "in a cluster (knobs reach pods through a ConfigMap volume, which the kubelet syncs about "
                          "once a minute), 60 with --local."),
    status_file: Optional[Path] = typer.Option(None, help="--local: write the tuner's status JSON here."),
    seed: Optional[int] = typer.Option(None, help="Sampler seed (reproducible runs)."),
    # cluster mode
    namespace: list[str] = typer.Option([], "--namespace", "-n", envvar="CHUNKPILOT_TUNER_NAMESPACES",
                                        help="Cluster: namespaces to watch (default all)."),
    selector_template: str = typer.Option('namespace="{namespace}",service="{name}"',
                                          envvar="CHUNKPILOT_TUNER_SELECTOR",
                                          help="Cluster: PromQL matchers of one deployment's pods."),
    peering: Optional[str] = typer.Option(None, envvar="CHUNKPILOT_TUNER_PEERING",
                                          help="Cluster: kopf peering name for more than one replica."),
    liveness: str = typer.Option("http://0.0.0.0:8081/healthz", envvar="CHUNKPILOT_TUNER_LIVENESS",
                                 help="Cluster: kopf liveness endpoint ('' disables it)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the tuning loop: ask Optuna, apply knobs, wait for every engine to report them, measure a window from
    Prometheus, tell Optuna; hold the best after max trials and explore again when the load moves."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from chunkpilot.tuner.loop import TunerSettings
    from chunkpilot.tuner.metrics import TunerMetrics

    if objective not in ("goodput", "throughput"):
        typer.echo(f"error: --objective must be goodput or throughput, got {objective!r}", err=True)
        raise typer.Exit(2)
    metrics = TunerMetrics()
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=metrics.registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if not local:
        from chunkpilot.tuner.daemon import ClusterConfig, run as run_cluster

        run_cluster(ClusterConfig(prometheus_url=prometheus_url, storage=storage, namespaces=tuple(namespace),
                                  selector_template=selector_template, peering=peering, liveness=liveness or None,
                                  min_requests=min_requests, seed=seed,
                                  **({"apply_timeout": apply_timeout} if apply_timeout else {})), metrics, stop)
        return

    from chunkpilot.contract.slo import SLOTargets
    from chunkpilot.tuner.config import TuningConfig, parse_bounds, parse_slo
    from chunkpilot.tuner.local import build_local
    from chunkpilot.tuner.space import Knobs

    try:
        if knobs_file is None:
            raise ValueError("--local needs --knobs-file (the file the engines were started with)")
        if mode not in ("auto", "advisory"):
            raise ValueError(f"--mode must be auto or advisory, got {mode!r}")
        slo = SLOTargets(ttft=parse_slo(ttft_slo, "ttft"), itl=parse_slo(itl_slo, "itl"))
        if slo.ttft is None and slo.itl is None:
            raise ValueError("give at least one of --ttft-slo and --itl-slo")
        b, c = parse_bounds(start, "start")
        config = TuningConfig(
            deployment=name, slo=slo, budget_bounds=parse_bounds(budget_bounds, "budget-bounds"),
            chunk_bounds=parse_bounds(chunk_bounds, "chunk-bounds"), storage=storage, seed=seed,
            settings=TunerSettings(mode=mode, objective=objective, window=window, warmup=warmup,
                                   max_trials=max_trials, min_requests=min_requests, guidance=guidance,
                                   apply_timeout=apply_timeout or 60.0))
        loop = build_local(config, knobs_file=knobs_file, prometheus_url=prometheus_url, selector=selector,
                           start=Knobs(b, min(b, c)), status_file=status_file, metrics=metrics, stop=stop)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    loop.run(stop.is_set)


@app.command("fit-cost")
def fit_cost(
    model: Path = typer.Option(..., "--model", envvar="CHUNKPILOT_MODEL", help="Model folder to time the engine on."),
    output: Path = typer.Option(Path("cost.json"), help="Where to write the fitted cost model."),
    seconds: float = typer.Option(90.0, help="How long to run the engine."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads."),
) -> None:
    """Fit the simulator's step-time model on the real engine on this machine."""
    import os
    import platform
    import time

    from chunkpilot.cli.lab_code import require_lab

    require_lab("tuner fit-cost")
    from chunkpilot.sim.fit import fit_engine

    note = f"{model.name}, {platform.machine()} {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}"
    cost, err, n = fit_engine(str(model), seconds=seconds, threads=threads, note=note)
    cost.save(output)
    typer.echo(f"{output}: {cost} (median step error on held-out steps {err:.1%}, {n} steps)")
