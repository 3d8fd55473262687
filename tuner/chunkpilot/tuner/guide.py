"""The model-guided tuner's judgement, as pure functions: which knobs the step-time model predicts keep the SLOs at
the measured load, which of them it predicts best, and how many replicas that load needs when none does.

* One number per candidate, its *pressure*: the largest of predicted ITL p99 and TTFT p99 over their SLO within
  the tuner's decision margin (measurement.LATENCY_MARGIN), and predicted prefill utilization over the headroom
  the tuner keeps (MAX_PREFILL_UTILIZATION). Pressure <= 1 is predicted safe; the predicted best is the safe
  candidate with the least pressure: the most headroom on the SLO that binds first. (In four of the simulator's
  scenarios, with the exact cost at the measured load, that pick measured >= 98 % of the grid-best goodput; the
  highest predicted goodput cannot rank them, because every safe candidate is predicted to serve everything.)
* Predictions are calibrated by what this epoch measured: each latency is scaled by the measured/predicted ratio
  that every window shares (the predictor's global bias) and by how the windows near the candidate deviate from it
  (a kernel over the knobs' log distance), each shrunk towards 1, so the predictor's systematic error is corrected
  everywhere and its local error where knobs were tried.
* The margin widens with the model's uncertainty. Every step is predicted at the upper end of its interval
  (StepModel.upper: a term the window does not identify makes a step dearer, never cheaper), and that prediction
  is inflated by 1 + u before it is judged, u from the step-time fit's residual (per step) and from the spread of
  that quantity's measured/predicted ratios (each its own: the TTFT estimate's larger error must not narrow what
  ITL allows).
* When the pick among the predicted-safe candidates turns on a term the window does not identify (the pick at
  the low end of its interval is not the pick at the high end), the next trial is the safe candidate whose steps
  that term weighs on most (`separating`): the measurement that narrows it, instead of a guess between them.
* Prefill capacity is calibrated the same way against the capacity the engines measured (Window.prefill_capacity).
* A measurement wins where it was taken at about this load: such knobs are safe or not by what was measured (the
  loop does that; `screen` judges only predictions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.contract.step_cost import FEATURES
from chunkpilot.tuner.measurement import LATENCY_MARGIN, MAX_PREFILL_UTILIZATION
from chunkpilot.tuner.predictor import Load, Prediction, full_step_features, predict
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.step_model import UNIDENTIFIED, StepModel

# Shrinkage of the calibration towards "the predictor is right": the weight of one pseudo-window at ratio 1.
PRIOR_WEIGHT = 1.0
# The spread assumed before anything was measured (log measured/predicted): the predictor's p99 ITL read
# 0.89-1.05x the simulator's where knobs matter (bench/predictor_vs_sim.py), so 0.15 as a one-sigma guess.
PRIOR_SPREAD = 0.15
# Octaves of (token budget, max chunk) over which one measurement informs its neighbours' calibration.
KERNEL_OCTAVES = 1.0
CLIP_RATIO = 2.0
CLIP = math.log(CLIP_RATIO)
# How much every window counts towards the spread of every candidate, next to its kernel weight.
EVERYWHERE_WEIGHT = 0.25
MAX_UNCERTAINTY = 1.0
REPLICAS_CAP = 64  # beyond this many pods the answer is "scale the model, not the replicas"
MIN_USEFUL_UTILIZATION = 0.2  # pods needed only if left this idle say a single request is too slow
# Predicted inter-token stalls within this share of the least count as the least stall, and the TTFT decides
# among them: same-chunk knobs with a larger budget stall decodes nearly alike and queue prompts far less. It must
# stay below the step-time difference of the next chunk size up (a quarter octave: 19 % more prompt tokens a step),
# or a larger chunk, which stalls every running stream longer, would count as "the least stall".
STALL_TOLERANCE = 0.10


@dataclass(frozen=True)
class Context:
    """What the guide knows about one window: the model fitted on it, the load per pod, and the pods measured."""

    model: StepModel
    load: Load
    pods: int = 1


@dataclass(frozen=True)
class Observation:
    """One measured window next to what was predicted for it at its own load (capacities: prompt tokens/s of the
    whole deployment while prefill is busy)."""

    knobs: Knobs
    predicted_itl: float | None
    measured_itl: float | None
    predicted_ttft: float | None
    measured_ttft: float | None
    predicted_capacity: float | None = None
    measured_capacity: float | None = None


@dataclass(frozen=True)
class Candidate:
    knobs: Knobs
    prediction: Prediction
    # calibrated predictions, each inflated by its own uncertainty: what is judged against the limits
    itl: float | None  # seconds (None: no ITL SLO)
    ttft: float | None
    utilization: float

    def _ratios(self, slo: SLOTargets) -> list[float]:
        """Each limit's share used, laid out like measurement.constraints: TTFT, ITL, (keeping up), headroom."""
        out = [v / (t.threshold * LATENCY_MARGIN) for t, v in ((slo.ttft, self.ttft), (slo.itl, self.itl))
               if t is not None]
        return [*out, self.utilization / MAX_PREFILL_UTILIZATION]

    def pressure_of(self, slo: SLOTargets) -> float:
        return max(self._ratios(slo))

    def constraints(self, slo: SLOTargets) -> list[float]:
        """Optuna's constraint vector of a predicted (not measured) trial (<= 0: satisfied)."""
        ratios = [r - 1.0 for r in self._ratios(slo)]
        return [*ratios[:-1], 0.0, ratios[-1]]


