"""Prefill/decode disaggregation against the best colocated setup, side by side in one run on this CPU, each arm at
equal cores: one prefill and one decode engine pinned to one core each, against two colocated engines pinned to one
core each (requests alternate between them, as a Service's round robin does) with the best colocated knobs found in
hindsight; the split with its best threshold in hindsight too.

Goodput: the highest request rate (of a ladder) at which >= 90 % of requests meet both SLOs (their TTFT, and their
own p99 inter-token gap). Traces: prefill-heavy with a tight ITL (prompts 512-1024 tokens, outputs 32-64) and chat
(prompts 16-128, outputs 16-64). Issue 53's targets: the split >= 1.2x the best colocated goodput on the first;
on chat, `auto` (which falls back to colocated where the split does not pay) >= 0.97x. Also the split's TTFT by
phase (queue, remote prefill, transfer) and the transfer's share of the prefill, at its goodput rate; at every rate,
which SLO the misses broke and the first inter-token gap apart from the later ones. The split runs with each
--first-token (early: the first token before the pull; with-kv: after it).

    python bench/disaggregation.py [--requests 12] [--ttft-x 5] [--itl-x 2]
    python bench/disaggregation.py --predict-only   # the simulator's prediction alone, in seconds

Beside every measured arm the simulator's prediction of it (sim/split.py: the same requests, the same knobs, the
step cost rescaled to this run's lone-request figures, the KV transfer's cost from bench/kv_transfer.py's result),
and of more thresholds and chunks than are measured, so the best threshold is predicted before it is tried.
`--predict-only` runs no engine: it takes the lone-request figures and SLOs of the last measured run
(bench/results/disaggregation.json) and writes bench/results/disaggregation_predicted.json.

The SLOs are set from this machine's own speed, measured first on one engine alone: the TTFT SLO is --ttft-x times
a lone 1024-token prompt's TTFT (slack), the ITL SLO --itl-x times a lone decode's inter-token gap (tight): the
regime where the split is meant to win (TaiChi, arXiv 2508.01989), and chat, where it is not.

Writes bench/results/disaggregation.json and .png (or, with --predict-only, disaggregation_predicted.json)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import tempfile
from pathlib import Path

import httpx
import numpy as np
from common import RESULTS, conditions, model_dir, pyplot, save

from chunkpilot.contract.engine_settings import FIRST_TOKEN_MODES
from chunkpilot.contract.metric_names import KV_FALLBACKS, KV_TRANSFERS, TTFT_PHASE
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.demo.engines import EngineProcess
from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark_async
from chunkpilot.loadgen.stats import meets
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.sim import costmodel, transfer
from chunkpilot.sim.calibrate import rescaled
from chunkpilot.sim.split import SplitFleet, colocated
from chunkpilot.tuner.space import Knobs

TRACES = {"prefill_heavy": ((512, 1024), (32, 64)), "chat": ((16, 128), (16, 64))}
# each trace's ladder of rates (requests/s): a 1024-token prompt takes seconds on one core, a chat prompt a tenth
RATES = {"prefill_heavy": (0.1, 0.2, 0.3, 0.4, 0.6), "chat": (0.5, 1.0, 2.0, 3.0, 4.0)}
# what is tried, best in hindsight: the colocated engines' chunk, the split's threshold (every prefill-heavy prompt
# is above either; on chat 0 sends every prompt, 64 about half)
CHUNKS = (64, 256, 512)
THRESHOLDS = {"prefill_heavy": (0,), "chat": (0, 64)}
# what is predicted beside them (the simulator's seconds are cheap): more chunks, and thresholds from every prompt
# (0) to none (inf: the decode engine prefills everything itself under its own small chunk)
PREDICT_CHUNKS = (64, 128, 256, 512)
PREDICT_THRESHOLDS = (0, 64, 128, 256, 512, 768, math.inf)
VOCAB = 40000
COMMON = ("--threads", "1", "--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory-gb", "0.6",
          "--dtype", "float32")


def requests(trace: str, rate: float, n: int, seed: int) -> list[RequestSpec]:
    (p_lo, p_hi), (o_lo, o_hi) = TRACES[trace]
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.exponential(1.0 / rate)
        p = int(rng.integers(p_lo, p_hi + 1))
        out.append(RequestSpec(trace, [int(x) for x in rng.integers(100, VOCAB, p)], int(rng.integers(o_lo, o_hi + 1)),
                               t, p))
    return out


class Arm:
    """Two engines on cores 0 and 1, and where the clients send."""

    def __init__(self, model: str, logs: Path, name: str, kind: str, knob: int, first_token: str = "early") -> None:
        self.name, self.kind, self.knob = name, kind, knob
        if kind == "colocated":  # knob: the chunk (and budget = chunk + max_num_seqs)
            knobs = ("--max-chunk", str(knob), "--token-budget", str(knob + 16))
            self.engines = [EngineProcess(model, f"{name}-{i}", logs, *COMMON, *knobs, cores={i}) for i in (0, 1)]
            self.targets = self.engines
        else:  # knob: the uncached-token threshold
            prefill = EngineProcess(model, f"{name}-p", logs, *COMMON, "--role", "prefill", "--max-chunk", "1024",
                                    "--token-budget", "1040", cores={0})
            prefill.wait_ready()
            decode = EngineProcess(model, f"{name}-d", logs, *COMMON, "--role", "decode", "--prefill-peers",
                                   f"127.0.0.1:{prefill.port}", "--disagg-threshold", str(knob), "--max-chunk", "64",
                                   "--token-budget", "80", "--first-token", first_token, cores={1})
            self.engines = [prefill, decode]
            self.targets = [decode]
        for e in self.engines:
            e.wait_ready()

    def stop(self) -> None:
        for e in self.engines:
            e.stop()

    async def run(self, specs: list[RequestSpec], slo: SLOTargets) -> list:
        # round robin: request i to target i mod n, at its own arrival time
        parts = [specs[i::len(self.targets)] for i in range(len(self.targets))]
        results = await asyncio.gather(*(run_benchmark_async(BenchmarkConfig(
            t.url, "smollm2", part, slo=slo, progress=False, timeout=300)) for t, part in zip(self.targets, parts)))
        return [r for res in results for r in res.records]

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for e in self.targets:
            for fam in text_string_to_metric_families(httpx.get(e.url + "/metrics").text):
                for s in fam.samples:
                    key = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                    out[key] = out.get(key, 0.0) + s.value
        return out


def goodput(arm: Arm, trace: str, rates: list[float], n: int, slo: SLOTargets) -> dict:
    """Up the ladder until a rate fails; the last rate that passed, and each rate's share within the SLOs."""
    ladder, best, at_best = [], 0.0, None
    for i, rate in enumerate(rates):
        before = arm.metrics()
        records = asyncio.run(arm.run(requests(trace, rate, n, seed=1000 + i), slo))
        after = arm.metrics()
        share = sum(meets(r, slo) for r in records) / len(records)
        errors = sum(1 for r in records if r.error)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        why = misses(records, slo)
        ladder.append({"rate": rate, "within_slo": share, "errors": errors, **why})
        print(f"  {arm.name:>14} {trace:>13} rate {rate:5.2f}/s: {share:5.0%} within SLOs, {errors} errors; "
              f"missed TTFT {why['missed_ttft']}, ITL {why['missed_itl']}; first gap p50 "
              f"{_ms(why['first_gap_p50'])}, later gaps p99 {_ms(why['later_gap_p99'])}")
        if share < 0.9:
            break
        best, at_best = rate, delta
    return {"goodput": best, "ladder": ladder, "metrics_at_goodput": at_best}


