"""The step-time model the tuner learns from the engines while they serve: step seconds as a non-negative linear
function of the step's cost features (chunkpilot.contract.step_cost), fitted by least squares from the sums of
products the engines export, over one Prometheus window and all pods at once.

The fit is *identified*, not just solved: each coefficient comes with its standard error (the least-squares
covariance, σ²·(XᵀX)⁻¹ on the features the fit kept, from the moments alone), each prediction with an interval,
and `identification` says which terms the data pins down, which it bounds to negligible, and which it leaves
open. A window whose steps all look alike (one knob setting, one batch size) cannot tell a per-step cost from a
per-token or per-sequence one; the covariance says so instead of the point estimate hiding it.

Pure functions: term sums in, a model (or None when the window holds too few distinct steps) out."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from chunkpilot.contract.step_cost import FEATURES, features_of, kv_kilotokens, moments_matrix, step_features

MIN_STEPS = 20  # fewer steps than this say nothing about six coefficients
Z95 = 1.96  # a two-sided 95 % normal interval, in standard errors
# A coefficient is identified when its 95 % interval lies within ±IDENTIFIED_WITHIN of its value ...
IDENTIFIED_WITHIN = 0.15
# ... or when even its interval's upper end adds at most this share to every step the decision is about: then
# its exact value cannot change a prediction that matters (a CPU's hinge terms, a KV term on short contexts).
NEGLIGIBLE_SHARE = 0.05
# Eigenvalues of the scaled normal matrix below this share of the largest are directions the steps never varied
# in: the features that load on them are not identified, whatever a pseudo-inverse would report.
COLLINEAR = 1e-10

# A step leans on a null direction v when |x·v| exceeds this share of Σ|xᵢvᵢ| (the rest is rounding).
NULL_TOLERANCE = 1e-4

IDENTIFIED, NEGLIGIBLE, UNIDENTIFIED = "identified", "negligible", "unidentified"


@dataclass(frozen=True)
class Term:
    """One coefficient and what the data says of it."""

    coefficient: float  # seconds per unit of the feature
    low: float  # its 95 % interval (low >= 0: costs are not negative)
    high: float  # math.inf when no step varied this feature independently of the others
    status: str  # IDENTIFIED, NEGLIGIBLE or UNIDENTIFIED

    @property
    def relative_half_width(self) -> float:
        return (self.high - self.low) / 2 / self.coefficient if self.coefficient > 0 else math.inf


@dataclass(frozen=True)
class StepModel:
    coefficients: dict[str, float]  # seconds per unit of each feature
    steps: float  # steps the fit saw
    rms_error: float  # root-mean-square residual of the fit, seconds per step
    mean_seconds: float  # mean measured step time, for scale
    # The coefficients' covariance over FEATURES (row-major); None for a cost given by hand, which is exact.
    covariance: tuple[tuple[float, ...], ...] | None = None
    # Directions in feature space the steps never varied in (X·v = 0: e.g. overhead against decodes when every
    # step decoded 16 sequences; a feature no step used). A step with a component along one is unidentified; one
    # without (16 decodes again) is predicted as well as the data allows, however collinear its features.
    null_directions: tuple[tuple[float, ...], ...] = ()

    def step_seconds(self, features: tuple[float, ...]) -> float:
        return float(sum(self.coefficients[f] * x for f, x in zip(FEATURES, features)))

    def predict(self, chunks) -> float:
        """Seconds of a step that computes these chunks: (start, tokens, is_decode) each."""
        return self.step_seconds(step_features(chunks))

    @property
    def relative_error(self) -> float:
        return self.rms_error / self.mean_seconds if self.mean_seconds > 0 else float("inf")

    def standard_error(self, feature: str) -> float:
        unit = tuple(1.0 if f == feature else 0.0 for f in FEATURES)
        return self.step_standard_error(unit)

    def step_standard_error(self, features: tuple[float, ...]) -> float:
        """Standard error of the predicted (mean) seconds of a step with these features: sqrt(xᵀ C x), infinite
        when the step leans on a direction the data never varied in. Features the step does not use (x = 0) add
        nothing, however unknown their coefficient."""
        if self.covariance is None:
            return 0.0
        for v in self.null_directions:
            along = sum(x * c for x, c in zip(features, v))
            scale = sum(abs(x * c) for x, c in zip(features, v))
            if scale > 0 and abs(along) > NULL_TOLERANCE * scale:
                return math.inf
        used = [(i, x) for i, x in enumerate(features) if x]
        var = sum(xi * self.covariance[i][j] * xj for i, xi in used for j, xj in used)
        return math.sqrt(max(0.0, var))

    def step_interval(self, features: tuple[float, ...], z: float = Z95) -> tuple[float, float]:
        mean, se = self.step_seconds(features), self.step_standard_error(features)
        return max(0.0, mean - z * se), mean + z * se

    def upper(self, z: float = Z95) -> UpperBound:
        """The model that predicts every step at its interval's upper end: what the safe set and the sizing judge
        (an unidentified term can only make a step dearer than the point estimate says, never cheaper)."""
        return UpperBound(self, z)

    def interval(self, feature: str, z: float = Z95) -> tuple[float, float]:
        c, se = self.coefficients[feature], self.standard_error(feature)
        return max(0.0, c - z * se), c + z * se

    def identification(self, reference: list[tuple[float, ...]] | None = None, z: float = Z95) -> dict[str, Term]:
        """Each term's coefficient, interval and status. `reference`: the feature vectors of the steps a decision
        is about (reference_steps by default); a term is negligible when its upper end adds at most
        NEGLIGIBLE_SHARE to each of them."""
        reference = reference_steps() if reference is None else reference
        out = {}
        for i, f in enumerate(FEATURES):
            c = self.coefficients[f]
            lo, hi = self.interval(f, z)
            if c > 0 and (hi - lo) / 2 <= IDENTIFIED_WITHIN * c:
                status = IDENTIFIED
            elif all(x[i] == 0 or (math.isfinite(hi) and hi * x[i] <= NEGLIGIBLE_SHARE * max(
                    self.step_seconds(x), 1e-9)) for x in reference):
                status = NEGLIGIBLE
            else:
                status = UNIDENTIFIED
            out[f] = Term(c, lo, hi, status)
        return out

    def unidentified(self, reference: list[tuple[float, ...]] | None = None) -> list[str]:
        return [f for f, t in self.identification(reference).items() if t.status == UNIDENTIFIED]

    def with_coefficients(self, **values: float) -> StepModel:
        """The same fit with some coefficients replaced (and their uncertainty kept): a what-if at an interval's
        end."""
        return replace(self, coefficients={**self.coefficients, **values})


@dataclass(frozen=True)
class UpperBound:
    """A StepModel's predictions at the upper end of their intervals (the predictor needs only step_seconds)."""

    model: StepModel
    z: float = Z95

    def step_seconds(self, features: tuple[float, ...]) -> float:
        return self.model.step_seconds(features) + self.z * self.model.step_standard_error(features)

    def predict(self, chunks) -> float:
        return self.step_seconds(step_features(chunks))