@dataclass(frozen=True)
class Judged:
    candidate: Candidate
    pressure: float  # <= 1: predicted safe

    @property
    def knobs(self) -> Knobs:
        return self.candidate.knobs

    @property
    def prediction(self) -> Prediction:
        return self.candidate.prediction

    @property
    def safe(self) -> bool:
        return self.pressure <= 1.0


def _distance(a: Knobs, b: Knobs) -> float:
    return math.hypot(math.log2(a.token_budget / b.token_budget), math.log2(a.max_chunk / b.max_chunk))


def _calibration(knobs: Knobs, pairs: list[tuple[Knobs, float]]) -> tuple[float, float]:
    """(factor, spread) for one latency at `knobs` from (knobs, log measured/predicted) pairs: a global bias (the
    predictor's error that every window shares: on the real CPU engine TTFT read 2-3x high everywhere), plus the
    deviation of the windows near `knobs` from it (a kernel over their log distance), each shrunk towards 0 by
    PRIOR_WEIGHT pseudo-windows. The spread is the residual of the windows around that, the near ones counting most,
    every one a little (each says how far the predictor can be trusted at all)."""
    if not pairs:
        return 1.0, PRIOR_SPREAD
    ratios = [r for _, r in pairs]
    bias = sum(ratios) / (len(ratios) + PRIOR_WEIGHT)
    weights = [math.exp(-0.5 * (_distance(knobs, k) / KERNEL_OCTAVES) ** 2) for k, _ in pairs]
    local = sum(w * (r - bias) for w, r in zip(weights, ratios)) / (sum(weights) + PRIOR_WEIGHT)
    mean = bias + local
    spread_weights = [w + EVERYWHERE_WEIGHT for w in weights]
    var = (PRIOR_WEIGHT * PRIOR_SPREAD ** 2 + sum(w * (r - mean) ** 2 for w, r in zip(spread_weights, ratios))) \
        / (sum(spread_weights) + PRIOR_WEIGHT)
    return math.exp(mean), math.sqrt(var)


def _pairs(observations: list[Observation], which: str) -> list[tuple[Knobs, float]]:
    """(knobs, log measured/predicted), clipped to +-log CLIP_RATIO: a window 20x below its prediction says the fit
    extrapolated badly there (the KV term of a fit on short steps, at 2048-token chunks), not that every prediction
    is 20x high; clipped, it still widens the spread."""
    out = []
    for o in observations:
        p, m = getattr(o, f"predicted_{which}"), getattr(o, f"measured_{which}")
        if p and m and p > 0 and m > 0 and math.isfinite(p) and math.isfinite(m):
            out.append((o.knobs, max(-CLIP, min(CLIP, math.log(m / p)))))
    return out


