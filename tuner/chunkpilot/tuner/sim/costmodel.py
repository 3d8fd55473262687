"""Step time as a linear function of what the step computes, fitted on the real engine.

features: 1 (per-step overhead: Python, kernel launches), prefill tokens (weight matmuls), decode sequences
(their matmul rows plus per-sequence bookkeeping), and KV tokens read (attention: every query reads the keys
before it, so a chunk of n tokens starting at position s reads n·s + n(n+1)/2 keys)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FEATURES = ("overhead", "prefill_tokens", "decode_seqs", "kv_reads")


def step_features(chunks: list[tuple[int, int, bool]]) -> tuple[float, float, float, float]:
    """chunks: (start, num_tokens, is_decode) for every sequence in the step."""
    prefill = sum(n for _, n, d in chunks if not d)
    decodes = sum(1 for _, _, d in chunks if d)
    kv = sum(n * s + n * (n + 1) / 2 for s, n, _ in chunks)
    return (1.0, float(prefill), float(decodes), float(kv))


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

    def as_step_model(self):
        """The same cost in the engines' step-cost features (chunkpilot.engine.step_cost), for the predictor."""
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
