"""The tuner against an exhaustive grid, on the simulator (real scheduler, step times fitted on this machine).

Mixed workload (80 % chat, 20 % long prompts), a tight inter-token-latency SLO. For every point of the search space
the goodput of fixed knobs over a long run; then the tuner online from vLLM's default budget (2048), 15 trials,
for several seeds; the knobs it ends with are evaluated on the same long run. Targets: >= 95 % of the grid-best
goodput within 15 trials, >= 1.3x the goodput of a fixed budget of 2048.

    python bench/tuner_vs_grid.py [--seeds 10] [--rate 0.9] [--itl 0.25] [--ttft 20] [--trials 15]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import conditions, pyplot, save

from chunkpilot.tuner.loop import TunerSettings
from chunkpilot.tuner.measurement import LatencyTarget, SLOTargets
from chunkpilot.tuner.sim.costmodel import default
from chunkpilot.tuner.sim.experiment import Scenario, evaluate, tune
from chunkpilot.tuner.space import Knobs, SearchSpace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--rate", type=float, default=0.9)
    ap.add_argument("--itl", type=float, default=0.25, help="p99 inter-token latency SLO, seconds")
    ap.add_argument("--ttft", type=float, default=20.0, help="p99 time-to-first-token SLO, seconds")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--eval-seconds", type=float, default=600.0)
    args = ap.parse_args()

    cost = default()
    slo = SLOTargets(ttft=LatencyTarget(0.99, args.ttft), itl=LatencyTarget(0.99, args.itl))
    scenario = Scenario(rate=args.rate)
    space = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)
    t0 = time.time()
    grid = {k: evaluate(k, scenario, cost, slo, seconds=args.eval_seconds) for k in space.all_knobs()}
    best_k = max(grid, key=lambda k: grid[k].goodput)
    best = grid[best_k].goodput
    fixed = grid[Knobs(2048, 2048)].goodput
    print(f"grid: {len(grid)} knob settings in {time.time() - t0:.0f}s; best {best_k.token_budget}/{best_k.max_chunk}"
          f" goodput {best:.3f} req/s; fixed 2048/2048 {fixed:.3f} req/s")
    settings = TunerSettings(window=args.window, warmup=10, max_trials=args.trials, min_requests=15)
    runs = []
    for seed in range(args.seeds):
        r = tune(scenario, cost, slo, space, settings, iterations=args.trials, start=Knobs(2048, 2048), seed=seed)
        found = evaluate(r.best, scenario, cost, slo, seconds=args.eval_seconds).goodput
        curve = [evaluate(k, scenario, cost, slo, seconds=args.eval_seconds).goodput if k else 0.0
                 for k in r.best_after]
        runs.append({"seed": seed, "best": [r.best.token_budget, r.best.max_chunk], "goodput": found,
                     "of_grid_best": found / best, "vs_fixed_2048": found / fixed, "curve": curve,
                     "trials": r.trials})
        print(f"seed {seed}: {r.best.token_budget}/{r.best.max_chunk} -> {found:.3f} req/s = {found / best:.1%} of "
              f"grid best, {found / fixed:.2f}x fixed 2048")
    shares = [r["of_grid_best"] for r in runs]
    gains = [r["vs_fixed_2048"] for r in runs]
    hit = sum(s >= 0.95 for s in shares)
    print(f"tuner after {args.trials} trials: median {np.median(shares):.1%} of grid best (min {min(shares):.1%}, "
          f"{hit}/{len(runs)} seeds >= 95 %); median {np.median(gains):.2f}x fixed 2048 (min {min(gains):.2f}x)")

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    budgets, chunks = list(space.budgets), list(space.chunks)
    heat = np.full((len(chunks), len(budgets)), np.nan)
    for k, w in grid.items():
        heat[chunks.index(k.max_chunk) if k.max_chunk in chunks else 0, budgets.index(k.token_budget)] = w.goodput
    im = ax1.imshow(heat, origin="lower", aspect="auto", cmap="viridis")
    ax1.set(xticks=range(len(budgets)), xticklabels=budgets, yticks=range(len(chunks)), yticklabels=chunks,
            xlabel="token budget", ylabel="max chunk", title="goodput (req/s) of fixed knobs")
    ax1.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax1.tick_params(axis="y", labelsize=7)
    fig.colorbar(im, ax=ax1)
    for r in runs:
        ax2.plot(range(1, len(r["curve"]) + 1), r["curve"], color="tab:blue", alpha=0.35)
    ax2.axhline(best, color="k", ls="--", lw=1, label="grid best")
    ax2.axhline(0.95 * best, color="k", ls=":", lw=1, label="95 % of grid best")
    ax2.axhline(fixed, color="tab:red", lw=1, label="fixed budget 2048")
    ax2.set(xlabel="trial", ylabel="goodput of the tuner's best so far (req/s)",
            title=f"tuner, {len(runs)} seeds, ITL p99 <= {args.itl:g}s")
    ax2.legend(fontsize=8)
    save("tuner_vs_grid", {"conditions": conditions(rate=args.rate, slo={"itl_p99": args.itl, "ttft_p99": args.ttft},
                                                    trials=args.trials, window=args.window, cost_model=cost.note),
                           "grid": [{"token_budget": k.token_budget, "max_chunk": k.max_chunk, **w.to_dict()}
                                    for k, w in grid.items()],
                           "grid_best": {"knobs": [best_k.token_budget, best_k.max_chunk], "goodput": best},
                           "fixed_2048_goodput": fixed, "runs": runs,
                           "summary": {"median_of_grid_best": float(np.median(shares)), "min_of_grid_best": min(shares),
                                       "seeds_at_95pct": hit, "median_vs_fixed_2048": float(np.median(gains)),
                                       "min_vs_fixed_2048": min(gains)}}, fig)


if __name__ == "__main__":
    main()