def judge(context: Context, knobs: Knobs, slo: SLOTargets, observations: list[Observation] = ()) -> Judged:
    """One candidate: predicted at the load, calibrated by the observations near it, each quantity inflated by
    1 + its uncertainty (the fit's residual and that quantity's calibration spread). A capacity too low inflates
    utilization, so capacity calibrates utilization inversely."""
    observations = list(observations)
    prediction = predict(context.model, knobs, context.load)
    bound = predict(context.model.upper(), knobs, context.load) if context.model.covariance else prediction
    fit = context.model.relative_error

    def calibrated(value: float, which: str, inverse: bool = False) -> float:
        factor, spread = _calibration(knobs, _pairs(observations, which))
        u = min(MAX_UNCERTAINTY, math.hypot(fit, spread))
        return value / factor * (1 + u) if inverse else value * factor * (1 + u)

    candidate = Candidate(
        knobs=knobs, prediction=prediction,
        itl=calibrated(bound.itl_p99, "itl") if slo.itl else None,
        ttft=calibrated(bound.ttft_p99, "ttft") if slo.ttft else None,
        utilization=calibrated(bound.utilization, "capacity", inverse=True))
    return Judged(candidate, candidate.pressure_of(slo))


def stressed(context: Context, stress: float) -> Context:
    """The context with `stress` more arrivals and decodes in flight: knobs must keep the SLOs through the load
    changes the tuner does not treat as drift (TunerSettings.drift_load_shift), or a quiet minute makes every
    budget look safe and the first busy one breaches."""
    return Context(context.model, context.load.scaled(1 + stress), context.pods)


def screen(context: Context, candidates: list[Knobs], slo: SLOTargets,
           observations: list[Observation] = (), stress: float = 0.0) -> list[Judged]:
    """Every candidate judged (at the load `stress` above the measured one), least pressure first (ties: the
    smaller budget, which costs decodes least)."""
    context = stressed(context, stress) if stress else context
    judged = [judge(context, k, slo, observations) for k in candidates]
    return sorted(judged, key=lambda c: (c.pressure, c.knobs.token_budget, c.knobs.max_chunk))


def decision_steps(context: Context, candidates: list[Knobs]) -> list[tuple[float, ...]]:
    """The feature vectors of the steps a choice among `candidates` is about: each one's decode-only step and its
    full step (the running decodes plus a full prompt share), at the load."""
    out = []
    for k in candidates:
        out.extend(full_step_features(k, context.load))
    return out


def separating(context: Context, safe: list[Judged], slo: SLOTargets, observations: list[Observation] = ()
               ) -> tuple[Knobs, list[str]] | None:
    """When the pick among the predicted-safe candidates (`safe`, least pressure first) depends on terms the
    window does not identify: the candidate whose measurement tells most about them, and those terms. The pick
    "depends" when judging with those coefficients at the low end of their intervals and at the high end picks
    different knobs. The most informative candidate is the one whose steps those terms weigh on most: the
    largest share of its full step's time is their uncertainty. None when the pick holds either way."""
    if len(safe) < 2 or context.model.covariance is None:
        return None
    knobs = [c.knobs for c in safe]
    terms = context.model.identification(decision_steps(context, knobs))
    open_ = [f for f, t in terms.items() if t.status == UNIDENTIFIED]
    if not open_:
        return None
    picks = set()
    for end in ("low", "high"):
        values = {f: getattr(terms[f], end) for f in open_}
        if any(not math.isfinite(v) for v in values.values()):
            values = {f: (v if math.isfinite(v) else 2 * terms[f].coefficient + max(
                terms[f].low, 1e-6)) for f, v in values.items()}  # unbounded: a what-if well above the estimate
        exact = StepModel(coefficients={**context.model.coefficients, **values}, steps=context.model.steps,
                          rms_error=context.model.rms_error, mean_seconds=context.model.mean_seconds)
        end_context = Context(exact, context.load, context.pods)
        judged = sorted((judge(end_context, k, slo, observations) for k in knobs),
                        key=lambda c: (c.pressure, c.knobs.token_budget, c.knobs.max_chunk))
        picks.add(judged[0].knobs)
    if len(picks) < 2:
        return None
    indices = [i for i, f in enumerate(FEATURES) if f in open_]

    def weight(k: Knobs) -> float:
        """The open terms' share of the full step's predicted time, at the upper ends of their intervals."""
        full = full_step_features(k, context.load)[-1]
        seconds = max(1e-9, context.model.step_seconds(full))
        return sum(min(terms[FEATURES[i]].high, 1e3) * full[i] for i in indices) / seconds
    return max(knobs, key=lambda k: (weight(k), -k.token_budget)), open_


