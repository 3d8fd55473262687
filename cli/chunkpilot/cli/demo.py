"""`chunkpilot demo`: two groups of SmolLM2 engines, one tuned online and one on fixed start-up knobs, the same
shifting load on both, a local Prometheus, a live view and a report."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import typer


def demo(
    duration: float = typer.Option(360.0, help="Seconds of load (the sizing before it and the report after it add about 5 minutes)."),
    replicas: int = typer.Option(1, help="Engine processes per group (tuned and fixed)."),
    rate: float = typer.Option(0.5, help="Requests/s per engine in the busiest phase."),
    window: float = typer.Option(20.0, help="Tuner measurement window, seconds."),
    ttft_slo: float = typer.Option(12.0, help="TTFT p99 SLO, seconds."),
    itl_slo: float = typer.Option(0.5, help="Inter-token latency p99 SLO, seconds."),
    out: Path = typer.Option(Path("chunkpilot-demo"), help="Folder for the report, logs and the study."),
    model: Optional[Path] = typer.Option(None, envvar="CHUNKPILOT_MODEL",
                                         help="Model folder (default: the bundled SmolLM2, converted once)."),
    live: bool = typer.Option(True, help="Show the live view (off: one line every 10 s)."),
    size_to_host: bool = typer.Option(True, help="Probe the engines first and size the load to this machine: "
                                                 "outputs up to 2x longer where decode steps are quick, long prompts "
                                                 "shrunk to what it prefills within the SLOs, then a measured check "
                                                 "at the busiest rate (off: the configured lengths)."),
    probe_rounds: int = typer.Option(4, min=1, help="At most this many rounds of the sizing's probe (it stops "
                                                    "as soon as every step-cost term is identified)."),
    check_seconds: float = typer.Option(40.0, min=5.0, help="Seconds of the sizing's measured check at the "
                                                            "busiest rate."),
    sizing_seconds: float = typer.Option(300.0, min=5.0, help="At most this many seconds of measured checks; a "
                                                              "sizing that has not passed by then stops the demo "
                                                              "before its load (see --force)."),
    force: bool = typer.Option(False, help="Run the load even when the sizing's check did not pass (its figures "
                                           "then say less)."),
    quantization: Optional[str] = typer.Option(None, help="Both groups' engines quantize their weights at load "
                                                          "time: int8 or int4 (see `chunkpilot engine serve "
                                                          "--help`)."),
    cores: Optional[str] = typer.Option(None, help="Comma-separated CPU cores for the engines, shared out half "
                                                   "to each group (default: every core this process may use)."),
) -> None:
    """Show online tuning keep the SLOs: engines + load + Prometheus + tuner on this machine, no cluster."""
    import shutil

    from chunkpilot.cli.lab_code import require_lab

    require_lab("demo")

    from rich.console import Console
    from rich.live import Live

    from chunkpilot.demo import report, view
    from chunkpilot.demo.run import DemoConfig, SizingStopped, drive, save_json, save_stopped, shutdown, start

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    # Logs go to a file: the live view owns the terminal.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        filename=str(out / "demo.log"))
    if shutil.which("prometheus") is None:
        console.print("[red]error:[/] the demo needs a local Prometheus server: `sudo apt-get install prometheus` "
                      "(Debian/Ubuntu; scripts/system-deps.sh does it as root), or put the prometheus binary on PATH")
        raise typer.Exit(2)
    if duration < 30 or replicas < 1 or rate <= 0 or window < 5:
        console.print("[red]error:[/] need --duration >= 30, --replicas >= 1, --rate > 0 and --window >= 5")
        raise typer.Exit(2)
    if quantization in ("none", ""):
        quantization = None
    from chunkpilot.contract.engine_settings import CPU_QUANTIZATION_METHODS

    if quantization is not None and quantization not in CPU_QUANTIZATION_METHODS:
        console.print(f"[red]error:[/] --quantization {quantization!r}: the demo's engines run on the CPU, which takes "
                      f"{' or '.join(CPU_QUANTIZATION_METHODS)} (or none)")
        raise typer.Exit(2)
    try:
        core_list = tuple(sorted({int(c) for c in cores.split(",") if c.strip()})) if cores else None
    except ValueError:
        console.print(f"[red]error:[/] --cores {cores!r}: give core numbers separated by commas, e.g. --cores 0,1")
        raise typer.Exit(2)
    if model is None:
        from chunkpilot.engine.model.model_fetch import ModelFetchError, fetch

        try:
            model = fetch("smollm2")
        except ModelFetchError as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2)
    config = DemoConfig(model=str(model), out=out, duration=duration, replicas=replicas, rate=rate, window=window,
                        ttft_slo=ttft_slo, itl_slo=itl_slo, size_to_host=size_to_host, probe_rounds=probe_rounds,
                        check_seconds=check_seconds, sizing_seconds=sizing_seconds, force=force, cores=core_list,
                        quantization=quantization)
    run = None
    interrupted = False
    stop = threading.Event()  # before start(): Ctrl-C during the sizing ends it too

    def on_signal(*_):
        nonlocal interrupted
        interrupted = True
        stop.set()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        run = start(config, say=lambda s: console.print(s), stop=stop)
        console.print(f"load for {duration:.0f}s; Prometheus at {run.prometheus.url}; logs in {out}/")
        t0 = time.monotonic()
        if live:
            with Live(console=console, refresh_per_second=1) as screen:
                drive(run, on_tick=lambda: screen.update(view.table(run, view.snapshot(run), time.monotonic() - t0)))
        else:
            last = [0.0]

            def tick():
                if time.monotonic() - last[0] >= 10:
                    last[0] = time.monotonic()
                    st = run.tuner.state
                    console.print(f"{time.monotonic() - t0:.0f}s: tuner {st.phase}, {st.trial} trials, {st.reason}")
            drive(run, on_tick=tick)
    except SizingStopped as e:
        path = save_stopped(e.run, str(e)) if e.run is not None else None
        # unwrapped (the terminal wraps it): each check's line stays one line, and a script can grep it
        console.print(f"[red]stopped before the load:[/] {e}", highlight=False, soft_wrap=True)
        if path:
            console.print(f"what the sizing measured: {path}")
        raise typer.Exit(1)
    except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as e:
        console.print(f"[red]error:[/] {e}")
        if run is not None:
            shutdown(run)
        raise typer.Exit(1)
    finally:
        if run is not None and run.prometheus is not None:
            try:
                data = report.series(run)  # before Prometheus stops
                run.busy_contention = None if interrupted else report.contention(run)
                hindsight = None if interrupted else report.hindsight(run)
            finally:
                shutdown(run)  # whatever the report could not do, no process outlives the demo
            png = report.plot(run, data)
            missed = report.shortfall(run, data)
            path = save_json(run, {"series": data, "interrupted": interrupted, "hindsight": hindsight,
                                   "shortfall": missed})
            console.print(f"report: {png} and {path}")
            console.print(report.summary_line(run))
            if not interrupted:
                console.print(report.hindsight_line(hindsight))
                console.print(report.shortfall_line(missed, hindsight))
