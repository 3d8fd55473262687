"""Step time for the simulator: what a step of (start, tokens, is_decode) chunks costs.

* `CostModel`: a linear function of what the step computes, fitted on the real engine (CPU-shaped: every prompt
  token costs from the first). features: 1 (per-step overhead: Python, kernel launches), prefill tokens (weight
  matmuls), decode sequences (their matmul rows plus per-sequence bookkeeping), and KV tokens read (attention:
  every query reads the keys before it; chunkpilot.contract.step_cost owns that formula).
* `GpuShapedCost`: a roofline (GPU-shaped): a step costs about the same until its tokens turn it compute-bound,
  then grows linearly. Its knee lies between the step-time model's hinges on purpose: the tuner's model must fit a
  shape it was not written for."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from chunkpilot.contract import step_cost

FEATURES = ("overhead", "prefill_tokens", "decode_seqs", "kv_reads")


def step_features(chunks: list[tuple[int, int, bool]]) -> tuple[float, float, float, float]:
    """chunks: (start, num_tokens, is_decode) for every sequence in the step. The engine's features, with KV reads
    in tokens (the fitted JSON's unit) rather than thousands."""
    one, prefill, decodes, kv_kilo, *_ = step_cost.step_features(chunks)
    return (one, prefill, decodes, kv_kilo * 1000.0)


class StepCost(Protocol):
    def step_seconds(self, chunks: list[tuple[int, int, bool]]) -> float: ...


@dataclass(frozen=True)
class CostModel:
    overhead: float
    prefill_tokens: float
    decode_seqs: float
    kv_reads: float
    note: str = ""  # where and how it was fitted

    def step_time(self, features: tuple[float, float, float, float]) -> float:
        coef = (self.overhead, self.prefill_tokens, self.decode_seqs, self.kv_reads)
        return float(sum(c * f for c, f in zip(coef, features)))

    def step_seconds(self, chunks: list[tuple[int, int, bool]]) -> float:
        return self.step_time(step_features(chunks))

    def as_step_model(self):
        """The same cost in the engines' step-cost features (chunkpilot.contract.step_cost), for the predictor."""
        from chunkpilot.tuner.step_model import StepModel

        return StepModel(coefficients={"overhead": self.overhead, "prefill_tokens": self.prefill_tokens,
                                       "decode_seqs": self.decode_seqs, "kv_kilotokens": self.kv_reads * 1000,
                                       "tokens_over_512": 0.0, "tokens_over_2048": 0.0},
                         steps=float("inf"), rms_error=0.0, mean_seconds=self.overhead)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls(**json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class GpuShapedCost:
    """overhead + max(flat, tokens x per_token) + KV reads + decode bookkeeping: memory-bound (reading the weights
    once per step: `flat`) until a step's tokens make it compute-bound at flat / per_token tokens."""

    overhead: float
    flat: float
    per_token: float
    kv_reads: float = 0.0  # seconds per KV token read
    decode_seqs: float = 0.0
    note: str = ""

    @property
    def knee(self) -> float:
        return self.flat / self.per_token

    def step_seconds(self, chunks: list[tuple[int, int, bool]]) -> float:
        _, prefill, decodes, kv = step_features(chunks)
        return (self.overhead + max(self.flat, (prefill + decodes) * self.per_token) + kv * self.kv_reads
                + decodes * self.decode_seqs)


@dataclass(frozen=True)
class FittedCost:
    """The step-time model the tuner fitted from an engine's own steps (chunkpilot.tuner.step_model), as the
    simulator's cost: what-ifs on a run's own trace, e.g. the demo's best fixed knobs in hindsight."""

    model: object  # StepModel

    def step_seconds(self, chunks: list[tuple[int, int, bool]]) -> float:
        return max(1e-4, self.model.predict(chunks))


class Contended:
    """Another cost with contention noise: every step's time is multiplied by (1 + noise·U) / (1 + noise/2), U
    uniform in [0, 1] and drawn anew each step, as when other processes share the cores at random moments. The
    slowest step is 1 + noise times the fastest (noise 1: up to 2x), and the mean stays the cost's own, so that a
    scenario keeps its load and the grid its best knobs: what changes is that the step-time fit sees every step
    through that noise, and the tail latencies carry it. Seeded: runs repeat."""

    def __init__(self, cost: StepCost, noise: float, seed: int = 0) -> None:
        if noise < 0:
            raise ValueError(f"contention noise must be >= 0, got {noise}")
        self.cost, self.noise = cost, noise
        self._rng = np.random.default_rng(seed)

    @property
    def note(self) -> str:
        return (f"{getattr(self.cost, 'note', '')}; contention: each step's time x (1 + {self.noise:g}U) / "
                f"{1 + self.noise / 2:g}, U uniform in [0, 1] (the slowest {1 + self.noise:g}x the fastest, mean 1)")

    def step_seconds(self, chunks: list[tuple[int, int, bool]]) -> float:
        factor = (1.0 + self.noise * float(self._rng.random())) / (1.0 + self.noise / 2)
        return self.cost.step_seconds(chunks) * factor


def gpu_shaped() -> GpuShapedCost:
    """A GPU's shape at the CPU model's time scale, so the same workloads and SLOs make both knobs matter: a step
    costs 0.12 s up to a knee at 300 tokens (between the step-time model's hinges at 0 and 512), then 0.4 ms a
    token, about the CPU fit's slope. (An H200 is ~100x faster on an 8B model; the shape, not the scale, is what
    the tuner has to learn.)"""
    return GpuShapedCost(overhead=0.01, flat=0.12, per_token=0.0004, kv_reads=2e-7, decode_seqs=0.001,
                         note="GPU-shaped roofline: 0.13 s flat to a knee at 300 tokens, then 0.4 ms/token")


def fit(samples: list[tuple[tuple[float, float, float, float], float]], note: str = "") -> CostModel:
    """Least squares with non-negative coefficients (a negative cost would let the simulator go back in time):
    drop the most negative feature and refit until none is negative."""
    x = np.array([f for f, _ in samples], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = np.clip(coef, 0, None)
    return CostModel(*map(float, full), note=note)


def relative_error(model: CostModel, samples: list[tuple[tuple[float, float, float, float], float]]) -> float:
    """Median |predicted - measured| / measured over the samples."""
    errs = [abs(model.step_time(f) - t) / t for f, t in samples if t > 0]
    return float(np.median(errs)) if errs else float("nan")


DEFAULT_PATH = Path(__file__).with_name("cost_smollm2_cpu.json")


def default() -> CostModel:
    """SmolLM2-135M, float32, on the 2-core CPU machine this project is developed on (see fit.py to refit)."""
    return CostModel.load(DEFAULT_PATH)