def closest(screened: list[Judged], slo: SLOTargets) -> Knobs:
    """When nothing is predicted to keep every SLO: the knobs that keep the inter-token SLO and keep up, with the
    least TTFT among them; when none keeps the inter-token SLO, the least TTFT among the knobs whose inter-token
    stall is within STALL_TOLERANCE of the least (among the knobs that keep up, if any do); without an ITL SLO, the
    least pressure. Why the ITL first: a decode stall breaches every stream that is running, a long wait only the
    prompts queued behind it. Why not the least overall pressure: near saturation the predicted TTFT dominates it
    and is the least certain number the predictor makes (a queue's tail from a mean service time), so chasing it
    picks larger chunks, which stall every stream."""
    def keeps_up(c: Judged) -> bool:
        return c.candidate.utilization < 1.0

    def itl_ok(c: Judged) -> bool:
        within = c.candidate.itl is None or c.candidate.itl <= slo.itl.threshold * LATENCY_MARGIN
        return within and keeps_up(c)
    keeping = [c for c in screened if itl_ok(c)]
    if keeping and slo.ttft is not None:
        return min(keeping, key=lambda c: (c.candidate.ttft, c.knobs.token_budget)).knobs
    if not keeping and slo.itl is not None:
        pool = [c for c in screened if keeps_up(c)] or screened
        least = min(c.candidate.itl for c in pool)
        near = [c for c in pool if c.candidate.itl <= least * (1 + STALL_TOLERANCE)] or pool  # (NaN: all)
        if slo.ttft is not None:
            return min(near, key=lambda c: (c.candidate.ttft, c.knobs.token_budget, c.knobs.max_chunk)).knobs
        return min(near, key=lambda c: (c.candidate.itl, c.knobs.token_budget, c.knobs.max_chunk)).knobs
    return screened[0].knobs


def replicas_needed(context: Context, knobs: Knobs, slo: SLOTargets, observations: list[Observation] = ()
                    ) -> int | None:
    """The fewest pods at which `knobs` are predicted safe for the deployment's whole load (the measured load per
    pod times the pods, spread as it is now: Load.imbalance kept). None when more replicas cannot help: not even
    REPLICAS_CAP pods would do, or only pods left mostly idle (prefill utilization under MIN_USEFUL_UTILIZATION)
    would, which says a single request is too slow for the SLO rather than the queue too long (the demo's
    1024-token prompts on one CPU thread: "36 replicas" for 0.44 req/s, an answer no one should act on)."""
    load = context.load
    # from one pod more than run: the closest knobs are here because nothing is allowed at the pods that run (a
    # prediction of "safe" there was overruled by a measurement), so the answer is never "as many as now"
    for pods in range(max(1, context.pods) + 1, REPLICAS_CAP + 1):
        judged = judge(Context(context.model, load.scaled(context.pods / pods), pods), knobs, slo, observations)
        if judged.safe:
            return pods if judged.candidate.utilization >= MIN_USEFUL_UTILIZATION else None
    return None
