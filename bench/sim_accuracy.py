"""How well the simulator predicts the real engine: the same request trace (arrival times, prompt and output
lengths) sent to a real `chunkpilot engine serve` by the load generator, and fed to the simulator with the
cost model fitted on this machine, at a small and a large token budget. Prints the relative error of the
p50/p90/p99 TTFT and inter-token latency, writes JSON + PNG.

    python bench/sim_accuracy.py [--seconds 90] [--rate 0.6] [--knobs 64:64,512:512]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from common import conditions, model_dir, pyplot, save

from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark
from chunkpilot.sim.costmodel import default
from chunkpilot.sim.experiment import Scenario
from chunkpilot.sim.simulator import Simulator
from chunkpilot.tuner.space import Knobs


def serve(model: str, knobs: Knobs, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", "engine", "serve", "--model", model,
                             "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "smollm2",
                             "--token-budget", str(knobs.token_budget), "--max-chunk", str(knobs.max_chunk),
                             "--max-num-seqs", "32", "--no-enable-prefix-caching", "--log-level", "warning"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(log.read_text()[-2000:])


def stats(records) -> dict:
    ttft = [r.ttft for r in records if r.ttft is not None]
    itl = [g for r in records for g in r.itls]
    return {f"{name}_p{p}": float(np.percentile(v, p)) for name, v in (("ttft", ttft), ("itl", itl)) if v
            for p in (50, 90, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--rate", type=float, default=0.6)
    ap.add_argument("--knobs", default="64:64,512:512")
    ap.add_argument("--port", type=int, default=18123)
    args = ap.parse_args()
    model = model_dir()
    trace = Scenario(rate=args.rate, seed=7).workload(args.seconds)
    results = {}
    for spec in args.knobs.split(","):
        b, c = map(int, spec.split(":"))
        knobs = Knobs(b, c)
        with tempfile.TemporaryDirectory() as tmp:
            proc = serve(model, knobs, args.port, Path(tmp) / "server.log")
            try:
                real = run_benchmark(BenchmarkConfig(base_url=f"http://127.0.0.1:{args.port}", model="smollm2",
                                                     requests=trace, progress=False)).records
            finally:
                proc.terminate()
                proc.wait(60)
        sim = Simulator(default(), trace, knobs, max_num_seqs=32).run()
        r, s = stats(real), stats(sim)
        err = {k: (s[k] - r[k]) / r[k] for k in r if k in s and r[k] > 0}
        results[f"{b}/{c}"] = {"real": r, "sim": s, "relative_error": err}
        print(f"budget {b}, max chunk {c}: " + ", ".join(f"{k} real {r[k]:.3f}s sim {s[k]:.3f}s ({err[k]:+.0%})"
                                                         for k in r if k in err))
    all_err = [abs(e) for v in results.values() for e in v["relative_error"].values()]
    print(f"median |error| over all percentiles: {np.median(all_err):.0%}, max {max(all_err):.0%}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    keys = list(next(iter(results.values()))["real"])
    x = np.arange(len(keys))
    for i, (name, v) in enumerate(results.items()):
        ax.bar(x + i * 0.4 - 0.2, [v["relative_error"].get(k, 0) * 100 for k in keys], 0.4, label=f"budget/chunk {name}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xticks=x, xticklabels=keys, ylabel="simulated vs real (%)", title="simulator error against the real engine")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    save("sim_accuracy", {"conditions": conditions(rate=args.rate, seconds=args.seconds, cost_model=default().note),
                          "results": results, "median_abs_error": float(np.median(all_err)),
                          "max_abs_error": float(max(all_err))}, fig)


if __name__ == "__main__":
    main()
