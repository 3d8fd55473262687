"""The demo's report: latency against the SLOs over time for both groups, knobs over time, the trials; a PNG
(`demo.png`) beside the JSON, and one summary line."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import httpx

from chunkpilot.demo.run import GROUPS, DemoRun, summary
from chunkpilot.contract import metric_names as m


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


def hindsight(run: DemoRun) -> dict | None:
    """The best fixed knobs in hindsight for this run's own trace: the step-time model fitted from every engine's
    steps over the whole run (Prometheus), as the simulator's cost, replaying the same requests at every point of a
    grid over the tuner's bounds (two points an octave: 91, where the tuner's own space has four). The simulator's
    KV pool is not the engines' 0.5 GB. Its error is stated against the fixed group, which really ran its knobs
    on the trace. None when too few steps were seen."""
    from chunkpilot.demo.run import KNOB_BOUNDS, MAX_NUM_SEQS
    from chunkpilot.loadgen.stats import meets
    from chunkpilot.loadgen.workloads import build_workload
    from chunkpilot.tuner import PrometheusSource, SearchSpace
    from chunkpilot.sim import FittedCost, Simulator

    config = run.config
    seconds = max(30.0, time.time() - run.started)
    try:
        model = PrometheusSource(run.prometheus.url, 'job=~"chunkpilot-(tuned|fixed)"').step_model(seconds)
    except Exception as e:  # noqa: BLE001 - the report says what it could not do, and goes on
        return {"error": f"no step-time model: {type(e).__name__}: {e}"}
    if model is None:
        return None
    specs = build_workload(config.phases(), vocab_size=49152, seed=config.seed, shapes=config.shapes())
    slo = config.slo()
    n = len(specs) * config.replicas

    def replay(knobs) -> dict:
        sim = Simulator(FittedCost(model), specs, knobs, max_num_seqs=MAX_NUM_SEQS)
        recs = sim.run()
        done = [r for r in recs if r.end is not None]
        met = sum(1 for r in done if meets(r, slo))
        span = max(r.end for r in done) - min(r.start for r in recs) if done else 0.0
        return {"attainment": met / len(recs) if recs else 0.0, "goodput": met / span * config.replicas if span else 0.0}

    space = SearchSpace.from_bounds(KNOB_BOUNDS, KNOB_BOUNDS, 16, points_per_octave=2)
    grid = {k: replay(k) for k in space.all_knobs()}
    best = max(grid, key=lambda k: (grid[k]["goodput"], -k.token_budget))
    fixed_sim = grid.get(config.start) or replay(config.start)
    fixed = summary(run)["fixed"]
    return {"best": [best.token_budget, best.max_chunk], **grid[best], "requests": n,
            "fixed_simulated": fixed_sim, "fixed_measured": {"attainment": fixed["attainment"],
                                                             "goodput": fixed["goodput"]},
            "error": {"attainment": fixed_sim["attainment"] - fixed["attainment"],
                      "goodput": (fixed_sim["goodput"] / fixed["goodput"] - 1) if fixed["goodput"] else None},
            "model": {"coefficients": model.coefficients, "steps": model.steps,
                      "relative_error": model.relative_error}}


def hindsight_line(h: dict | None) -> str:
    if not h:
        return "best fixed knobs in hindsight: not enough steps to fit a model"
    if "error" in h and "best" not in h:
        return f"best fixed knobs in hindsight: {h['error']}"
    err = h["error"]
    good = f", goodput {err['goodput']:+.0%}" if err["goodput"] is not None else ""
    return (f"best fixed knobs in hindsight (simulated on this trace with the fitted step-time model): "
            f"{h['best'][0]}/{h['best'][1]}, attainment {h['attainment']:.0%}, goodput {h['goodput']:.2f} req/s; "
            f"the same simulation of the fixed group's knobs is off by {err['attainment']:+.0%} attainment{good}")


def _at(samples: list, t: float) -> float:
    """The value of a 5-s series at `t` (seconds into the run): the last sample at or before it, else the first."""
    value = samples[0][1]
    for at, v in samples:
        if at > t:
            break
        value = v
    return value


def shortfall_by_knobs(arrivals: list[tuple[float, bool]], budget: list, chunk: list) -> list[dict]:
    """Pure: each request as (seconds into the run it arrived, met every SLO) and the tuned group's knob series ->
    per knobs the engine ran at the arrival, its requests and those missed, the costliest first."""
    counts: dict[tuple[int, int], list[int]] = {}
    for t, met in arrivals:
        c = counts.setdefault((int(_at(budget, t)), int(_at(chunk, t))), [0, 0])
        c[0] += 1
        c[1] += not met
    rows = [{"knobs": list(k), "requests": n, "missed": m} for k, (n, m) in counts.items()]
    return sorted(rows, key=lambda r: (-r["missed"], -r["requests"]))


def shortfall(run: DemoRun, data: dict) -> list[dict]:
    """Which decisions cost the tuned group what it missed: its requests that failed or missed an SLO, by the knobs
    its engines ran when each arrived (Prometheus' series of the tuned group's knobs). Beside the best fixed knobs
    in hindsight this names the trials, or the held knobs, that lost what the tuned group lost."""
    budget, chunk = data.get("tuned", {}).get("token_budget"), data.get("tuned", {}).get("max_chunk")
    if not budget or not chunk or not run.started:
        return []
    from chunkpilot.loadgen.stats import meets

    slo = run.config.slo()
    offset = time.time() - time.monotonic() - run.started  # the client's monotonic start -> seconds into the run
    return shortfall_by_knobs([(r.start + offset, meets(r, slo)) for r in run.records.get("tuned", [])],
                              budget, chunk)


def shortfall_line(rows: list[dict], h: dict | None) -> str:
    missed = sum(r["missed"] for r in rows)
    if not rows or not missed:
        return "where the tuned group missed: no request missed an SLO"
    best = tuple(h["best"]) if h and "best" in h else None
    parts = []
    for r in [r for r in rows if r["missed"]][:4]:
        k = tuple(r["knobs"])
        tag = " (the best in hindsight)" if k == best else ""
        parts.append(f"{r['missed']} of {r['requests']} at {k[0]}/{k[1]}{tag}")
    line = f"where the tuned group missed: {missed} of {sum(r['requests'] for r in rows)} requests; " + ", ".join(parts)
    if h and "best" in h and "requests" in h:
        line += (f"; the best fixed knobs in hindsight missed {round((1 - h['attainment']) * h['requests'])} in "
                 f"their simulation")
    return line


def contention(run: DemoRun) -> float | None:
    """The tuned group's steps over the busiest phase (the middle half of the load): measured seconds over what
    the probe's fit predicts for the same steps. 1 means the probe's steps and the busy phase's cost alike; what it
    reads above 1 is what sharing the machine added, measured, not assumed."""
    if run.sizing is None or run.sizing.model is None or run.prometheus is None or not run.started:
        return None
    from chunkpilot.demo.check import measured_over_predicted
    from chunkpilot.tuner import step_moments_query

    quarter = run.config.duration / 4
    at = min(time.time(), run.started + 3 * quarter)
    seconds = at - (run.started + quarter)
    if seconds < 10:
        return None
    try:
        body = httpx.get(run.prometheus.url + "/api/v1/query", params={
            "query": step_moments_query('job="chunkpilot-tuned"', seconds), "time": at}, timeout=20).json()
        terms = {r["metric"][m.STEP_COST_TERM_LABEL]: float(r["value"][1]) for r in body["data"]["result"]
                 if m.STEP_COST_TERM_LABEL in r["metric"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return measured_over_predicted(run.sizing.model, terms)


def summary_line(run: DemoRun) -> str:
    s = summary(run)
    t, f = s["tuned"], s["fixed"]
    ratio = f"{t['goodput'] / f['goodput']:.2f}x" if f["goodput"] > 0 else "n/a (the fixed group met no SLO)"
    c = run.config
    shapes = c.shapes()
    (lo, hi), (out_lo, out_hi) = shapes["rag"].prompt, shapes["chat"].output
    line = (f"SLO attainment: tuned {t['attainment']:.0%} vs fixed start-up knobs {f['attainment']:.0%}; goodput "
            f"{t['goodput']:.2f} vs {f['goodput']:.2f} req/s ({ratio}), same requests, same machine, same run "
            f"({c.rate:g} req/s per engine at the busiest, long prompts {lo}-{hi} tokens, outputs {out_lo}-{out_hi} tokens, ITL SLO {c.itl_slo:g} s"
            f"{', sized to this machine' if c.size_to_host else ''})")
    sizing = run.sizing
    if sizing is not None and sizing.checks:
        check = sizing.checks[-1]
        line += (f"; before the load, {'passed' if check.ok else 'NOT passed'} after {len(sizing.checks)} "
                 f"check{'s' * (len(sizing.checks) != 1)}: {check.line()}")
    busy = getattr(run, "busy_contention", None)
    if busy:
        line += f"; the busy phase's steps took {busy:.2f}x the probe fit's prediction"
    host = host_line(run)
    return line + (f"; {host}" if host else "")


def host_line(run: DemoRun) -> str:
    """How busy other programs kept the host in each phase (chunkpilot.demo.host), for the summary line."""
    sizing = run.sizing
    parts = []
    if sizing is not None and sizing.probe_busy is not None:
        parts.append(f"{sizing.probe_busy:.0%} in the probe")
    checks = [c.busy for c in (sizing.checks if sizing else []) if c.busy is not None]
    if checks:
        parts.append(f"{'/'.join(f'{b:.0%}' for b in checks)} in the check{'s' * (len(checks) > 1)}")
    if run.run_busy is not None:
        parts.append(f"{run.run_busy:.0%} in the load")
    return "other programs' share of the CPU: " + ", ".join(parts) if parts else ""


def figure(run: DemoRun, data: dict):
    """The report's figure. The three time panels share one axis, labelled on the lowest of them; the tuner's
    windows get an axis of their own (sharing it with the time panels is what hid every time label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = run.config
    fig = plt.figure(figsize=(9, 13.5))
    grid = fig.add_gridspec(5, 1)
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
        colors_ = ["tab:green" if t.feasible else "tab:red" for t in trials]
        for row, key, slo, what in ((3, "itl", c.itl_slo, "ITL p99"), (4, "ttft", c.ttft_slo, "TTFT p99")):
            ax = fig.add_subplot(grid[row])
            ax.scatter(xs, [getattr(t.window, key) or 0 for t in trials], c=colors_, label="measured")
            predicted = [(x, getattr(t.forecast, key)) for x, t in zip(xs, trials)
                         if t.forecast is not None and getattr(t.forecast, key)]
            if predicted:  # the step-time model's prediction for the same knobs at the same load
                ax.scatter(*zip(*predicted), facecolors="none", edgecolors="k", label="predicted")
            for x, t in zip(xs, trials):
                ax.annotate(f"{t.knobs.token_budget}/{t.knobs.max_chunk}", (x, getattr(t.window, key) or 0),
                            fontsize=6, rotation=45)
            ax.axhline(slo, color="k", ls="--", lw=1)
            ax.set(xlabel="tuner window", ylabel=f"{what} (s)", yscale="log",
                   title=f"tuner windows, {what} (green: within the SLOs), labelled budget/chunk; hollow: predicted")
            ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(summary_line(run), 150), fontsize=8)  # the sizing note makes it long
    fig.tight_layout()
    return fig


def plot(run: DemoRun, data: dict) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(run, data)
    path = run.config.out / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
