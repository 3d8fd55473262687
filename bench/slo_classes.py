"""Per-request SLO classes against first come first served, side by side in one run on this CPU (issue 55).

A trace of interactive chat (60 % of requests: prompts 32-256 tokens, outputs 16-64; tight TTFT and ITL) and batch
summaries (prompts 512-1,536 tokens, outputs 32-96; loose SLOs), Poisson arrivals, the same requests for every arm
at each rate of a ladder. Arms, one engine each on both cores, one at a time:
* fcfs-B/C: today's engine (no classes) at token budget B and chunk C, for each knob pair of the grid; per rate
  the best of them in hindsight for the interactive SLO (then batch throughput) is "FCFS";
* classes: the engine with two classes (interactive priority 10, batch 0) at the default knobs (512/512, caps).

Reported per rate and arm: the interactive requests within both SLOs (their TTFT, their own p99 gap), batch output
tokens/s (over the run until its last batch request ended), batch requests past their TTFT deadline or failed.
Targets (issue 55): at the rate where FCFS keeps the interactive SLO for at most 80 %: classes >= 99 %, batch
throughput >= 90 % of FCFS's, no batch request past its deadline; the highest rate at >= 99 % interactive, classes
over FCFS, >= 1.3x; at the ladder's top (about twice FCFS's capacity) >= 10x fewer interactive violations.
Beside each measured figure the simulator's prediction (sim/simulator.py, the shipped step cost: an engine on both
cores), and `--predict-only` runs the simulator alone (seconds).

    python bench/slo_classes.py [--seconds 60] [--rates 0.3,0.45,0.6,0.9,1.2]
    python bench/slo_classes.py --predict-only

Writes bench/results/slo_classes.json and .png (or slo_classes_predicted.json)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np
from common import conditions, model_dir, pyplot, save

from chunkpilot.contract.slo import SLOClass, SLOClasses, SLOTargets, kept
from chunkpilot.demo.engines import EngineProcess
from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark_async
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.sim import costmodel
from chunkpilot.sim.simulator import Simulator
from chunkpilot.tuner.space import Knobs

SHAPES = {"interactive": ((32, 256), (16, 64)), "batch": ((512, 1536), (32, 96))}
SHARE = {"interactive": 0.6, "batch": 0.4}
RATES = (0.3, 0.45, 0.6, 0.9, 1.2)
# FCFS's grid, best in hindsight per rate: the simulator's best for the interactive SLO on this trace were 256/64
# and 128/32 (small chunks keep the ITL; a budget well above the chunk keeps several prompts moving), 128/128 the
# middle. (A first run with batch prompts of 1,024-3,072 tokens and 256/32 kept no interactive request at 0.3/s:
# eight 32-token chunks deep in long prompts made 0.3-s steps.)
GRID = (Knobs(128, 32), Knobs(256, 64), Knobs(128, 128))
CLASS_KNOBS = Knobs(512, 512)  # the engine's defaults: caps, the classes size each step
VOCAB = 40000
COMMON = ("--max-model-len", "4096", "--max-num-seqs", "32", "--dtype", "float32")


def classes(ttft: float, itl: float) -> SLOClasses:
    return SLOClasses((SLOClass("interactive", 10, SLOTargets.p99(ttft=ttft, itl=itl)),
                       SLOClass("batch", 0, SLOTargets.p99(ttft=120.0, itl=5.0))), "interactive")


def trace(rate: float, seconds: float, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t > seconds:
            return out
        kind = "interactive" if rng.random() < SHARE["interactive"] else "batch"
        (p_lo, p_hi), (o_lo, o_hi) = SHAPES[kind]
        p = int(rng.integers(p_lo, p_hi + 1))
        out.append(RequestSpec(kind, [int(x) for x in rng.integers(100, VOCAB, p)], int(rng.integers(o_lo, o_hi + 1)),
                               t, p, slo_class=kind))


def score(records: list, cls: SLOClasses) -> dict:
    """Interactive attainment, batch tokens/s and deadline misses, errors."""
    inter = [r for r in records if r.kind == "interactive"]
    batch = [r for r in records if r.kind == "batch"]
    i_slo, b_slo = cls.get("interactive").slo, cls.get("batch").slo
    within = sum(1 for r in inter if r.ok and kept(i_slo, r.ttft, r.itls))
    done = [r for r in batch if r.ok]
    span = max((r.end for r in done), default=0.0) - min((r.start for r in records), default=0.0)
    t0 = min((r.start for r in records), default=0.0)
    # each interactive miss, what it missed by: the diagnosis a target missed by one request needs
    missed = [{"at": round(r.start - t0, 2), "prompt": r.prompt_tokens, "output": r.output_tokens,
               "ttft": None if r.ttft is None else round(r.ttft, 3),
               "p99_gap": round(float(np.percentile(r.itls, 99)), 3) if r.itls else None,
               "gaps_over": sum(1 for g in r.itls if g > i_slo.itl.threshold), "error": r.error}
              for r in inter if not (r.ok and kept(i_slo, r.ttft, r.itls))]
    return {"interactive": len(inter), "interactive_within_slo": within / max(1, len(inter)),
            "interactive_missed": missed,
            "interactive_violations": len(inter) - within,
            "batch": len(batch), "batch_tokens_per_s": sum(r.output_tokens for r in done) / span if span > 0 else 0.0,
            "batch_past_deadline": sum(1 for r in batch if not r.ok or r.ttft > b_slo.ttft.threshold),
            "errors": sum(1 for r in records if r.error)}


def predict(knobs: Knobs, specs: list[RequestSpec], cls: SLOClasses | None) -> dict:
    sim = Simulator(costmodel.default(), specs, knobs, max_num_seqs=32, max_model_len=4096, classes=cls,
                    class_of={"interactive": "interactive", "batch": "batch"})
    return score(sim.run(), cls or classes(*SLOS))


def arm_name(knobs: Knobs | None) -> str:
    return "classes" if knobs is None else f"fcfs-{knobs.token_budget}/{knobs.max_chunk}"


def measure(model: str, logs: Path, knobs: Knobs | None, cls: SLOClasses, rates, seconds: float) -> list[dict]:
    """One engine (FCFS at `knobs`, or with classes), every rate of the ladder on it."""
    k = knobs or CLASS_KNOBS
    args = [*COMMON, "--token-budget", str(k.token_budget), "--max-chunk", str(k.max_chunk)]
    if knobs is None:
        args += ["--slo-classes", cls.to_json()]
    engine = EngineProcess(model, arm_name(knobs).replace("/", "-"), logs, *args).wait_ready()
    out = []
    try:
        asyncio.run(run_benchmark_async(BenchmarkConfig(engine.url, "smollm2", trace(2.0, 4.0, 99), progress=False)))
        counted = engine_counts(engine.url)  # after the warm-up
        for i, rate in enumerate(rates):
            specs = trace(rate, seconds, 1000 + i)
            res = asyncio.run(run_benchmark_async(BenchmarkConfig(engine.url, "smollm2", specs, progress=False,
                                                                  timeout=900)))
            got = score(res.records, cls)
            got["predicted"] = predict(k, specs, cls if knobs is None else None)
            got["predicted"].pop("interactive_missed")
            if knobs is not None:  # FCFS misses most: the list is the classes arm's diagnosis
                got.pop("interactive_missed")
            now = engine_counts(engine.url)
            if knobs is None:  # the classes arm: what the engine counted, beside what the client measured
                got["relegated"] = int(now["relegated"] - counted["relegated"])
                finished = now["interactive_finished"] - counted["interactive_finished"]
                got["interactive_within_slo_engine"] = (now["interactive_kept"] - counted["interactive_kept"]) / \
                    max(1.0, finished)
            counted = now
            out.append({"rate": rate, **got})
            engine_view = (f", {got['interactive_within_slo_engine']:6.1%} by the engine's count"
                           if knobs is None else "")
            print(f"  {arm_name(knobs):>14} rate {rate:4.2f}/s: interactive {got['interactive_within_slo']:6.1%} "
                  f"within SLOs{engine_view} (predicted {got['predicted']['interactive_within_slo']:6.1%}), batch "
                  f"{got['batch_tokens_per_s']:6.1f} tok/s, {got['batch_past_deadline']} past deadline, "
                  f"{got['errors']} errors", flush=True)
    finally:
        engine.stop()
    return out


def engine_counts(url: str) -> dict[str, float]:
    """The engine's own counters so far: relegations, and the interactive requests finished and kept by the
    engine's count (its gaps as the step loop saw them, before the HTTP stream and the client)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from chunkpilot.contract import metric_names as m

    out = {"relegated": 0.0, "interactive_finished": 0.0, "interactive_kept": 0.0}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for x in fam.samples:
            inter = x.labels.get(m.SLO_CLASS_LABEL) == "interactive"
            if x.name == m.RELEGATED:
                out["relegated"] += x.value
            elif x.name == m.REQUEST_SUCCESS and inter:
                out["interactive_finished"] += x.value
            elif x.name == m.SLO_MET and inter:
                out["interactive_kept"] += x.value
    return out


