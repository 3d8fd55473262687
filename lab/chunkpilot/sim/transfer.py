"""What moving a prompt's KV blocks to a decode engine costs the simulator: a fixed overhead plus, per MiB moved, the
NIXL read and the per-block checksums, both on the decode side (kv_transfer/decode_side.py), and how much of that
time the decode engine's steps lose to it.

The parameters come from bench/kv_transfer.py's JSON (`from_bench`): bytes per token from its rows, and a line
(intercept, seconds per MiB) fitted to its read times and to its checksum times. `default()` is that fit on the
committed results for SmolLM2 on this project's CPU (transfer_smollm2_cpu.json, written by `python -m
chunkpilot.sim.transfer bench/results/kv_transfer.json`)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MIB = 2**20


@dataclass(frozen=True)
class TransferCost:
    overhead_s: float  # per transfer, whatever its size: the fitted intercepts of the read and the checksums
    read_s_per_mib: float  # the NIXL read into this engine's pool
    checksum_s_per_mib: float  # the checksum of every block read (kv_blocks.block_checksums)
    bytes_per_token: float  # one token's K and V over every layer, in the pool's dtype
    # The pull runs on a thread beside the step loop (decode_side.RemotePrefill._pool), so it blocks no step; but on
    # a pod with no core to spare its CPU time comes out of the steps that run meanwhile. The share of the pull's
    # seconds the next step loses: 1 where the pod has one core (the bench's pods are pinned to one), 0 where the
    # thread has a core of its own.
    step_loop_share: float = 1.0
    note: str = ""  # where the figures were measured

    def __post_init__(self) -> None:
        for name in ("overhead_s", "read_s_per_mib", "checksum_s_per_mib", "bytes_per_token"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"transfer cost {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.step_loop_share <= 1.0:
            raise ValueError(f"step_loop_share must be in [0, 1], got {self.step_loop_share}")

    def seconds(self, tokens: int, block_size: int = 16) -> float:
        """One transfer of `tokens` prompt tokens: whole blocks move, so the last one counts in full."""
        if tokens <= 0:
            return 0.0
        mib = math.ceil(tokens / block_size) * block_size * self.bytes_per_token / MIB
        return self.overhead_s + mib * (self.read_s_per_mib + self.checksum_s_per_mib)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> TransferCost:
        return cls(**json.loads(Path(path).read_text()))


def _line(mib: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) by least squares, neither negative (a negative overhead would make small transfers free
    or worse): with a negative intercept the line goes through the origin instead."""
    if len(mib) == 1:
        return 0.0, float(seconds[0] / mib[0])
    slope, intercept = np.polyfit(mib, seconds, 1)
    if intercept < 0:
        return 0.0, float(np.dot(mib, seconds) / np.dot(mib, mib))
    return float(intercept), float(max(0.0, slope))


def from_bench(result: dict, *, step_loop_share: float = 1.0) -> TransferCost:
    """The cost from bench/kv_transfer.py's JSON (its `rows`: tokens, bytes, nixl_s, checksum_s per prompt size).
    Raises ValueError when there is nothing to fit."""
    rows = [r for r in result.get("rows", []) if r.get("tokens", 0) > 0 and r.get("bytes", 0) > 0]
    if not rows:
        raise ValueError("the kv_transfer result has no rows with tokens and bytes to fit")
    mib = np.array([r["bytes"] / MIB for r in rows], dtype=float)
    read0, read = _line(mib, np.array([r["nixl_s"] for r in rows], dtype=float))
    crc0, crc = _line(mib, np.array([r["checksum_s"] for r in rows], dtype=float))
    cond = result.get("conditions", {})
    note = (f"bench/kv_transfer.py, {cond.get('device', '?')} {cond.get('dtype', '?')}, {cond.get('cpus', '?')} CPUs, "
            f"{cond.get('time', '?')} (commit {cond.get('commit', '?')}): {len(rows)} sizes, "
            f"{min(r['tokens'] for r in rows)}-{max(r['tokens'] for r in rows)} tokens")
    return TransferCost(overhead_s=read0 + crc0, read_s_per_mib=read, checksum_s_per_mib=crc,
                        bytes_per_token=float(np.median([r["bytes"] / r["tokens"] for r in rows])),
                        step_loop_share=step_loop_share, note=note)


DEFAULT_PATH = Path(__file__).with_name("transfer_smollm2_cpu.json")


def default() -> TransferCost:
    """SmolLM2-135M, float32, NIXL between two processes on the 2-core CPU this project is developed on."""
    return TransferCost.load(DEFAULT_PATH)


if __name__ == "__main__":  # refit the default from a bench result: python -m chunkpilot.sim.transfer RESULT.json
    print(from_bench(json.loads(Path(sys.argv[1]).read_text())).save(DEFAULT_PATH))
