"""`chunkpilot crds ...`: the CustomResourceDefinition, generated from the API types."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="The InferenceDeployment CRD, generated from chunkpilot.api's types.", no_args_is_help=True)


@app.command("generate")
def generate(
    output: Path = typer.Option(Path("crds"), "--output", help="Folder to write the CRD YAML into."),
    chart: Optional[Path] = typer.Option(Path("helm/chunkpilot"), "--chart",
                                         help="Chart whose crds/ copy of the CRD and files/engine-rules.json (the env and "
                                              "extraArgs rules its admission policy checks) to write too; empty to skip."),
    docs: Optional[Path] = typer.Option(Path("."), "--docs",
                                        help="Repository root whose docs/crd-reference.md to write too; empty to "
                                             "skip."),
) -> None:
    """Write crds/inferencedeployments.chunkpilot.io.yaml (apply it with kubectl apply -f), the chart's copy
    of the operator's env and extraArgs rules, and the CRD reference page."""
    from chunkpilot.api.crd import write

    typer.echo(str(write(output)))
    if docs and str(docs):
        from chunkpilot.api import reference

        typer.echo(str(reference.write(docs)))
    if chart and str(chart):
        from chunkpilot.operator import rules

        path = chart / "files" / "engine-rules.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rules.render())
        typer.echo(str(path))
        # the chart installs the CRD from its own crds/ folder: the same bytes (tests/chart/test_chart.py)
        crd = write(output)
        copy = chart / "crds" / crd.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(crd.read_bytes())
        typer.echo(str(copy))
