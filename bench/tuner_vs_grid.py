"""The model-guided and the black-box tuner side by side against an exhaustive grid, on the simulator (real
scheduler; step times from the CPU fit of this machine, or from a GPU-shaped roofline).

Six scenarios (rates 0.7-1.1 req/s of the mixed workload, ITL SLOs 0.25-0.5 s, six workload seeds), each on both
cost shapes. For every point of the search space the goodput of fixed knobs over a long run; then each tuner
online from vLLM's default budget (2048), 15 trials, for many seeds; its knobs after every trial are looked up in
the grid. What it costs to get there is counted too: every tuning window (trials, cut probes, thin windows)
whose measured p99 is over an SLO itself (not the tuner's margin), and over twice an SLO.

Targets (model-guided), with and without contention noise: every seed >= 95 % of the grid best; median trials to
95 % <= 2; median share of tuning windows over the SLO <= 10 %; no window over 2x an SLO in the median seed.

With --contention N every step's time is drawn at random between 1 and 1 + N times its fastest, the mean kept
(sim.costmodel.Contended; the grid is evaluated under the same noise): a step-time fit on a shared machine, where
the truth is known.

    python bench/tuner_vs_grid.py [--seeds 30] [--cost cpu,gpu] [--guidance model,blackbox] [--jobs 2]
                                  [--contention 1.0]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from common import conditions, pyplot, save

from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner.loop import TunerSettings
from chunkpilot.sim.costmodel import default, gpu_shaped
from chunkpilot.sim.experiment import Scenario, evaluate, tune
from chunkpilot.tuner.space import Knobs, SearchSpace

TTFT_SLO = 20.0
START = Knobs(2048, 2048)
COSTS = {"cpu": default, "gpu": gpu_shaped}


@dataclass(frozen=True)
class Case:
    name: str
    rate: float
    itl: float
    seed: int  # the workload's seed


SCENARIOS = (Case("0.9/0.25", 0.9, 0.25, 0), Case("0.7/0.25", 0.7, 0.25, 1), Case("1.0/0.25", 1.0, 0.25, 2),
             Case("1.1/0.5", 1.1, 0.5, 3), Case("0.9/0.5", 0.9, 0.5, 4), Case("0.7/0.5", 0.7, 0.5, 5))
SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)


def _slo(case: Case) -> SLOTargets:
    return SLOTargets(ttft=LatencyTarget(0.99, TTFT_SLO), itl=LatencyTarget(0.99, case.itl))


def grid_point(args) -> tuple[Knobs, float]:
    cost, case, knobs, seconds, contention = args
    return knobs, evaluate(knobs, Scenario(rate=case.rate, seed=case.seed, contention=contention), COSTS[cost](),
                           _slo(case),
                           seconds=seconds).goodput


def tune_run(args) -> dict:
    cost, case, guidance, seed, trials, window, contention = args
    settings = TunerSettings(window=window, warmup=10, max_trials=trials, min_requests=15, guidance=guidance)
    r = tune(Scenario(rate=case.rate, seed=case.seed, contention=contention), COSTS[cost](), _slo(case), SPACE, settings,
             iterations=trials, start=START, seed=seed)
    windows = [h for h in r.trials if h.kind.trial]

    def over(h, factor=1.0):
        return any(v is not None and v > factor * t for v, t in ((h.window.itl, case.itl), (h.window.ttft, TTFT_SLO)))
    return {"seed": seed, "best_after": [[k.token_budget, k.max_chunk] if k else None for k in r.best_after],
            "windows": len(windows), "over_slo": sum(over(h) for h in windows),
            "over_2x": sum(over(h, 2.0) for h in windows),
            "tried": [[h.knobs.token_budget, h.knobs.max_chunk, h.kind.value, h.window.itl, h.window.ttft,
                       h.forecast.itl if h.forecast else None, h.forecast.ttft if h.forecast else None]
                      for h in r.trials]}


def summarize(runs: list[dict], grid: dict, best: float, fixed: float) -> dict:
    for r in runs:
        curve = [grid[Knobs(*k)] / best if k else 0.0 for k in r["best_after"]]
        r["curve"] = curve
        r["of_grid_best"] = curve[-1] if curve else 0.0
        r["vs_fixed_2048"] = curve[-1] * best / fixed if curve and fixed > 0 else float("inf")
        r["trials_to_95"] = next((i + 1 for i, c in enumerate(curve) if c >= 0.95), None)
        r["share_over_slo"] = r["over_slo"] / r["windows"] if r["windows"] else 0.0
        r["final"] = r.pop("best_after")[-1] if r.get("best_after") else None
        r["curve"] = [round(c, 3) for c in curve]
        del r["tried"]  # 720 runs of windows: megabytes; the summary keeps what they measured
    t95 = [r["trials_to_95"] if r["trials_to_95"] is not None else np.inf for r in runs]
    return {"seeds": len(runs), "seeds_at_95pct": sum(r["of_grid_best"] >= 0.95 for r in runs),
            "min_of_grid_best": min(r["of_grid_best"] for r in runs),
            "median_of_grid_best": float(np.median([r["of_grid_best"] for r in runs])),
            "median_trials_to_95": float(np.median(t95)),
            "median_share_over_slo": float(np.median([r["share_over_slo"] for r in runs])),
            "max_share_over_slo": max(r["share_over_slo"] for r in runs),
            "median_windows_over_2x": float(np.median([r["over_2x"] for r in runs])),
            "median_vs_fixed_2048": float(np.median([r["vs_fixed_2048"] for r in runs]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--cost", default="cpu,gpu")
    ap.add_argument("--guidance", default="model,blackbox")
    ap.add_argument("--scenarios", default=",".join(c.name for c in SCENARIOS))
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--eval-seconds", type=float, default=600.0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--contention", type=float, default=0.0,
                    help="each simulated step's time drawn between 1 and 1 + this times its fastest (1: up "
                         "to 2x), the mean kept")
    ap.add_argument("--out", default="tuner_vs_grid", help="results name under bench/results/")
    args = ap.parse_args()
    costs, modes = args.cost.split(","), args.guidance.split(",")
    cases = [c for c in SCENARIOS if c.name in args.scenarios.split(",")]
    t0 = time.time()
    results = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for cost in costs:
            for case in cases:
                grid = dict(pool.map(grid_point, [(cost, case, k, args.eval_seconds, args.contention)
                                                        for k in SPACE.all_knobs()]))
                best_k = max(grid, key=grid.get)
                best, fixed = grid[best_k], grid[START]
                entry = {"cost": cost, "scenario": case.name, "rate": case.rate, "itl_slo": case.itl,
                         "grid_best": {"knobs": [best_k.token_budget, best_k.max_chunk], "goodput": best},
                         "fixed_2048_goodput": fixed,
                         "grid": [[k.token_budget, k.max_chunk, g] for k, g in grid.items()], "modes": {}}
                for mode in modes:
                    runs = list(pool.map(tune_run, [(cost, case, mode, s, args.trials, args.window,
                                                     args.contention) for s in range(args.seeds)]))
                    entry["modes"][mode] = {"summary": summarize(runs, grid, best, fixed), "runs": runs}
                    s = entry["modes"][mode]["summary"]
                    print(f"{cost} {case.name:9s} {mode:8s} grid best {best_k.token_budget}/{best_k.max_chunk} "
                          f"{best:.3f}: {s['seeds_at_95pct']}/{s['seeds']} seeds >= 95 % (min "
                          f"{s['min_of_grid_best']:.0%}), trials to 95 % {s['median_trials_to_95']:g}, windows over "
                          f"SLO {s['median_share_over_slo']:.0%} (max {s['max_share_over_slo']:.0%}), over 2x "
                          f"{s['median_windows_over_2x']:g}, {s['median_vs_fixed_2048']:.2f}x fixed 2048 "
                          f"[{time.time() - t0:.0f}s]", flush=True)
                results.append(entry)

    totals = {}
    for cost in costs:
        for mode in modes:
            runs = [r for e in results if e["cost"] == cost for r in e["modes"][mode]["runs"]]
            t95 = [r["trials_to_95"] if r["trials_to_95"] is not None else np.inf for r in runs]
            totals[f"{cost}/{mode}"] = {
                "runs": len(runs), "at_95pct": sum(r["of_grid_best"] >= 0.95 for r in runs),
                "median_trials_to_95": float(np.median(t95)),
                "median_share_over_slo": float(np.median([r["share_over_slo"] for r in runs])),
                "median_windows_over_2x": float(np.median([r["over_2x"] for r in runs])),
                "median_of_grid_best": float(np.median([r["of_grid_best"] for r in runs])),
                "median_vs_fixed_2048": float(np.median([r["vs_fixed_2048"] for r in runs]))}
            t = totals[f"{cost}/{mode}"]
            print(f"ALL {cost} {mode:8s}: {t['at_95pct']}/{t['runs']} runs >= 95 % of grid best (median "
                  f"{t['median_of_grid_best']:.1%}), median trials to 95 % {t['median_trials_to_95']:g}, median "
                  f"share of windows over SLO {t['median_share_over_slo']:.0%}, median windows over 2x "
                  f"{t['median_windows_over_2x']:g}, median {t['median_vs_fixed_2048']:.2f}x fixed 2048")

    plt = pyplot()
    fig, axes = plt.subplots(1, len(costs), figsize=(6 * len(costs), 4.2), squeeze=False)
    colors = {"model": "tab:blue", "blackbox": "tab:orange"}
    for ax, cost in zip(axes[0], costs):
        for mode in modes:
            runs = [r for e in results if e["cost"] == cost for r in e["modes"][mode]["runs"]]
            ax.scatter([r["share_over_slo"] for r in runs], [r["of_grid_best"] for r in runs], s=10, alpha=0.5,
                       color=colors.get(mode), label=f"{mode} ({len(runs)} runs)")
        ax.axhline(0.95, color="k", ls=":", lw=1)
        ax.axvline(0.10, color="k", ls=":", lw=1)
        ax.set(xlabel="share of tuning windows over the SLO", ylabel="final goodput / grid best",
               title=f"{cost} cost: {len(cases)} scenarios x {args.seeds} seeds")
        ax.legend(fontsize=8)
    save(args.out, {"conditions": conditions(trials=args.trials, window=args.window, ttft_slo=TTFT_SLO,
                                             contention=args.contention,
                                             start=[START.token_budget, START.max_chunk],
                                             costs={c: COSTS[c]().note for c in costs}),
                           "totals": totals, "scenarios": results}, fig)


if __name__ == "__main__":
    main()
