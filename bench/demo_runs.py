"""The demo, several times in a row with its defaults, as a result: each run's verdict (tuned against fixed
attainment and goodput), what its probe fitted (each coefficient with its interval), what its measured check saw,
the contention measured in the busy phase and the best fixed knobs in hindsight; then how far the probes' fits
agree (the spread of each coefficient over the runs, against their mean; the runs' own intervals and statuses are
in the JSON beside it).

    python bench/demo_runs.py [--runs 3] [--out-dir chunkpilot-demo-runs]   # runs `chunkpilot demo --no-live`
    python bench/demo_runs.py --collect DIR [DIR ...]                        # summarizes runs already made

Writes bench/results/demo_runs.json and demo_runs.png (attainment and goodput ratio per run)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import conditions, pyplot, save

COEFFICIENTS = ("overhead", "prefill_tokens", "decode_seqs", "kv_kilotokens", "tokens_over_512")


def summarize(folder: Path) -> dict:
    doc = json.loads((folder / "demo.json").read_text())
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
            "shortfall": doc.get("shortfall")}


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
    args = ap.parse_args()
    folders = args.collect
    if not folders:
        folders = []
        for i in range(1, args.runs + 1):
            folder = args.out_dir / f"run{i}"
            subprocess.run([sys.executable, "-m", "chunkpilot.cli.main", "demo", "--no-live", "--out", str(folder)],
                           check=True)
            folders.append(folder)
    runs = [summarize(f) for f in folders]
    spread = agreement(runs)
    for i, r in enumerate(runs, 1):
        c = r["probe"]["coefficients"] or {}
        print(f"run {i}: tuned {r['attainment']['tuned']:.0%} vs fixed {r['attainment']['fixed']:.0%}, goodput "
              f"{r['goodput']['ratio']:.2f}x; probe {r['probe']['rounds']} rounds, "
              f"{1e3 * c.get('prefill_tokens', 0):.2f} ms/token, {1e3 * c.get('overhead', 0):.0f} ms/step; "
              f"busy contention {r['busy_contention'] or 0:.2f}x")
    print("probe fits, largest deviation from the runs' mean: " + ", ".join(
        f"{k} {v['max_deviation']:.0%} ({'/'.join(s or '?' for s in v['statuses'])})" for k, v in spread.items()
        if v["max_deviation"] is not None))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(1, len(runs) + 1)
    ax.bar([x - 0.2 for x in xs], [r["attainment"]["tuned"] for r in runs], 0.4, label="tuned attainment")
    ax.bar([x + 0.2 for x in xs], [r["attainment"]["fixed"] for r in runs], 0.4, label="fixed attainment")
    ax.axhline(0.9, color="k", ls=":", lw=1)
    for x, r in zip(xs, runs):
        ax.annotate(f"{r['goodput']['ratio']:.2f}x", (x, 1.01), ha="center", fontsize=8)
    ax.set(xticks=list(xs), xlabel="run", ylabel="SLO attainment", ylim=(0, 1.1), title="demo runs, defaults")
    ax.legend(fontsize=8, loc="lower right")
    save("demo_runs", {"conditions": conditions(), "runs": runs, "probe_spread": spread}, fig)


if __name__ == "__main__":
    main()