def sustainable(ladder: list[dict]) -> float:
    """The highest rate of the ladder (going up, until one fails) with >= 99 % of interactive requests within."""
    best = 0.0
    for rung in ladder:
        if rung["interactive_within_slo"] < 0.99:
            break
        best = rung["rate"]
    return best


def verdict(arms: dict[str, list[dict]], rates) -> dict:
    fcfs_arms = [a for a in arms if a != "classes"]
    best = []  # FCFS best in hindsight, per rate
    for i, rate in enumerate(rates):
        name = max(fcfs_arms, key=lambda a: (arms[a][i]["interactive_within_slo"], arms[a][i]["batch_tokens_per_s"]))
        best.append({**arms[name][i], "arm": name})
    cls = arms["classes"]
    out: dict = {"fcfs_best": best}
    at = next((i for i, b in enumerate(best) if b["interactive_within_slo"] <= 0.8), None)
    if at is not None:
        out["at_fcfs_80"] = {
            "rate": rates[at], "fcfs_arm": best[at]["arm"],
            "fcfs_interactive": best[at]["interactive_within_slo"], "classes_interactive": cls[at]["interactive_within_slo"],
            "batch_throughput_ratio": cls[at]["batch_tokens_per_s"] / max(1e-9, best[at]["batch_tokens_per_s"]),
            "classes_batch_past_deadline": cls[at]["batch_past_deadline"]}
    out["sustainable_fcfs"] = max(sustainable([arms[a][i] for i in range(len(rates))]) for a in fcfs_arms)
    out["sustainable_classes"] = sustainable(cls)
    out["sustainable_ratio"] = out["sustainable_classes"] / out["sustainable_fcfs"] if out["sustainable_fcfs"] else None
    top = len(rates) - 1
    out["top_rate"] = rates[top]
    out["violations_ratio_at_top"] = best[top]["interactive_violations"] / max(1, cls[top]["interactive_violations"])
    out["targets"] = {
        "interactive_99_at_fcfs_80": bool(at is not None and out["at_fcfs_80"]["classes_interactive"] >= 0.99),
        "batch_throughput_90": bool(at is not None and out["at_fcfs_80"]["batch_throughput_ratio"] >= 0.9),
        "no_batch_past_deadline": bool(at is not None and out["at_fcfs_80"]["classes_batch_past_deadline"] == 0),
        "sustainable_1_3x": bool(out["sustainable_ratio"] and out["sustainable_ratio"] >= 1.3),
        "violations_10x_at_top": out["violations_ratio_at_top"] >= 10,
    }
    return out


