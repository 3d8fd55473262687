"""The demo's report: latency against the SLOs over time for both groups, knobs over time, the trials; a PNG
(`demo.png`) beside the JSON, and one summary line."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from chunkpilot.demo.run import GROUPS, DemoRun, summary
from chunkpilot.engine import metrics as m


def _range(prom_url: str, query: str, start: float, end: float, step: float = 5.0) -> list[tuple[float, float]]:
    try:
        body = httpx.get(prom_url + "/api/v1/query_range", params={"query": query, "start": start, "end": end,
                                                                    "step": step}, timeout=20).json()
    except (httpx.HTTPError, ValueError):
        return []
    result = body.get("data", {}).get("result", [])
    if not result:
        return []
    return [(float(t) - start, float(v)) for t, v in result[0]["values"] if v not in ("NaN", "+Inf")]


def series(run: DemoRun) -> dict:
    end, start = time.time(), run.started
    out = {}
    for group in GROUPS:
        sel = f'job="chunkpilot-{group}"'
        q = "histogram_quantile(0.99, sum by (le) (rate({m}_bucket{{{sel}}}[30s])))"
        out[group] = {"ttft_p99": _range(run.prometheus.url, q.format(m=m.TTFT, sel=sel), start, end),
                      "itl_p99": _range(run.prometheus.url, q.format(m=m.ITL, sel=sel), start, end),
                      "token_budget": _range(run.prometheus.url, f"max({m.SCHEDULER_TOKEN_BUDGET}{{{sel}}})", start, end),
                      "max_chunk": _range(run.prometheus.url, f"max({m.SCHEDULER_MAX_CHUNK}{{{sel}}})", start, end)}
    return out


def summary_line(run: DemoRun) -> str:
    s = summary(run)
    t, f = s["tuned"], s["fixed"]
    ratio = f"{t['goodput'] / f['goodput']:.2f}x" if f["goodput"] > 0 else "n/a (the fixed group met no SLO)"
    return (f"SLO attainment: tuned {t['attainment']:.0%} vs fixed start-up knobs {f['attainment']:.0%}; goodput "
            f"{t['goodput']:.2f} vs {f['goodput']:.2f} req/s ({ratio}), same requests, same machine, same run")


def figure(run: DemoRun, data: dict):
    """The report's figure. The three time panels share one axis, labelled on the lowest of them; the tuner's
    windows get an axis of their own (sharing it with the time panels is what hid every time label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = run.config
    fig = plt.figure(figsize=(9, 11))
    grid = fig.add_gridspec(4, 1)
    top = fig.add_subplot(grid[0])
    axes = [top, fig.add_subplot(grid[1], sharex=top), fig.add_subplot(grid[2], sharex=top)]
    colors = {"tuned": "tab:blue", "fixed": "tab:red"}
    for ax, key, slo, title in ((axes[0], "ttft_p99", c.ttft_slo, "TTFT p99 (30 s windows)"),
                                (axes[1], "itl_p99", c.itl_slo, "inter-token latency p99 (30 s windows)")):
        for group in GROUPS:
            pts = data[group][key]
            if pts:
                ax.plot(*zip(*pts), color=colors[group], label=group)
        ax.axhline(slo, color="k", ls="--", lw=1, label="SLO")
        ax.set(ylabel="seconds", title=title, yscale="log")
        ax.tick_params(labelbottom=False)
        ax.legend(fontsize=8)
    for group in GROUPS:
        for key, ls in (("token_budget", "-"), ("max_chunk", ":")):
            pts = data[group][key]
            if pts:
                axes[2].step(*zip(*pts), where="post", color=colors[group], ls=ls, label=f"{group} {key}")
    axes[2].set(yscale="log", ylabel="tokens", title="knobs the engines applied",
                xlabel="seconds since the load started")
    axes[2].legend(fontsize=8)
    trials = run.tuner.state.history if run.tuner else []
    if trials:
        xs = list(range(1, len(trials) + 1))
        ax = fig.add_subplot(grid[3])
        ax.scatter(xs, [t["itl"] or 0 for t in trials], c=["tab:green" if t["feasible"] else "tab:red" for t in trials],
                   label="measured")
        predicted = [(x, t["predicted_itl"]) for x, t in zip(xs, trials) if t.get("predicted_itl")]
        if predicted:  # the step-time model's prediction for the same knobs at the same load
            ax.scatter(*zip(*predicted), facecolors="none", edgecolors="k", label="predicted")
        for x, t in zip(xs, trials):
            ax.annotate(f"{t['token_budget']}/{t['max_chunk']}", (x, t["itl"] or 0), fontsize=6, rotation=45)
        ax.axhline(c.itl_slo, color="k", ls="--", lw=1)
        ax.set(xlabel="tuner window", ylabel="ITL p99 (s)", yscale="log",
               title="tuner windows (green: within the SLOs), labelled budget/chunk; hollow: predicted")
        ax.legend(fontsize=8)
    fig.suptitle(summary_line(run), fontsize=8)
    fig.tight_layout()
    return fig


def plot(run: DemoRun, data: dict) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(run, data)
    path = run.config.out / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
