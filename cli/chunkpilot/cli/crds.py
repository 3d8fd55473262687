"""`chunkpilot crds ...`: the CustomResourceDefinition, generated from the API types."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="The InferenceDeployment CRD, generated from chunkpilot.api's types.", no_args_is_help=True)


@app.command("generate")
def generate(
    output: Path = typer.Option(Path("crds"), "--output", help="Folder to write the CRD YAML into."),
) -> None:
    """Write crds/inferencedeployments.chunkpilot.io.yaml (apply it with kubectl apply -f)."""
    from chunkpilot.api.crd import write

    typer.echo(str(write(output)))
