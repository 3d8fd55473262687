"""The demo, several times in a row with its defaults, as a result: each run's verdict (tuned against fixed
attainment and goodput), what its probe fitted (each coefficient with its interval), what its measured check saw,
the contention measured in the busy phase and the best fixed knobs in hindsight; then how far the probes' fits
agree (the spread of each coefficient over the runs, against their mean; the runs' own intervals and statuses are
in the JSON beside it).

    python bench/demo_runs.py [--runs 3] [--out-dir chunkpilot-demo-runs]   # runs `chunkpilot demo --no-live`
    python bench/demo_runs.py --busy 60 [--runs 3]   # a busy loop for 60 s from the first check's start
    python bench/demo_runs.py --collect DIR [DIR ...]                        # summarizes runs already made

Each run also records how its sizing went (checks needed, passed or stopped before the load) and how busy other
programs kept the host in the probe, each check and the load; a run the sizing stopped is a row of its own, not a
verdict. `--busy S` is issue 41's recipe: one `python -c 'while True: pass'` process for S seconds, started when
the demo prints that its first check starts.

Writes bench/results/demo_runs.json and demo_runs.png (attainment and goodput ratio per run); with --busy,
demo_runs_busy.json and .png."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import conditions, pyplot, save

COEFFICIENTS = ("overhead", "prefill_tokens", "decode_seqs", "kv_kilotokens", "tokens_over_512")


BUSY_LOOP = "import time; end = time.monotonic() + {s}\nwhile time.monotonic() < end: pass"


def sizing_of(doc: dict) -> dict:
    sizing = doc.get("sizing") or {}
    checks = sizing.get("checks") or []
    return {"passed": sizing.get("passed"), "checks_needed": len(checks), "seconds": sizing.get("seconds"),
            "busy": {"probe": sizing.get("probe_busy"), "checks": [c.get("busy") for c in checks],
                     "load": doc.get("run_busy")}}


def summarize(folder: Path) -> dict:
    doc = json.loads((folder / "demo.json").read_text())
    if doc.get("stopped"):  # the sizing stopped the demo before its load: no verdict, what it measured
        sizing = doc.get("sizing") or {}
        return {"folder": str(folder), "stopped": doc["stopped"], "checks": sizing.get("checks") or [],
                "config": {k: doc["config"][k] for k in ("rate", "itl_slo", "ttft_slo", "rag_scale", "output_scale")},
                "probe": {"rounds": sizing.get("rounds"), "coefficients": sizing.get("coefficients"),
                          "statuses": sizing.get("statuses")}, "sizing": sizing_of(doc)}
    s, sizing, h = doc["summary"], doc.get("sizing") or {}, doc.get("hindsight") or {}
    tuned, fixed = s["tuned"], s["fixed"]
    checks = sizing.get("checks") or []
    windows = [t for t in doc.get("trials", []) if t.get("kind") in ("complete", "cut", "thin")]
    over = sum(1 for t in windows if (t.get("itl") or 0) > doc["config"]["itl_slo"]
               or (t.get("ttft") or 0) > doc["config"]["ttft_slo"])
    return {"folder": str(folder), "attainment": {"tuned": tuned["attainment"], "fixed": fixed["attainment"]},
            "goodput": {"tuned": tuned["goodput"], "fixed": fixed["goodput"],
                        "ratio": tuned["goodput"] / fixed["goodput"] if fixed["goodput"] else None},
            "config": {k: doc["config"][k] for k in ("rate", "itl_slo", "ttft_slo", "rag_scale", "output_scale")},
            "probe": {"rounds": sizing.get("rounds"), "coefficients": sizing.get("coefficients"),
                      "intervals": sizing.get("intervals"), "statuses": sizing.get("statuses"),
                      "terms": sizing.get("terms")},
            "checks": checks, "busy_contention": doc.get("busy_contention"), "placement": doc.get("placement"),
            "tuner_windows": len(windows), "tuner_windows_over_slo": over,
            "hindsight": {k: h.get(k) for k in ("best", "attainment", "goodput")} if h else None,
            "shortfall": doc.get("shortfall"), "sizing": sizing_of(doc)}


def won(r: dict) -> bool:
    """Issue 41's verdict for a run that ran its load: >= 90 % tuned attainment and >= 1.25x goodput."""
    return r["attainment"]["tuned"] >= 0.9 and (r["goodput"]["ratio"] or 0) >= 1.25


def prediction(runs: list[dict]) -> dict:
    """Does the check predict the run? Passed checks followed by a winning run, failed ones by a losing run or a
    stop before the load (what the demo does now without --force)."""
    ran = [r for r in runs if not r.get("stopped")]
    passed = [r for r in ran if r["sizing"]["passed"]]
    failed = [r for r in runs if r.get("stopped") or not r["sizing"]["passed"]]
    return {"passed": len(passed), "passed_then_won": sum(won(r) for r in passed), "failed": len(failed),
            "failed_then_stopped": sum(1 for r in failed if r.get("stopped")),
            "failed_then_lost": sum(1 for r in failed if not r.get("stopped") and not won(r))}


