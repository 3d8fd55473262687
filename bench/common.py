"""Shared bits of the benchmarks: the model, the conditions every result records, JSON + PNG output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

# bench/gpu_check.sh points this at bench/results/gpu so a GPU run sits beside the CPU figures, not over them
RESULTS = Path(os.environ.get("CHUNKPILOT_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def model_dir() -> str:
    """$CHUNKPILOT_BENCH_MODEL (bench/make_model.py writes one on a GPU machine), else the bundled SmolLM2."""
    if os.environ.get("CHUNKPILOT_BENCH_MODEL"):
        return os.environ["CHUNKPILOT_BENCH_MODEL"]
    from chunkpilot.engine.model.model_fetch import fetch

    return str(fetch("smollm2"))


def kv_blocks(seqs: int, tokens: int, block_size: int = 16) -> int:
    """A KV pool just big enough for `seqs` sequences of `tokens`: with an explicit pool, two engines (or an
    engine and transformers) fit on one GPU side by side, where each would otherwise take most of the card."""
    return seqs * -(-tokens // block_size) + 8


def commit() -> str | None:
    """The checkout's commit, "+dirty" when tracked files differ from it (what the figures were measured on);
    None outside a git checkout (the GPU machine gets a copy of the working tree without .git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def conditions(**extra) -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"time": time.strftime("%Y-%m-%d %H:%M"), "commit": commit(), "machine": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(), "gpu": gpu,
            **extra}


def save(name: str, result: dict, fig=None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    if fig is not None and fig is not NO_PLOT:
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / name}.json" + (" and .png" if fig is not None and fig is not NO_PLOT else ""))


class _NoPlot:
    """Stands in for matplotlib where it is not installed (the GPU machine's python): every call is a no-op, so a
    benchmark still writes its JSON."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __iter__(self):
        return iter((self, self))


NO_PLOT = _NoPlot()


def pyplot():
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: JSON only, no PNG")
        return NO_PLOT
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