def plot(arms: dict[str, list[dict]], rates, name: str) -> None:
    plt = pyplot()
    if not hasattr(plt, "subplots"):  # no matplotlib: JSON only
        save(name, RESULT)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, ladder in arms.items():
        style = "-o" if arm == "classes" else "--."
        a.plot(rates, [r["interactive_within_slo"] * 100 for r in ladder], style, label=arm)
        b.plot(rates, [r["batch_tokens_per_s"] for r in ladder], style, label=arm)
    a.axhline(99, color="grey", lw=0.5)
    a.set(xlabel="requests/s", ylabel="interactive within SLOs, %", title="interactive attainment")
    b.set(xlabel="requests/s", ylabel="batch output tokens/s", title="batch throughput")
    a.legend(fontsize=8)
    save(name, RESULT, fig)


SLOS = (3.0, 0.5)
RESULT: dict = {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="arrivals per rate, seconds")
    ap.add_argument("--rates", default=",".join(map(str, RATES)))
    ap.add_argument("--ttft", type=float, default=SLOS[0], help="interactive TTFT SLO, seconds (p99)")
    ap.add_argument("--itl", type=float, default=SLOS[1], help="interactive ITL SLO, seconds (p99 of a request's gaps)")
    ap.add_argument("--predict-only", action="store_true")
    ap.add_argument("--arms", default="", help="only these arms (comma-separated names, e.g. classes): a diagnosis "
                    "run; no verdict, writes slo_classes_partial.json")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    cls = classes(args.ttft, args.itl)
    arms: dict[str, list[dict]] = {}
    if args.predict_only:
        for knobs in (*GRID, None):
            arms[arm_name(knobs)] = []
            for i, rate in enumerate(rates):
                specs = trace(rate, args.seconds, 1000 + i)
                arms[arm_name(knobs)].append({"rate": rate, **predict(knobs or CLASS_KNOBS, specs,
                                                                       cls if knobs is None else None)})
                arms[arm_name(knobs)][-1].pop("interactive_missed")
                r = arms[arm_name(knobs)][-1]
                print(f"  {arm_name(knobs):>14} rate {rate:4.2f}/s: interactive {r['interactive_within_slo']:6.1%}, "
                      f"batch {r['batch_tokens_per_s']:6.1f} tok/s, {r['batch_past_deadline']} past deadline")
        name = "slo_classes_predicted"
    else:
        model = model_dir()
        with tempfile.TemporaryDirectory() as logs:
            for knobs in (*GRID, None):
                if args.arms and arm_name(knobs) not in args.arms.split(","):
                    continue
                arms[arm_name(knobs)] = measure(model, Path(logs), knobs, cls, rates, args.seconds)
        name = "slo_classes"
    if args.arms:  # a partial run judges nothing
        RESULT.update({"conditions": conditions(seconds=args.seconds, arms=args.arms), "rates": rates, "arms": arms})
        save("slo_classes_partial", RESULT)
        return
    v = verdict(arms, rates)
    RESULT.update({"conditions": conditions(seconds=args.seconds, slo={"ttft": args.ttft, "itl": args.itl},
                                            grid=[[k.token_budget, k.max_chunk] for k in GRID],
                                            predict_only=args.predict_only),
                   "rates": rates, "arms": arms, "verdict": v})
    print(f"at FCFS's <= 80 %: {v.get('at_fcfs_80')}")
    print(f"sustainable at 99 % interactive: classes {v['sustainable_classes']} vs FCFS {v['sustainable_fcfs']} "
          f"req/s ({v['sustainable_ratio']}); interactive violations at {v['top_rate']}/s: "
          f"{v['violations_ratio_at_top']:.1f}x fewer; targets {v['targets']}")
    plot(arms, rates, name)


if __name__ == "__main__":
    main()
