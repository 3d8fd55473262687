"""Show a benchmark result: a table on the terminal, JSON on disk, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from chunkpilot.loadgen.runner import BenchmarkResult


def print_table(result: BenchmarkResult, console: Console | None = None) -> None:
    s = result.summary
    console = console or Console()
    table = Table(title=f"{result.conditions.get('label') or 'benchmark'}: {s['completed']}/{s['requests']} requests "
                        f"in {s['duration_s']:.1f}s")
    table.add_column("metric")
    for p in ("p50", "p90", "p95", "p99", "mean"):
        table.add_column(p, justify="right")
    for name, key in (("TTFT (ms)", "ttft_s"), ("ITL (ms)", "itl_s"), ("TPOT (ms)", "tpot_s"), ("E2E (ms)", "e2e_s")):
        row = s[key]
        table.add_row(name, *("-" if row[p] is None else f"{row[p] * 1000:.1f}" for p in ("p50", "p90", "p95", "p99", "mean")))
    console.print(table)
    console.print(f"request throughput {s['request_throughput']:.2f}/s · output tokens {s['output_token_throughput']:.1f}/s"
                  f" · goodput {s['goodput']:.2f}/s (SLO attainment {s['slo_attainment']:.0%})")


def write_json(result: BenchmarkResult, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result.to_json(), indent=2))


def plot(result: BenchmarkResult, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    done = [r for r in result.records if r.ok]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for kind in sorted({r.kind for r in done}):
        ttfts = np.sort([r.ttft * 1000 for r in done if r.kind == kind])
        a.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=kind)
    a.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="time to first token (CDF)")
    a.legend()
    t0 = min((r.start for r in result.records), default=0.0)
    for kind in sorted({r.kind for r in done}):
        xs = [t - t0 for r in done if r.kind == kind for t, _ in r.timed_itls()]
        ys = [g * 1000 for r in done if r.kind == kind for _, g in r.timed_itls()]
        b.scatter(xs, ys, s=3, label=kind)
    b.set(xlabel="time in run (s)", ylabel="inter-token gap (ms)", title="inter-token latency over time")
    b.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