def misses(records: list, slo: SLOTargets) -> dict:
    """Which SLO the requests that missed broke (a request may break both), and the first inter-token gap apart
    from the later ones: on a split decode pod the first gap holds the blocks' pull and admission, while the rest
    are decode steps, so this says whether the split loses on the pull or on the decoding."""
    done = [r for r in records if r.ok]
    q = slo.itl.quantile * 100
    firsts = [r.itls[0] for r in done if r.itls]
    later = [g for r in done for g in r.itls[1:]]
    return {"missed_ttft": sum(1 for r in done if r.ttft > slo.ttft.threshold),
            "missed_itl": sum(1 for r in done if r.itls and float(np.percentile(r.itls, q)) > slo.itl.threshold),
            "first_gap_p50": float(np.median(firsts)) if firsts else None,
            "first_gap_max": max(firsts) if firsts else None,
            "later_gap_p99": float(np.percentile(later, 99)) if later else None}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def phases(delta: dict | None) -> dict:
    """The split's TTFT by phase at its goodput rate (mean seconds) and the transfer's share of the prefill."""
    if not delta:
        return {}
    out = {}
    for phase in ("queue", "remote_prefill", "transfer", "first_decode"):
        n = delta.get(f"{TTFT_PHASE}_count|{phase}", 0.0)
        out[phase] = delta.get(f"{TTFT_PHASE}_sum|{phase}", 0.0) / n if n else None
    if out.get("transfer") and out.get("remote_prefill"):
        out["transfer_share_of_prefill"] = out["transfer"] / (out["transfer"] + out["remote_prefill"])
    out["transfers_ok"] = delta.get(f"{KV_TRANSFERS}|ok", 0.0)
    out["fallbacks"] = sum(v for k, v in delta.items() if k.startswith(KV_FALLBACKS + "|"))
    return out


