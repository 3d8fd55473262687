"""`chunkpilot engine ...`: run the engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="The serving engine: offline generation (serving comes with `engine serve`).", no_args_is_help=True)


@app.command("generate")
def generate(
    prompt: list[str] = typer.Argument(..., help="One or more prompts; each is generated in the same batch."),
    model: Path = typer.Option(..., "--model", envvar="CHUNKPILOT_MODEL", help="Hugging Face model folder (see `chunkpilot model fetch`)."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, help="Per-request seed for sampling."),
    chat: bool = typer.Option(False, help="Wrap each prompt as a user message in the model's chat template."),
    token_budget: int = typer.Option(512, help="Tokens per step (decodes first, then prefill chunks)."),
    max_chunk: int = typer.Option(512, help="Largest prefill chunk per sequence per step."),
    max_num_seqs: int = typer.Option(32, help="Cap on running sequences."),
    dtype: str = typer.Option("auto", help="float32 | bfloat16 | float16 | auto (float32 on CPU)."),
    device: str = typer.Option("auto", help="cpu | cuda | cuda:N | auto."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for torch (default: torch's choice)."),
    attention_backend: str = typer.Option("auto", help="auto | sdpa | varlen (FlashAttention on CUDA, checked at start-up)."),
) -> None:
    """Generate text offline with the engine and print it, with tokens/s."""
    from chunkpilot.engine import LLM, SamplingParams

    try:
        llm = LLM(
            str(model), token_budget=token_budget, max_chunk=max_chunk, max_num_seqs=min(max_num_seqs, token_budget),
            dtype=dtype, device=device, threads=threads, attention_backend=attention_backend,
        )
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

    typer.echo(
        f"[{n} tokens in {elapsed:.2f}s = {n / elapsed:.1f} tokens/s; device={llm.engine.device}, "
        f"dtype={str(llm.engine.dtype).removeprefix('torch.')}, threads={torch.get_num_threads()}, "
        f"attention={llm.engine.attention_backend}]",
        err=True,
    )
