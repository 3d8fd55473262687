"""`chunkpilot engine ...`: run the engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from chunkpilot.contract import engine_settings as defaults

COMPILE_HELP = ("Compile the forward of small steps (decodes) with torch.compile at start-up, on the CPU with one rank: "
                "batch-1 decode 1.1-1.3x faster in float32 and 1.6-1.8x with --quantization int8/int4 (bench/quantization.py), start-up minutes longer (inductor's cache in "
                "TORCHINDUCTOR_CACHE_DIR makes later starts shorter).")
app = typer.Typer(help="The serving engine: `serve` the OpenAI-compatible API, or `generate` offline.", no_args_is_help=True)


@app.command("generate")
def generate(
    prompt: list[str] = typer.Argument(..., help="One or more prompts; each is generated in the same batch."),
    model: Path = typer.Option(..., "--model", envvar="CHUNKPILOT_MODEL", help="Hugging Face model folder (see `chunkpilot model fetch`)."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, help="Per-request seed for sampling."),
    chat: bool = typer.Option(False, help="Wrap each prompt as a user message in the model's chat template."),
    token_budget: int = typer.Option(defaults.TOKEN_BUDGET, help="Tokens per step (decodes first, then prefill chunks)."),
    max_chunk: int = typer.Option(defaults.MAX_CHUNK, help="Largest prefill chunk per sequence per step."),
    max_num_seqs: int = typer.Option(defaults.MAX_NUM_SEQS, help="Cap on running sequences."),
    dtype: str = typer.Option("auto", help="float32 | bfloat16 | float16 | auto (float32 on CPU)."),
    device: str = typer.Option("auto", help="cpu | cuda | cuda:N | auto."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for torch (default: torch's choice)."),
    attention_backend: str = typer.Option("auto", help="auto | sdpa | varlen (FlashAttention on CUDA, checked at start-up)."),
    quantization: Optional[str] = typer.Option(None, "--quantization", "-q", help="Weight-only quantization at load time: int8 | int4 (CPU) | fp8 (Hopper GPUs) | none."),
    speculative_config: Optional[str] = typer.Option(None, "--speculative-config", help="Speculative decoding as JSON (vLLM's flag), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' or '{\"model\": \"DRAFT_DIR\"}'."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", envvar="CHUNKPILOT_TENSOR_PARALLEL_SIZE", help="GPUs (ranks) to split the model across; the engine starts its own worker processes."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
) -> None:
    """Generate text offline with the engine and print it, with tokens/s."""
    from chunkpilot.engine import LLM, SamplingParams

    try:
        llm = LLM(
            str(model), token_budget=token_budget, max_chunk=max_chunk, max_num_seqs=min(max_num_seqs, token_budget),
            dtype=dtype, device=device, threads=threads, attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, speculative_config=speculative_config,
            compile=compile,
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

    llm.engine.close()
    typer.echo(
        f"[{n} tokens in {elapsed:.2f}s = {n / elapsed:.1f} tokens/s; device={llm.engine.device}, "
        f"dtype={str(llm.engine.dtype).removeprefix('torch.')}, threads={torch.get_num_threads()}, "
        f"attention={llm.engine.attention_backend}, tensor_parallel_size={tensor_parallel_size}]",
        err=True,
    )


def _env(name: str) -> str:
    return f"CHUNKPILOT_{name}"


@app.command("serve")
def serve(
    model: Path = typer.Option(..., "--model", envvar=_env("MODEL"), help="Hugging Face model folder (PVC, host path or baked into the image)."),
    host: str = typer.Option("0.0.0.0", envvar=_env("HOST"), help="Address to listen on."),
    port: int = typer.Option(8000, envvar=_env("PORT"), help="Port for the API, /health, /ready and /metrics."),
    served_model_name: Optional[str] = typer.Option(None, envvar=_env("SERVED_MODEL_NAME"), help="Model name clients send (default: the folder's name)."),
    api_key: Optional[str] = typer.Option(None, envvar=_env("API_KEY"), help="Require `Authorization: Bearer KEY` on /v1/*; several keys separated by commas are several tenants, whose prompts never share prefix-cache blocks. Prefer the env var (a Secret) to the flag."),
    knobs_file: Optional[Path] = typer.Option(None, envvar=_env("KNOBS_FILE"), help="Scheduler knobs JSON {token_budget, max_chunk, generation}, watched and applied while serving."),
    knobs_poll_interval: float = typer.Option(0.2, envvar=_env("KNOBS_POLL_INTERVAL"), help="Seconds between reads of the knobs file."),
    admin_port: Optional[int] = typer.Option(None, envvar=_env("ADMIN_PORT"), help="Port of the knobs admin endpoint (PUT/GET /admin/knobs), where the operator pushes knobs; needs --admin-token-file. Once a push is applied the knobs file is read again only at the next start."),
    admin_token_file: Optional[Path] = typer.Option(None, envvar=_env("ADMIN_TOKEN_FILE"), help="File holding the admin endpoint's bearer token (a Secret volume), read on every request."),
    token_budget: int = typer.Option(defaults.TOKEN_BUDGET, envvar=_env("TOKEN_BUDGET"), help="Initial tokens per step (the knobs file overrides it)."),
    max_chunk: int = typer.Option(defaults.MAX_CHUNK, envvar=_env("MAX_CHUNK"), help="Initial largest prefill chunk (the knobs file overrides it)."),
    max_num_seqs: int = typer.Option(defaults.MAX_NUM_SEQS, envvar=_env("MAX_NUM_SEQS"), help="Cap on running sequences; token budgets below it are refused."),
    max_token_budget: Optional[int] = typer.Option(None, envvar=_env("MAX_TOKEN_BUDGET"), help="Largest token budget a knobs file may set (default: what the GPU's memory leaves room for, at most max-num-seqs x max-model-len); larger ones are refused and the last good knobs stay."),
    max_waiting: int = typer.Option(256, envvar=_env("MAX_WAITING"), help="Requests allowed to wait; beyond it HTTP 429 with Retry-After."),
    max_model_len: Optional[int] = typer.Option(None, envvar=_env("MAX_MODEL_LEN"), help="Prompt + output limit (default: the model's, capped at 8192)."),
    block_size: int = typer.Option(16, envvar=_env("BLOCK_SIZE"), help="Tokens per KV-cache block."),
    kv_cache_memory_gb: Optional[float] = typer.Option(None, envvar=_env("KV_CACHE_MEMORY_GB"), help="CPU: memory for the KV cache (default 1 GB)."),
    gpu_memory_utilization: float = typer.Option(0.85, envvar=_env("GPU_MEMORY_UTILIZATION"), help="GPU: fraction of the card for weights + KV cache."),
    enable_prefix_caching: bool = typer.Option(True, envvar=_env("ENABLE_PREFIX_CACHING"), help="Reuse KV blocks of shared prompt prefixes."),
    dtype: str = typer.Option("auto", envvar=_env("DTYPE"), help="float32 | bfloat16 | float16 | auto (float32 on CPU)."),
    device: str = typer.Option("auto", envvar=_env("DEVICE"), help="cpu | cuda | cuda:N | auto."),
    threads: Optional[int] = typer.Option(None, envvar=_env("THREADS"), help="CPU threads for torch."),
    attention_backend: str = typer.Option("auto", envvar=_env("ATTENTION_BACKEND"), help="auto | sdpa | varlen."),
    quantization: Optional[str] = typer.Option(None, "--quantization", "-q", envvar=_env("QUANTIZATION"), help="Weight-only quantization of the linear layers at load time (vLLM's flag): int8 (per channel) | int4 (groups of 32) on the CPU, fp8 on Hopper GPUs, or none."),
    speculative_config: Optional[str] = typer.Option(None, "--speculative-config", envvar=_env("SPECULATIVE_CONFIG"), help="Speculative decoding as JSON (vLLM's flag): method ngram (prompt lookup; prompt_lookup_min/max) or draft_model (\"model\": a smaller model's folder with the same tokenizer), num_speculative_tokens 1-16; e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' or '{\"model\": \"/models/draft\"}'. Off by default."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", envvar=_env("TENSOR_PARALLEL_SIZE"), help="GPUs (ranks) to split the model across, Megatron-style; the engine starts ranks 1..N-1 as its own processes in the container. Must divide the attention heads and the MLP width."),
    compile: bool = typer.Option(False, "--compile", envvar=_env("COMPILE"), help=COMPILE_HELP),
    tensor_parallel_timeout: float = typer.Option(120.0, envvar=_env("TENSOR_PARALLEL_TIMEOUT"), help="Seconds a collective between ranks may take (more than the slowest step); a rank that hangs longer makes the engine exit non-zero, so the pod restarts."),
    grace_period: float = typer.Option(30.0, envvar=_env("GRACE_PERIOD"), help="Seconds in-flight requests may finish after SIGTERM."),
    max_request_bytes: Optional[int] = typer.Option(None, envvar=_env("MAX_REQUEST_BYTES"), help="Largest request body; larger ones get HTTP 413 before they are parsed (default: 64 bytes per token of max-model-len, at least 1 MiB)."),
    stream_write_timeout: float = typer.Option(30.0, envvar=_env("STREAM_WRITE_TIMEOUT"), help="Seconds a stream may wait on a client that reads nothing before it is aborted and its slot freed."),
    stall_timeout: float = typer.Option(120.0, envvar=_env("STALL_TIMEOUT"), help="/health fails (the pod restarts) when one engine step has run this long."),
    prompt_tokens_details: bool = typer.Option(True, "--enable-prompt-tokens-details/--disable-prompt-tokens-details", envvar=_env("PROMPT_TOKENS_DETAILS"), help="Report usage.prompt_tokens_details.cached_tokens. The count tells a caller which prompt prefixes are cached: with one shared key, hide it or give each tenant its own key."),
    exit_on_load_failure: bool = typer.Option(False, envvar=_env("EXIT_ON_LOAD_FAILURE"), help="Exit with status 1 when the model fails to load, the error as the last log line (in a pod: restarted and reported at once); by default the server stays up and says why on /ready."),
    seed: int = typer.Option(0, envvar=_env("SEED"), help="Seed for requests without their own."),
    log_level: str = typer.Option("info", envvar=_env("LOG_LEVEL"), help="debug | info | warning | error."),
) -> None:
    """Serve the OpenAI-compatible API (completions, chat completions, models), /health, /ready and /metrics.
    Every option can also come from the environment variable shown (for a pod spec)."""
    from chunkpilot.engine import EngineConfig
    from chunkpilot.engine.server import ServerSettings, serve as run_server

    try:
        config = EngineConfig(
            model=str(model), dtype=dtype, device=device, token_budget=token_budget, max_chunk=max_chunk,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
            kv_cache_memory_gb=kv_cache_memory_gb, gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching, seed=seed, threads=threads,
            attention_backend=attention_backend, max_token_budget=max_token_budget,
            tensor_parallel_size=tensor_parallel_size, tensor_parallel_timeout=tensor_parallel_timeout,
            quantization=quantization, speculative_config=speculative_config, compile=compile,
        )
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if not (model / "config.json").is_file():
        typer.echo(f"error: {model} is not a model folder (no config.json); see `chunkpilot model fetch`", err=True)
        raise typer.Exit(2)
    if (admin_port is None) != (admin_token_file is None):
        typer.echo("error: --admin-port and --admin-token-file go together (the admin endpoint needs a token)", err=True)
        raise typer.Exit(2)
    try:
        settings = ServerSettings(
            engine=config, served_model_name=served_model_name, api_key=api_key or None,
            knobs_file=str(knobs_file) if knobs_file else None, knobs_poll_interval=knobs_poll_interval,
            admin_port=admin_port, admin_token_file=str(admin_token_file) if admin_token_file else None,
            max_waiting=max_waiting, grace_period=grace_period, max_request_bytes=max_request_bytes,
            stream_write_timeout=stream_write_timeout, stall_timeout=stall_timeout,
            prompt_tokens_details=prompt_tokens_details, exit_on_load_failure=exit_on_load_failure,
        )
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    run_server(settings, host=host, port=port, log_level=log_level)
