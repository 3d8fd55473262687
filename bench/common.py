"""Shared bits of the benchmarks: the model, the conditions every result records, JSON + PNG output."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def model_dir() -> str:
    from chunkpilot.engine.model_fetch import fetch

    return str(fetch("smollm2"))


def conditions(**extra) -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"time": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "gpu": gpu, **extra}


def save(name: str, result: dict, fig=None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    if fig is not None:
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / name}.json" + (" and .png" if fig is not None else ""))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
