"""`chunkpilot engine ...`: run the engine. The options of both commands are the engine settings declared in
chunkpilot.contract.engine_settings (name, type, default, env var, help): this module adds none of its own for them."""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from chunkpilot.contract import engine_settings
from chunkpilot.contract.engine_settings import Setting

app = typer.Typer(help="The serving engine: `serve` the OpenAI-compatible API, or `generate` offline.", no_args_is_help=True)


def _parameter(s: Setting) -> inspect.Parameter:
    option = typer.Option(s.default, *s.param_decls, envvar=s.env, help=s.help)
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=Optional[s.kind] if s.default is None else s.kind)


def with_settings(settings: tuple[Setting, ...]) -> Callable:
    """Give a command taking `**settings` one option per engine setting: typer reads a function's signature, so
    the command gets a signature with its own parameters followed by one keyword parameter per setting."""
    def wrap(func: Callable) -> Callable:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        params = own + [_parameter(s) for s in settings]

        def command(**kwargs: Any) -> None:
            mine = {p.name: kwargs.pop(p.name) for p in own}
            func(**mine, **kwargs)

        command.__name__, command.__doc__ = func.__name__, func.__doc__
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command
    return wrap


@app.command("generate")
@with_settings(tuple(s for s in engine_settings.SETTINGS if s.generate))
def generate(
    prompt: list[str] = typer.Argument(..., help="One or more prompts; each is generated in the same batch."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, help="Per-request seed for sampling."),
    chat: bool = typer.Option(False, help="Wrap each prompt as a user message in the model's chat template."),
    **settings: Any,
) -> None:
    """Generate text offline with the engine and print it, with tokens/s."""
    from chunkpilot.engine import LLM, SamplingParams

    try:
        model = str(settings.pop("model"))
        settings["max_num_seqs"] = min(settings["max_num_seqs"], settings["token_budget"])
        llm = LLM(model, **settings)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        t0 = time.perf_counter()
        if chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompt], params)
        else:
            outs = llm.generate(list(prompt), params)
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    for p, out in zip(prompt, outs):
        typer.echo(f"--- {p!r} ({out.finish_reason})\n{out.text}")
    n = sum(len(o.token_ids) for o in outs)
    import torch

    llm.engine.close()
    typer.echo(
        f"[{n} tokens in {elapsed:.2f}s = {n / elapsed:.1f} tokens/s; device={llm.engine.device}, "
        f"dtype={str(llm.engine.dtype).removeprefix('torch.')}, threads={torch.get_num_threads()}, "
        f"attention={llm.engine.attention_backend}, tensor_parallel_size={settings['tensor_parallel_size']}]",
        err=True,
    )


@app.command("serve")
@with_settings(engine_settings.SETTINGS)
def serve(**settings: Any) -> None:
    """Serve the OpenAI-compatible API (completions, chat completions, models), /health, /ready and /metrics.
    Every option can also come from the environment variable shown (for a pod spec)."""
    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings, serve as run_server

    # paths travel as strings inside the engine
    values = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    of = lambda layer: {s.name: values[s.name] for s in engine_settings.layer(layer)}  # noqa: E731
    model = Path(values["model"])
    try:
        config = EngineConfig(**of("engine"))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if not (model / "config.json").is_file():
        typer.echo(f"error: {model} is not a model folder (no config.json); see `chunkpilot model fetch`", err=True)
        raise typer.Exit(2)
    server = of("server")
    if (server["admin_port"] is None) != (server["admin_token_file"] is None):
        typer.echo("error: --admin-port and --admin-token-file go together (the admin endpoint needs a token)", err=True)
        raise typer.Exit(2)
    server["api_key"] = server["api_key"] or None
    try:
        settings = ServerSettings(engine=config, **server)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    listen = of("listen")
    run_server(settings, host=listen["host"], port=listen["port"], log_level=listen["log_level"])
