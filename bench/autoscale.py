"""Knobs only, replicas only, and both coordinated, on a load ramp that needs 1 -> 3 -> 1 replicas (the simulator:
the real scheduler per replica, the CPU step cost, a least-loaded balancer, 60-s pod starts).

* knobs-only: the tuner on one replica.
* replicas-only: fixed knobs and an HPA on the waiting queue per pod, swept over its target (what an operator
  tunes to reach an attainment); the cheapest target that reaches the coordinated run's attainment is the
  comparison. Two fixed knobs: vLLM's start-up default (2048, unchunked), and the knobs the tuner chose for the
  calm load before the ramp (tuned once, then frozen).
* coordinated: the tuner with autoscaling auto (knobs first, replicas when no knobs keep the SLOs).

Target: coordinated >= 99 % attainment with >= 20 % fewer replica-seconds than replicas-only at the same
attainment. Printed per seed, then the medians; JSON + PNG in bench/results/autoscale.*.

    python bench/autoscale.py [--seeds 3] [--balancer least-loaded|round-robin]
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor

from common import conditions, pyplot, save

from chunkpilot.tuner.autoscale import ScalingPolicy
from chunkpilot.tuner.loop import TunerSettings
from chunkpilot.sim.costmodel import default
from chunkpilot.sim.scaling import START, Ramp, run_policy
from chunkpilot.tuner.space import Knobs

QUEUE_TARGETS = (4.0, 2.0, 1.0, 0.5, 0.25)
SCALING = ScalingPolicy(mode="auto", min_replicas=1, max_replicas=4, down_stabilization=300.0)
SETTINGS = TunerSettings(window=60.0, warmup=10.0, max_trials=8, min_requests=10)


def one_seed(args) -> dict:
    """Every policy on one seed's ramp: coordinated and knobs-only first, then replicas-only swept over the HPA's
    queue target at vLLM's start-up knobs and at the knobs the coordinated tuner held when the ramp began (tuned
    once at the calm load, then frozen: a careful operator's start-up flags)."""
    seed, balancer = args
    ramp = Ramp(seed=seed)

    def run(policy, **kw):
        return run_policy(policy, ramp, default(), scaling=SCALING, settings=SETTINGS, seed=seed, balancer=balancer,
                          **kw).to_dict()
    coord, knobs = run("coordinated"), run("knobs")
    frozen = Knobs(*coord["at_lead"])
    hpa = {label: [{**run("replicas", queue_target=t, fixed=k), "queue_target": t} for t in QUEUE_TARGETS]
           for label, k in (("start-up knobs", START), (f"tuned-once {frozen.token_budget}/{frozen.max_chunk}", frozen))}
    out = {"seed": seed, "coordinated": coord, "knobs": knobs, "replicas": {}}
    for label, runs in hpa.items():
        by_cost = sorted(runs, key=lambda r: r["replica_seconds"])
        # the cheapest queue target that reaches the coordinated attainment; else the best attainment seen
        match = next((r for r in by_cost if r["attainment"] >= coord["attainment"]),
                     max(runs, key=lambda r: r["attainment"]))
        out["replicas"][label] = {"match": match, "reached": match["attainment"] >= coord["attainment"],
                                  "saving": 1 - coord["replica_seconds"] / match["replica_seconds"], "sweep": runs}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--balancer", default="least-loaded")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    with ProcessPoolExecutor(args.jobs) as pool:
        per_seed = list(pool.map(one_seed, [(s, args.balancer) for s in range(args.seeds)]))
    for p in per_seed:
        c, k = p["coordinated"], p["knobs"]
        print(f"seed {p['seed']}: coordinated {c['attainment']:.1%} with {c['replica_seconds']:.0f} replica-s; "
              f"knobs-only {k['attainment']:.1%} on 1 replica ({k['replica_seconds']:.0f})")
        for label, r in p["replicas"].items():
            m = r["match"]
            print(f"    replicas-only at {label}: queue target {m['queue_target']:g} -> {m['attainment']:.1%} with "
                  f"{m['replica_seconds']:.0f} replica-s; coordinated saves {r['saving']:.0%}"
                  + ("" if r["reached"] else " (never reached the coordinated attainment)"))
    labels = [label.split(" ")[0] for label in per_seed[0]["replicas"]]
    totals = {"coordinated_attainment": statistics.median(p["coordinated"]["attainment"] for p in per_seed),
              "knobs_attainment": statistics.median(p["knobs"]["attainment"] for p in per_seed)}
    for i, short in enumerate(labels):
        rs = [list(p["replicas"].values())[i] for p in per_seed]
        totals[f"replicas_{short}_attainment"] = statistics.median(r["match"]["attainment"] for r in rs)
        totals[f"saving_vs_{short}"] = statistics.median(r["saving"] for r in rs)
        totals[f"targets_met_vs_{short}"] = sum(1 for p, r in zip(per_seed, rs) if p["coordinated"]["attainment"]
                                                >= 0.99 and r["saving"] >= 0.2 and r["reached"])
    print("median: " + ", ".join(f"{k} {v:.1%}" if isinstance(v, float) else f"{k} {v}/{args.seeds}"
                                 for k, v in totals.items()))
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    first = per_seed[0]
    shown = {"coordinated": first["coordinated"], "knobs-only": first["knobs"],
             **{f"replicas-only, {label}": r["match"] for label, r in first["replicas"].items()}}
    for (name, r), color in zip(shown.items(), ("tab:blue", "tab:green", "tab:red", "tab:orange")):
        t = [p[0] for p in r["timeline"]] + [Ramp().seconds]
        n = [p[1] for p in r["timeline"]] + [r["timeline"][-1][1]]
        axes[0].step(t, n, where="post", color=color, label=f"{name}: {r['attainment']:.1%}, "
                                                              f"{r['replica_seconds']:.0f} replica-s")
    axes[0].set(ylabel="replicas asked for", title="seed 0: replicas over the 1 -> 3 -> 1 ramp")
    axes[0].legend(fontsize=8)
    ramp = Ramp()
    t0, xs, ys = 0.0, [], []
    for p in ramp.phases():
        xs += [t0, t0 + p.duration]
        ys += [p.rate, p.rate]
        t0 += p.duration
    axes[1].plot(xs, ys, color="k")
    for t, b, c in first["coordinated"]["knobs"]:
        axes[1].annotate(f"{b}/{c}", (t, ramp.base), fontsize=6, rotation=60)
    axes[1].set(xlabel="seconds", ylabel="req/s offered", title="the load, and the knobs the coordinated tuner set")
    save("autoscale", {"conditions": conditions(seeds=args.seeds, balancer=args.balancer, ramp=ramp.__dict__,
                                                settings=SETTINGS.__dict__, scaling=SCALING.__dict__),
                       "totals": totals, "per_seed": per_seed}, fig)


if __name__ == "__main__":
    main()