def run_demo(folder: Path, busy: float) -> None:
    """`chunkpilot demo --no-live` into `folder`, its output echoed; with `busy`, a busy loop started for that many
    seconds when the first check starts. A demo the sizing stopped (exit 1 with a demo.json saying so) is a
    result; any other failure is not."""
    proc = subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", "demo", "--no-live", "--out", str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    loop = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        # the demo prints "sizing 1: ..." (never wrapped, at a line's start) just before its first check starts
        if busy and loop is None and line.startswith("sizing 1:"):
            loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=busy)])
            print(f"[demo_runs] a busy loop for {busy:g} s started (pid {loop.pid})", flush=True)
    rc = proc.wait()
    if loop is not None and loop.poll() is None:
        loop.kill()
        loop.wait()
    if rc != 0 and not (rc == 1 and json.loads((folder / "demo.json").read_text()).get("stopped")):
        raise SystemExit(f"the demo in {folder} failed (exit {rc})")


def agreement(runs: list[dict]) -> dict:
    """Per coefficient: the largest |value / mean - 1| over the runs' probe fits, with the statuses the runs gave
    it (a negligible or unidentified term's value is not a measurement to agree on)."""
    out = {}
    for f in COEFFICIENTS:
        values = [r["probe"]["coefficients"][f] for r in runs if r["probe"]["coefficients"]]
        mean = sum(values) / len(values) if values else 0.0
        out[f] = {"max_deviation": max(abs(v / mean - 1) for v in values) if values and mean > 0 else None,
                  "statuses": [(r["probe"].get("statuses") or {}).get(f) for r in runs]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=Path("chunkpilot-demo-runs"))
    ap.add_argument("--collect", type=Path, nargs="*", help="summarize these demo output folders instead")
    ap.add_argument("--busy", type=float, default=0.0,
                    help="seconds of a busy-loop process started when the first check starts (issue 41's recipe)")
    args = ap.parse_args()
    folders = args.collect
    if not folders:
        folders = []
        for i in range(1, args.runs + 1):
            folder = args.out_dir / (f"busy{i}" if args.busy else f"run{i}")
            run_demo(folder, args.busy)
            folders.append(folder)
    runs = [summarize(f) for f in folders]
    ran = [r for r in runs if not r.get("stopped")]
    spread = agreement(ran)
    for i, r in enumerate(runs, 1):
        c = r["probe"]["coefficients"] or {}
        if r.get("stopped"):
            print(f"run {i}: stopped before the load after {r['sizing']['checks_needed']} checks: "
                  f"{r['stopped'].splitlines()[0]}")
            continue
        print(f"run {i}: tuned {r['attainment']['tuned']:.0%} vs fixed {r['attainment']['fixed']:.0%}, goodput "
              f"{r['goodput']['ratio']:.2f}x; probe {r['probe']['rounds']} rounds, "
              f"{1e3 * c.get('prefill_tokens', 0):.2f} ms/token, {1e3 * c.get('overhead', 0):.0f} ms/step; "
              f"busy contention {r['busy_contention'] or 0:.2f}x; check {'passed' if r['sizing']['passed'] else 'NOT passed'}"
              f" after {r['sizing']['checks_needed']}")
    print("the check predicts the run: " + json.dumps(prediction(runs)))
    print("probe fits, largest deviation from the runs' mean: " + ", ".join(
        f"{k} {v['max_deviation']:.0%} ({'/'.join(s or '?' for s in v['statuses'])})" for k, v in spread.items()
        if v["max_deviation"] is not None))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(1, len(runs) + 1)
    att = [(r["attainment"]["tuned"], r["attainment"]["fixed"]) if not r.get("stopped") else (0, 0) for r in runs]
    ax.bar([x - 0.2 for x in xs], [a[0] for a in att], 0.4, label="tuned attainment")
    ax.bar([x + 0.2 for x in xs], [a[1] for a in att], 0.4, label="fixed attainment")
    ax.axhline(0.9, color="k", ls=":", lw=1)
    for x, r in zip(xs, runs):
        ax.annotate("stopped before the load" if r.get("stopped") else f"{r['goodput']['ratio']:.2f}x", (x, 1.01),
                    ha="center", fontsize=8)
    title = f"demo runs, a busy loop for {args.busy:g} s from the first check" if args.busy else "demo runs, defaults"
    ax.set(xticks=list(xs), xlabel="run", ylabel="SLO attainment", ylim=(0, 1.1), title=title)
    ax.legend(fontsize=8, loc="lower right")
    save("demo_runs_busy" if args.busy else "demo_runs",
         {"conditions": conditions(), "busy_loop_seconds": args.busy, "runs": runs, "probe_spread": spread,
          "prediction": prediction(runs)}, fig)


if __name__ == "__main__":
    main()
