"""`chunkpilot bench serve`: the load generator from the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Load generation and benchmarks against an OpenAI-compatible server.", no_args_is_help=True)


def parse_phases(text: str, default_mix: dict[str, float]):
    """"DURATION:RATE[:CHAT_FRACTION],..." → phases; e.g. "30:1:0.9,30:3:0.6" shifts rate and mix mid-run."""
    from chunkpilot.loadgen.workloads import Phase

    phases = []
    for part in text.split(","):
        fields = part.split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError
            duration, rate = float(fields[0]), float(fields[1])
            mix = default_mix if len(fields) == 2 else {"chat": float(fields[2]), "rag": 1.0 - float(fields[2])}
        except ValueError:
            raise typer.BadParameter(f"phase {part!r} is not DURATION:RATE[:CHAT_FRACTION]", param_hint="--phases")
        phases.append(Phase(duration, rate, mix))
    return phases


@app.command("serve")
def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="Server root (without /v1)."),
    model: str = typer.Option(..., help="Served model name to send."),
    model_dir: Optional[Path] = typer.Option(None, help="Model folder, to read the vocabulary size for random prompts."),
    vocab_size: Optional[int] = typer.Option(None, help="Vocabulary size (instead of --model-dir)."),
    workload: str = typer.Option("mixed", help="chat | rag | mixed | jsonl (with --dataset)."),
    dataset: Optional[Path] = typer.Option(None, help="JSONL file of {prompt, max_tokens[, kind]} for --workload jsonl."),
    rate: float = typer.Option(1.0, help="Requests per second (mean)."),
    burstiness: float = typer.Option(1.0, help="1 = Poisson arrivals; < 1 burstier (gamma-distributed gaps)."),
    duration: float = typer.Option(60.0, help="Seconds of arrivals (rate mode)."),
    num_requests: Optional[int] = typer.Option(None, help="Stop after this many requests."),
    concurrency: Optional[int] = typer.Option(None, help="Keep this many requests in flight instead of a rate."),
    phases: Optional[str] = typer.Option(None, help="Shifting load: DURATION:RATE[:CHAT_FRACTION],... (overrides --rate/--duration)."),
    prompt_scale: float = typer.Option(1.0, help="Scale prompt lengths (chat 16-128, rag 2048-8192 tokens at 1.0)."),
    max_prompt: Optional[int] = typer.Option(None, help="Cap prompt lengths (e.g. the model's max length minus outputs)."),
    slo_ttft: Optional[float] = typer.Option(None, help="TTFT SLO in seconds, for goodput."),
    slo_itl: Optional[float] = typer.Option(None, help="Inter-token latency SLO in seconds (per request p99), for goodput."),
    api_key: Optional[str] = typer.Option(None, envvar="CHUNKPILOT_API_KEY", help="Bearer key if the server needs one."),
    seed: int = typer.Option(0, help="Seed for prompts and arrivals."),
    out: Optional[Path] = typer.Option(None, help="Write the result (summary, conditions, every request) as JSON."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG plot (TTFT CDF, inter-token latency over time)."),
    label: str = typer.Option("", help="Name of the run in the table and JSON."),
) -> None:
    """Stream requests to any OpenAI-compatible server and report TTFT, inter-token latency, TPOT, end-to-end
    latency percentiles, throughput and goodput."""
    from chunkpilot.contract.slo import SLOTargets
    from chunkpilot.loadgen import BenchmarkConfig, run_benchmark
    from chunkpilot.loadgen.report import plot as plot_result, print_table, write_json
    from chunkpilot.loadgen.workloads import MIXES, SHAPES, Phase, build_requests, build_workload, load_jsonl, scaled

    if workload == "jsonl":
        if dataset is None:
            raise typer.BadParameter("--workload jsonl needs --dataset FILE", param_hint="--dataset")
        try:
            specs = load_jsonl(dataset, rate=None if concurrency else rate, seed=seed, burstiness=burstiness)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--dataset")
        specs = specs[:num_requests] if num_requests else specs
    else:
        if workload not in MIXES:
            raise typer.BadParameter(f"unknown workload {workload!r}; use chat, rag, mixed or jsonl", param_hint="--workload")
        if vocab_size is None:
            if model_dir is None:
                raise typer.BadParameter("give --model-dir (or --vocab-size) to build random prompts", param_hint="--model-dir")
            vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        shapes = {k: scaled(v, prompt_scale, max_prompt) for k, v in SHAPES.items()}
        if concurrency:
            specs = build_requests(num_requests or 100, MIXES[workload], vocab_size=vocab_size, seed=seed, shapes=shapes)
        else:
            plan = parse_phases(phases, MIXES[workload]) if phases else [Phase(duration, rate, MIXES[workload])]
            specs = build_workload(plan, vocab_size=vocab_size, seed=seed, burstiness=burstiness, shapes=shapes,
                                   num_requests=num_requests)
    if not specs:
        raise typer.BadParameter("the workload has no requests: raise --rate or --duration")
    result = run_benchmark(BenchmarkConfig(base_url, model, specs, concurrency=concurrency,
                                           slo=SLOTargets.p99(ttft=slo_ttft, itl=slo_itl), api_key=api_key,
                                           label=label))
    print_table(result)
    if out:
        write_json(result, out)
    if plot:
        plot_result(result, plot)
    if result.summary["failed"]:
        first = next(r.error for r in result.records if r.error)
        typer.echo(f"warning: {result.summary['failed']} requests failed, e.g. {first}", err=True)
