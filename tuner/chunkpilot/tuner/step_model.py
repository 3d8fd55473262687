"""The step-time model the tuner learns from the engines while they serve: step seconds as a non-negative linear
function of the step's cost features (chunkpilot.engine.step_cost), fitted by least squares from the sums of
products the engines export, over one Prometheus window and all pods at once.

Pure functions: term sums in, a model (or None when the window holds too few distinct steps) out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunkpilot.engine.step_cost import FEATURES, moments_matrix, step_features

MIN_STEPS = 20  # fewer steps than this say nothing about six coefficients


@dataclass(frozen=True)
class StepModel:
    coefficients: dict[str, float]  # seconds per unit of each feature
    steps: float  # steps the fit saw
    rms_error: float  # root-mean-square residual of the fit, seconds per step
    mean_seconds: float  # mean measured step time, for scale

    def step_seconds(self, features: tuple[float, ...]) -> float:
        return float(sum(self.coefficients[f] * x for f, x in zip(FEATURES, features)))

    def predict(self, chunks) -> float:
        """Seconds of a step that computes these chunks: (start, tokens, is_decode) each."""
        return self.step_seconds(step_features(chunks))

    @property
    def relative_error(self) -> float:
        return self.rms_error / self.mean_seconds if self.mean_seconds > 0 else float("inf")


def fit_moments(terms: dict[str, float]) -> StepModel | None:
    """Non-negative least squares on the normal equations: solve, drop the most negative coefficient's feature,
    solve again, until none is negative (a negative cost would predict faster steps for more work). Features no step
    exercised (an all-zero column, e.g. no step over 2048 tokens) stay at 0."""
    full = moments_matrix(terms)
    n = len(FEATURES)
    xtx, xty, yy = full[:n, :n], full[:n, n], full[n, n]
    steps = xtx[0, 0]
    if steps < MIN_STEPS:
        return None
    active = [i for i in range(n) if xtx[i, i] > 0]
    coef = np.zeros(n)
    while active:
        sub = xtx[np.ix_(active, active)]
        # lstsq, not solve: collinear features (e.g. every step had the same decode count) are ill-posed, not errors
        solved, *_ = np.linalg.lstsq(sub, xty[active], rcond=None)
        if (solved >= 0).all():
            coef[:] = 0
            coef[active] = solved
            break
        active.pop(int(np.argmin(solved)))
    # residual sum of squares from the moments alone: yᵀy − 2cᵀXᵀy + cᵀXᵀXc
    rss = max(0.0, float(yy - 2 * coef @ xty + coef @ xtx @ coef))
    return StepModel(coefficients=dict(zip(FEATURES, map(float, coef))), steps=float(steps),
                     rms_error=(rss / steps) ** 0.5, mean_seconds=float(xty[0] / steps))
