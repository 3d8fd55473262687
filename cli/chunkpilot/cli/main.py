"""`chunkpilot` — one command for every part: engine, model, operator, tuner, bench, crds, demo."""

from __future__ import annotations

import typer

from chunkpilot.cli import bench, check, crds, demo, engine, model, operator, tuner

app = typer.Typer(
    help="chunkpilot: LLM inference on Kubernetes that keeps its latency SLOs by tuning chunked prefill online.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(engine.app, name="engine")
app.add_typer(model.app, name="model")
app.add_typer(operator.app, name="operator")
app.add_typer(tuner.app, name="tuner")
app.add_typer(bench.app, name="bench")
app.add_typer(crds.app, name="crds")
app.command("demo")(demo.demo)
app.command("check-install")(check.check_install)

if __name__ == "__main__":  # pragma: no cover
    app()
