"""The predictor (chunkpilot.tuner.predictor) against the simulator: for each workload mix, arrival rate and knob
setting, the simulated window's p99 ITL and TTFT next to what the predictor says from that window's load and the
same step cost (the fitted CPU model as a StepModel). Ratios measured side by side in one run.

    python bench/predictor_vs_sim.py [--seconds 300]
"""

from __future__ import annotations

import argparse

from common import conditions, pyplot, save

from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner.predictor import predict
from chunkpilot.sim.costmodel import default
from chunkpilot.sim.experiment import Scenario
from chunkpilot.sim.simulator import Simulator
from chunkpilot.tuner.space import Knobs

KNOBS = [Knobs(48, 48), Knobs(128, 64), Knobs(256, 128), Knobs(512, 256), Knobs(2048, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=300.0)
    args = ap.parse_args()
    cost = default()
    model = cost.as_step_model()
    slo = SLOTargets(ttft=LatencyTarget(0.99, 5.0), itl=LatencyTarget(0.99, 0.5))
    rows = []
    for mix in ("chat", "mixed"):
        for rate in (0.5, 0.9):
            for k in KNOBS:
                sim = Simulator(cost, Scenario(rate=rate, mix=mix, seed=0).workload(args.seconds + 60, 1000), k)
                sim.advance(60 + args.seconds)
                w, p = sim.window(args.seconds, slo), predict(model, k, sim.load(args.seconds))
                rows.append({"mix": mix, "rate": rate, "token_budget": k.token_budget, "max_chunk": k.max_chunk,
                             "itl_simulated": w.itl, "itl_predicted": p.itl_p99, "ttft_simulated": w.ttft,
                             "ttft_predicted": p.ttft_p99, "utilization": p.utilization})
                print(f"{mix:5s} {rate:.1f} req/s {k.token_budget:4d}/{k.max_chunk:<4d}  ITL p99 {w.itl:.3f} s, "
                      f"predicted x{p.itl_p99 / w.itl:.2f}; TTFT p99 {w.ttft:.2f} s, predicted "
                      f"x{p.ttft_p99 / w.ttft:.2f}", flush=True)
    within = sum(1 for r in rows if abs(r["itl_predicted"] / r["itl_simulated"] - 1) <= 0.25)
    print(f"ITL p99 within 25 % in {within}/{len(rows)} cases")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key in zip(axes, ("itl", "ttft")):
        xs, ys = [r[f"{key}_simulated"] for r in rows], [r[f"{key}_predicted"] for r in rows]
        ax.scatter(xs, ys)
        lim = [min(xs + ys) * 0.8, max(xs + ys) * 1.2]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set(xscale="log", yscale="log", xlabel=f"simulated {key.upper()} p99 (s)",
               ylabel=f"predicted {key.upper()} p99 (s)", title=f"{key.upper()} p99: predictor vs simulator")
    save("predictor_vs_sim", {"conditions": conditions(seconds=args.seconds, cost_model=cost.note), "rows": rows,
                              "itl_within_25pct": within}, fig)


if __name__ == "__main__":
    main()