def reference_steps(max_tokens: int = 2048, decodes: int = 16, context: float = 512.0) -> list[tuple[float, ...]]:
    """The steps a knob decision is about when nothing narrower is known: decode-only steps of 1 and `decodes`
    sequences, and steps with those decodes plus one prompt chunk of 32 tokens, doubling, up to a step of `max_tokens`
    in all."""
    out = [features_of(0, d, d * kv_kilotokens(context, 1)) for d in (1, decodes)]
    n = 32
    while n <= max_tokens:
        share = min(n, max_tokens - decodes)  # a step never carries more than the budget
        out.append(features_of(share, decodes, decodes * kv_kilotokens(context, 1) + kv_kilotokens(0, share)))
        n *= 2
    return out


def _covariance(xtx: np.ndarray, active: list[int], sigma2: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """σ²·(XᵀX)⁺ over the active features, and the directions (over all features) the steps did not vary in: on
    those the pseudo-inverse reports a variance of 0, certain exactly where nothing is known, so predictions that
    lean on them are refused by StepModel.step_standard_error instead."""
    n = xtx.shape[0]
    cov = np.zeros((n, n))
    if not active:
        return cov, []
    sub = xtx[np.ix_(active, active)]
    scale = np.sqrt(np.diag(sub))
    corr = sub / np.outer(scale, scale)  # unit diagonal: eigenvalues compare directions, not units
    vals, vecs = np.linalg.eigh(corr)
    keep = vals > COLLINEAR * vals.max()
    inv = (vecs[:, keep] / vals[keep]) @ vecs[:, keep].T
    cov[np.ix_(active, active)] = sigma2 * inv / np.outer(scale, scale)
    null = []
    for k in np.flatnonzero(~keep):
        v = np.zeros(n)
        v[active] = vecs[:, k] / scale  # X·D⁻¹u = 0 in the scaled coordinates is X·v = 0 in the features' own
        null.append(v / np.abs(v).max())
    return cov, null


def fit_moments(terms: dict[str, float]) -> StepModel | None:
    """Non-negative least squares on the normal equations: solve, drop the most negative coefficient's feature,
    solve again, until none is negative (a negative cost would predict faster steps for more work). Features no step
    exercised (an all-zero column, e.g. no step over 2048 tokens) stay at 0 with an unbounded interval; a feature
    the constraint dropped keeps the standard error of the unconstrained fit (its interval is [0, z·se])."""
    full = moments_matrix(terms)
    n = len(FEATURES)
    xtx, xty, yy = full[:n, :n], full[:n, n], full[n, n]
    steps = xtx[0, 0]
    if steps < MIN_STEPS:
        return None
    exercised = [i for i in range(n) if xtx[i, i] > 0]
    active = list(exercised)
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

    def rss(c: np.ndarray) -> float:  # yᵀy − 2cᵀXᵀy + cᵀXᵀXc, from the moments alone
        return max(0.0, float(yy - 2 * c @ xty + c @ xtx @ c))

    residual = rss(coef)
    cov, null = _covariance(xtx, active, residual / max(1.0, steps - len(active)))
    dropped = [i for i in exercised if i not in active]
    if dropped:
        unconstrained = np.zeros(n)
        unconstrained[exercised] = np.linalg.lstsq(xtx[np.ix_(exercised, exercised)], xty[exercised], rcond=None)[0]
        wide, wide_null = _covariance(xtx, exercised, rss(unconstrained) / max(1.0, steps - len(exercised)))
        for i in dropped:
            cov[i, i] = wide[i, i]
        null += [v for v in wide_null if any(v[i] for i in dropped)]
    for i in range(n):
        if i not in exercised:  # no step used it: any step that does leans on the unknown
            null.append(np.eye(n)[i])
    return StepModel(coefficients=dict(zip(FEATURES, map(float, coef))), steps=float(steps),
                     rms_error=(residual / steps) ** 0.5, mean_seconds=float(xty[0] / steps),
                     covariance=tuple(tuple(map(float, row)) for row in cov),
                     null_directions=tuple(tuple(map(float, v)) for v in null))
