"""The commands that run lab code (lab/: the demo, the simulator), which no image carries: outside a checkout or
the wheel they stop with what to do instead of an import traceback."""

from __future__ import annotations

import importlib.util

import typer


def require_lab(command: str) -> None:
    if all(importlib.util.find_spec(p) is not None for p in ("chunkpilot.demo", "chunkpilot.sim", "chunkpilot.lab")):
        return
    typer.echo(f"error: `chunkpilot {command}` runs lab code (the demo, the simulator), which the engine, operator "
               "and tuner images do not carry: run it from a checkout (bash scripts/demo.sh) or after "
               "`pip install chunkpilot`", err=True)
    raise typer.Exit(2)