def sim_options(cost: transfer.TransferCost) -> dict:
    """COMMON's engine limits in the simulator: 16 sequences, 2048 tokens, a 0.6 GiB pool in blocks of 16."""
    return {"max_num_seqs": 16, "max_model_len": 2048, "num_blocks": int(0.6 * 2**30 // (16 * cost.bytes_per_token))}


def arm_name(kind: str, knob: float, first_token: str = "early") -> str:
    """colocated-<chunk>, split-<threshold> (--first-token early) or split-<threshold>-with-kv: measured and predicted
    arms share their names, so each prediction finds its measurement."""
    return f"{kind}-{'inf' if knob == math.inf else knob}" + ("" if first_token == "early" else f"-{first_token}")


def predict_rung(kind: str, knob: float, specs: list[RequestSpec], slo: SLOTargets, cost, pull,
                 first_token: str = "early") -> dict:
    """One rate of one arm in the simulator, set up as Arm sets up the engines, with the same miss breakdown the
    measured rungs record (`misses`: the simulator's records have the client's shape)."""
    opts, extra = sim_options(pull), {}
    if kind == "colocated":
        records = colocated(cost, specs, Knobs(knob + 16, knob), engines=2, **opts)
    else:
        fleet = SplitFleet(cost, specs, decode_knobs=Knobs(80, 64), prefill_knobs=Knobs(1040, 1024), threshold=knob,
                           transfer=pull, first_token=first_token, sim_options=opts)
        records = fleet.run()
        pulls = [s for d in fleet.decodes for _, s in d.transfers]
        extra = {"routed": dict(fleet.routed), "fallbacks": dict(fleet.fallbacks),
                 "mean_pull_s": float(np.mean(pulls)) if pulls else None}
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return {"within_slo": sum(meets(r, slo) for r in records) / len(records), **misses(records, slo),
            "mean_ttft": float(np.mean(ttfts)) if ttfts else None, **extra}


def predict(trace: str, n: int, slo: SLOTargets, cost, pull, arms: list[tuple[str, float, str]]) -> dict:
    """Every arm's whole ladder in the simulator (the bench's own requests, rate by rate), its goodput read as the
    bench reads it (up the ladder until a rate fails), the best of each kind and the best split of each
    --first-token."""
    rows = {}
    for kind, knob, first in arms:
        ladder = [{"rate": rate, **predict_rung(kind, knob, requests(trace, rate, n, seed=1000 + i), slo, cost, pull,
                                                first)} for i, rate in enumerate(RATES[trace])]
        best = 0.0
        for rung in ladder:
            if rung["within_slo"] < 0.9:
                break
            best = rung["rate"]
        rows[arm_name(kind, knob, first)] = {"kind": kind, "knob": "inf" if knob == math.inf else knob,
                                             "first_token": first, "goodput": best, "ladder": ladder}

    def best(kind: str, first: str | None = None) -> str:  # the first of the best, in the order arms were given
        names = [n for n, r in rows.items() if r["kind"] == kind and first in (None, r["first_token"])]
        return max(names, key=lambda n: rows[n]["goodput"])

    col, split = best("colocated"), best("split")
    col_goodput = rows[col]["goodput"]
    return {"arms": rows, "best_colocated": col, "best_split": split,
            "split_vs_best_colocated": rows[split]["goodput"] / col_goodput if col_goodput else None,
            "best_split_by_first_token": {f: best("split", f) for f in FIRST_TOKEN_MODES}}


def prediction_arms(trace: str) -> list[tuple[str, float, str]]:
    """What predict runs: every chunk colocated, every threshold split with each --first-token."""
    return ([("colocated", c, "early") for c in sorted(set(CHUNKS) | set(PREDICT_CHUNKS))]
            + [("split", t, f) for t in sorted(set(THRESHOLDS[trace]) | set(PREDICT_THRESHOLDS))
               for f in FIRST_TOKEN_MODES])


def show_prediction(trace: str, predicted: dict, measured: dict | None) -> None:
    """Each predicted arm's ladder, the measured one's beside it where the arm was run."""
    for name, arm in predicted["arms"].items():
        got = (measured or {}).get(name)
        line = ", ".join(f"{r['rate']:g}/s {r['within_slo']:4.0%}" for r in arm["ladder"])
        last = arm["ladder"][-1]
        print(f"  predicted {name:>17} {trace:>13}: goodput {arm['goodput']:g}/s ({line}); last rate: missed TTFT "
              f"{last['missed_ttft']}, ITL {last['missed_itl']}; first gap p50 {_ms(last['first_gap_p50'])}, later "
              f"gaps p99 {_ms(last['later_gap_p99'])}")
        if got is not None:
            print(f"   measured {name:>17} {trace:>13}: goodput {got['goodput']:g}/s ("
                  + ", ".join(f"{r['rate']:g}/s {r['within_slo']:4.0%}" for r in got["ladder"]) + ")")
    by_first = ", ".join(f"{f} {n} ({predicted['arms'][n]['goodput']:g}/s)"
                         for f, n in predicted["best_split_by_first_token"].items())
    print(f"  predicted best: {predicted['best_colocated']} and {predicted['best_split']}, split/colocated "
          + (f"{predicted['split_vs_best_colocated']:.2f}x" if predicted["split_vs_best_colocated"] is not None
             else "n/a (colocated meets the SLOs at no rate)") + f"; best split by --first-token: {by_first}")


def predicted_cost(ttft_1024: float, itl_alone: float, pull_overhead: float = 0.0):
    """The simulator's costs for this run: the shipped step cost rescaled to the lone engine's figures, the
    transfer's from the committed bench/kv_transfer.py result (one core per pod: the pull's CPU time is the
    step loop's), plus `pull_overhead` seconds a pull (a what-if: what the transfer bench does not time)."""
    pull = transfer.default()
    if pull_overhead:
        pull = dataclasses.replace(pull, overhead_s=pull.overhead_s + pull_overhead,
                                   note=f"{pull.note}; what-if: +{pull_overhead:g} s a pull")
    return rescaled(costmodel.default(), ttft_1024, itl_alone), pull


def predict_only(args) -> None:
    measured = json.loads(Path(args.measured).read_text())
    c = measured["conditions"]
    slo = SLOTargets.p99(ttft=c["slo_ttft"], itl=c["slo_itl"])
    cost, pull = predicted_cost(c["ttft_1024"], c["itl_alone"], args.pull_overhead)
    print(f"the measured run's lone-request figures ({c['time']}, {c['commit']}): TTFT {c['ttft_1024']:.2f} s, "
          f"{c['itl_alone'] * 1000:.0f} ms per token; its SLOs: TTFT {slo.ttft.threshold:.1f} s, "
          f"ITL {slo.itl.threshold * 1000:.0f} ms\nstep cost: {cost.note}\ntransfer: {pull.note}")
    result: dict = {"conditions": conditions(requests_per_rate=args.requests, measured_run=c["time"],
                                             measured_commit=c["commit"], ttft_1024=c["ttft_1024"],
                                             itl_alone=c["itl_alone"], slo_ttft=slo.ttft.threshold,
                                             slo_itl=slo.itl.threshold, step_cost=cost.note, transfer=pull.note,
                                             pull_overhead=args.pull_overhead),
                    "traces": {}}
    for trace in args.traces.split(","):
        predicted = predict(trace, args.requests, slo, cost, pull, prediction_arms(trace))
        got = measured["traces"].get(trace, {}).get("arms")
        show_prediction(trace, predicted, got)
        result["traces"][trace] = {"predicted": predicted,
                                   "measured": {name: {"goodput": a["goodput"], "ladder": a["ladder"]}
                                                for name, a in (got or {}).items()}}
    save(args.out, result)


def calibrate(model: str, logs: Path) -> tuple[float, float]:
    """A lone 1024-token prompt's TTFT and a lone decode's median inter-token gap, on one engine on one core."""
    arm = Arm(model, logs, "calibrate", "colocated", 256)
    try:
        rng = np.random.default_rng(0)
        spec = RequestSpec("calibrate", [int(x) for x in rng.integers(100, VOCAB, 1024)], 32, 0.0, 1024)
        rec = asyncio.run(arm.run([spec], SLOTargets()))[0]
        return rec.ttft, float(np.median(rec.itls))
    finally:
        arm.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12, help="requests per rate")
    ap.add_argument("--ttft-x", type=float, default=5.0, help="TTFT SLO = this x a lone 1024-token prompt's TTFT")
    ap.add_argument("--itl-x", type=float, default=2.0, help="ITL SLO = this x a lone decode's inter-token gap")
    ap.add_argument("--traces", default="prefill_heavy,chat")
    ap.add_argument("--predict-only", action="store_true", help="run the simulator only (seconds), no engine")
    ap.add_argument("--measured", default=str(RESULTS / "disaggregation.json"),
                    help="--predict-only: the measured run whose lone-request figures and SLOs to use")
    ap.add_argument("--pull-overhead", type=float, default=0.0,
                    help="--predict-only: seconds added to every pull (a what-if for costs the transfer bench "
                         "does not time: HTTP round trips, first contact)")
    ap.add_argument("--rates", default="", help="the ladder (requests/s, comma-separated) in place of the trace's "
                                                "own: a finer one, or one that starts lower where no colocated arm "
                                                "holds the first rung")
    ap.add_argument("--arms", default="", help="only these arms (names as in the output, comma-separated), e.g. "
                                               "the best of each kind again on a finer ladder")
    ap.add_argument("--out", default=None, help="the result's name (default: disaggregation, or "
                                                "disaggregation_predicted with --predict-only)")
    args = ap.parse_args()
    if args.predict_only:
        args.out = args.out or "disaggregation_predicted"
        return predict_only(args)
    only = set(filter(None, args.arms.split(",")))
    model = model_dir()
    logs = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    ttft_1024, itl_alone = calibrate(model, logs)
    slo = SLOTargets.p99(ttft=args.ttft_x * ttft_1024, itl=args.itl_x * itl_alone)
    print(f"a lone 1024-token prompt: TTFT {ttft_1024:.2f} s; a lone decode: {itl_alone * 1000:.0f} ms per token; "
          f"SLOs: TTFT {slo.ttft.threshold:.1f} s, ITL {slo.itl.threshold * 1000:.0f} ms (each request's p99)")
    result: dict = {"conditions": conditions(requests_per_rate=args.requests, ttft_1024=ttft_1024,
                                             itl_alone=itl_alone, slo_ttft=slo.ttft.threshold,
                                             slo_itl=slo.itl.threshold, logs=str(logs)), "traces": {}}
    cost, pull = predicted_cost(ttft_1024, itl_alone)
    result["conditions"].update(step_cost=cost.note, transfer=pull.note)
    for trace in args.traces.split(","):
        rows = {}
        arms = [("colocated", c, "early") for c in CHUNKS] + [("split", t, f) for t in THRESHOLDS[trace]
                                                               for f in FIRST_TOKEN_MODES]
        arms = [a for a in arms if not only or arm_name(*a) in only]
        ladder = [float(r) for r in args.rates.split(",")] if args.rates else list(RATES[trace])
        if {kind for kind, _, _ in arms} != {"colocated", "split"}:  # before any engine starts
            raise SystemExit(f"--arms must name at least one colocated and one split arm of {trace}: "
                             f"{', '.join(arm_name(*a) for a in arms) or 'none'} chosen")
        for kind, knob, first in arms:
            name = arm_name(kind, knob, first)
            arm = Arm(model, logs, name, kind, knob, first)
            try:
                rows[name] = {"kind": kind, "knob": knob, "first_token": first,
                              **goodput(arm, trace, ladder, args.requests, slo)}
            finally:
                arm.stop()
        best_col = max((r for r in rows.values() if r["kind"] == "colocated"), key=lambda r: r["goodput"])
        best_split = max((r for r in rows.values() if r["kind"] == "split"), key=lambda r: r["goodput"])
        ratio = best_split["goodput"] / best_col["goodput"] if best_col["goodput"] else None
        # auto falls back to colocated where the split does not pay: what it reaches is the better of the two, as
        # chosen in hindsight here (the tuner choosing online is not built yet: docs/disaggregation.md)
        auto = max(best_split["goodput"], best_col["goodput"])
        result["traces"][trace] = {
            "arms": rows, "best_colocated": f"colocated-{best_col['knob']}",
            "best_split": next(n for n, r in rows.items() if r is best_split),
            "split_vs_best_colocated": ratio,
            "auto_in_hindsight_vs_best_colocated": auto / best_col["goodput"] if best_col["goodput"] else None,
            "split_ttft_phases": phases(best_split["metrics_at_goodput"])}
        # the simulator's prediction of every arm, beside what was measured
        result["traces"][trace]["predicted"] = predicted = predict(trace, args.requests, slo, cost, pull,
                                                                   prediction_arms(trace))
        show_prediction(trace, predicted, rows)
        print(f"{trace}: best colocated {best_col['goodput']}/s (chunk {best_col['knob']}), best split "
              f"{best_split['goodput']}/s (threshold {best_split['knob']}): "
              + (f"{ratio:.2f}x" if ratio is not None else "colocated met the SLOs at no rate"))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(result["traces"]), figsize=(5 * len(result["traces"]), 3.5), squeeze=False)
    for ax, (trace, t) in zip(axes[0], result["traces"].items()):
        names = list(t["arms"])
        ax.bar(names, [t["arms"][n]["goodput"] for n in names],
               color=["tab:blue" if t["arms"][n]["kind"] == "colocated" else "tab:orange" for n in names])
        ax.set_title(f"{trace}: goodput (req/s, >= 90 % within SLOs)")
        ax.tick_params(axis="x", rotation=30)
    save(args.out or "disaggregation", result, fig)


if __name__ == "__main__":
    main()
