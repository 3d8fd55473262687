"""The demo's outputs, long prompts and ITL SLO sized to the machine it runs on, from what that machine measures.

A demo whose SLO no knobs can meet says nothing about a tuner, and neither does one whose SLO the start-up knobs
already meet. So, before the load:

1. The probe (chunkpilot.demo.probe) drives the tuned group's engines through steps of varied composition until
   the step-time fit identifies every term; the fit is judged at the upper end of its intervals (StepModel.upper).
2. The sizing (pure functions here) lengthens the outputs until streams live long enough for long prompts to
   stall them, sets the ITL SLO so the smallest knobs have room under it, and shrinks the long prompts until some
   knobs of the tuner's space are predicted to keep that SLO with the tuner's headroom at the busiest phase's rate.
3. The measured check (chunkpilot.demo.check) runs the busiest phase's rate on both groups: the knobs the sizing
   counts on must measure an ITL p99 within CHECK_SHARE of the SLO, and the start-up knobs over it. Otherwise the
   SLO or the load is resized from what was measured (`next_plan`) and checked again, at most MAX_CHECKS times.

Both groups get the same sized load; the report states what was sized and what the check measured."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

from chunkpilot.loadgen.workloads import build_workload
from chunkpilot.tuner import (Knobs, Load, SearchSpace, StepModel, TunerSettings, MAX_PREFILL_UTILIZATION,
                              PRIOR_SPREAD, predict)

log = logging.getLogger(__name__)

# The tuner judges knobs at its load headroom (the measured load 1 + drift_load_shift times over) against
# MAX_PREFILL_UTILIZATION; the sized load leaves the same room, so that some knobs are safe for the tuner too.
TARGET_UTILIZATION = MAX_PREFILL_UTILIZATION / (1 + TunerSettings.drift_load_shift)
# The measured check: the counted knobs must measure an ITL p99 within this share of the SLO (a 40-s check is a
# sample of a few hundred gaps; the share is the room for what the main run's windows add to it).
CHECK_SHARE = 0.7
# The knobs the sizing counts on are predicted within what the check asks by two standard deviations of the
# predictor's own error (guide.PRIOR_SPREAD: its ITL p99 reads within about ±15 % of a measured one), and the SLO
# leaves the smallest knobs that room.
COUNTED_ITL_SHARE = CHECK_SHARE / (1 + 2 * PRIOR_SPREAD)
ITL_SLO_ROOM = 1 / COUNTED_ITL_SHARE
SCALES = tuple(round(1.0 - 0.05 * i, 2) for i in range(17))  # long prompts at 1.0, 0.95, ... 0.2 of the shapes
# Unchunked, one long prompt stalls every stream that is decoding, whatever its length; the demo shows that only
# if streams live long enough to meet long prompts. Outputs are lengthened until this share of the busy phase's
# streams see a long prompt arrive while they decode (Poisson arrivals: 1 - exp(-long-prompt rate x stream
# seconds)), and no further than OUTPUT_SCALES[-1]: the demo's requests stay chat-sized.
STALLED_SHARE = 0.5
OUTPUT_SCALES = (1.0, 1.25, 1.5, 1.75, 2.0)
MAX_CHECKS = 3
# What the check reads, as the demo's attainment judges a request: its own ITL p99. The counted knobs must keep
# it for the request ranking at the tuned group's attainment target (90 %); the start-up knobs must break it for
# the request ranking where the fixed group's attainment would leave the goodput target (1.25x) reachable by a
# tuner at 95 %: 1 - 0.95 / 1.25 = 24 % of requests over the SLO, read at the 75th percentile.
COUNTED_QUANTILE = 0.9
START_QUANTILE = 0.75
RATE_SCALES = (1.0, 0.8, 0.64, 0.5, 0.4, 0.32, 0.25)  # the busiest rate, lowered a fifth at a time
# ... or raised, on a host whose streams end so quickly that even the longest outputs leave fewer than
# STALLED_SHARE of them meeting a long prompt: more long prompts a second, as many per stream as elsewhere.
RATE_UPS = (1.0, 1.25, 1.5, 1.75, 2.0)


def _busy(config, scale: float, model, space: SearchSpace) -> tuple[Load, float]:
    """The busiest phase's load per engine at this rag scale, and its mean output tokens."""
    phase = max(config.phases(), key=lambda p: p.rate)
    specs = build_workload([replace(phase, duration=600.0)], vocab_size=49152, seed=config.seed,
                           shapes=config.shapes(scale))
    # the mix as a histogram of 64-token bins (the predictor walks every entry for every candidate)
    bins: dict[float, float] = {}
    for spec in specs:
        b = float(64 * (spec.prompt_tokens // 64) + 32)
        bins[b] = bins.get(b, 0.0) + 1.0
    prompts = tuple(sorted(bins.items()))
    outputs = sum(s.max_tokens for s in specs) / max(1, len(specs))
    load = Load(request_rate=phase.rate, prompts=prompts, running=1.0)
    for _ in range(3):  # running depends on the decode step, which depends on running
        step = predict(model, space.all_knobs()[0], load).decode_step
        if not math.isfinite(step):  # an unbounded upper end: keep the last finite estimate
            break
        load = replace(load, running=max(1.0, phase.rate * outputs * step))
    return load, outputs


def busy_load(config, scale: float, model, space: SearchSpace) -> Load:
    """The busiest phase's load per engine at this rag scale: its prompts (sampled as the workload samples them)
    and the decodes in flight (arrival rate x output tokens x a decode step, the predictor's own)."""
    return _busy(config, scale, model, space)[0]


def counted(config, scale: float, model, space: SearchSpace) -> Knobs | None:
    """The knobs the sizing counts on at this rag scale: of those predicted to keep the ITL p99 within
    COUNTED_ITL_SHARE of the SLO (what the check will ask of them) with prefill utilization within TARGET_UTILIZATION,
    the least loaded against both limits; None when no knobs do."""
    load = busy_load(config, scale, model, space)
    best, least = None, math.inf
    for knobs in space.all_knobs():
        p = predict(model, knobs, load)
        if not (math.isfinite(p.itl_p99) and math.isfinite(p.utilization)):
            continue  # a step the fit cannot bound does not fit
        pressure = max(p.itl_p99 / (config.itl_slo * COUNTED_ITL_SHARE), p.utilization / TARGET_UTILIZATION)
        if pressure <= 1.0 and pressure < least:
            best, least = knobs, pressure
    return best


def fits(config, scale: float, model, space: SearchSpace) -> bool:
    return counted(config, scale, model, space) is not None


def long_prompt_rate(config) -> float:
    phase = max(config.phases(), key=lambda p: p.rate)
    return phase.rate * phase.mix.get("rag", 0.0) / max(1e-12, sum(phase.mix.values()))


def stream_target(config) -> float:
    """Seconds the mean stream must decode for STALLED_SHARE of streams to meet a long prompt."""
    return -math.log(1 - STALLED_SHARE) / max(1e-12, long_prompt_rate(config))


def stream_seconds(config, model, space: SearchSpace) -> float:
    """How long the busy phase's mean stream decodes at the smallest knobs (its outputs x their decode step)."""
    load, outputs = _busy(config, 1.0, model, space)
    return outputs * predict(model, space.all_knobs()[0], load).decode_step


def output_scale(config, model, space: SearchSpace) -> float:
    """The least of OUTPUT_SCALES at which the mean stream decodes for stream_target (the largest when none)."""
    target = stream_target(config)
    return next((s for s in OUTPUT_SCALES if stream_seconds(replace(config, output_scale=s), model, space) >= target),
                OUTPUT_SCALES[-1])


def itl_slo(config, model, space: SearchSpace) -> float:
    smallest = predict(model, space.all_knobs()[0], busy_load(config, 1.0, model, space)).itl_p99
    if not math.isfinite(smallest):
        return config.itl_slo
    return max(config.itl_slo, math.ceil(20 * ITL_SLO_ROOM * smallest) / 20)  # in 0.05 s


def rag_scale(config, model, space: SearchSpace) -> float:
    """The largest scale (at most 1) at which some knobs fit; the smallest one tried when none does."""
    return next((s for s in SCALES if fits(config, s, model, space)), SCALES[-1])


def stalled_share(config, model, space: SearchSpace) -> float:
    """The share of the busy phase's streams that see a long prompt arrive while they decode (Poisson)."""
    return 1 - math.exp(-long_prompt_rate(config) * stream_seconds(config, model, space))


def busier(config, model, space: SearchSpace) -> float:
    """The least of RATE_UPS at which, outputs lengthened as far as they go, STALLED_SHARE of the streams meet a long
    prompt (the largest when none does)."""
    for up in RATE_UPS:
        sized = replace(config, rate=round(config.rate * up, 3))
        sized = replace(sized, output_scale=output_scale(sized, model, space))
        if stalled_share(sized, model, space) >= STALLED_SHARE:
            return up
    return RATE_UPS[-1]


def plan(config, model, space: SearchSpace):
    """The config sized for `model` (judged at its upper bound) and the knobs it counts on (None: none fit even
    at the smallest long prompts and the lowest rate). Outputs first: the decodes in flight are part of every load
    the SLO and the prompts are sized against; the rate is raised only where the longest outputs still leave too
    few streams meeting a long prompt, and lowered (RATE_SCALES) only where no long prompts short enough would
    do: a host that slow cannot serve the demo's rate with any knobs."""
    judged = model.upper() if isinstance(model, StepModel) else model
    up = busier(config, judged, space)
    rates = [r for r in reversed(RATE_UPS) if r <= up] + list(RATE_SCALES[1:])
    for rate in rates:
        sized = replace(config, rate=round(config.rate * rate, 3))
        sized = replace(sized, output_scale=output_scale(sized, judged, space))
        sized = replace(sized, itl_slo=itl_slo(sized, judged, space))
        sized = replace(sized, rag_scale=rag_scale(sized, judged, space))
        knobs = counted(sized, sized.rag_scale, judged, space)
        if knobs is not None:
            return sized, knobs
    return sized, None


@dataclass(frozen=True)
class Check:
    """What the measured check saw at the busiest phase's rate, both groups at once."""

    knobs: Knobs  # what the tuned group ran: the knobs the sizing counts on
    itl_slo: float
    counted_itl: float | None  # the tuned group's requests' ITL p99, at COUNTED_QUANTILE of them
    start_itl: float | None  # the fixed group's (start-up knobs) requests' ITL p99, at START_QUANTILE of them
    predicted_itl: float  # the sizing's prediction for `knobs` (upper bound)
    contention: float | None = None  # the tuned group's steps: measured seconds / the probe fit's prediction

    @property
    def counted_ok(self) -> bool:
        return self.counted_itl is not None and self.counted_itl <= CHECK_SHARE * self.itl_slo

    @property
    def start_over(self) -> bool:
        return self.start_itl is not None and self.start_itl > self.itl_slo

    @property
    def ok(self) -> bool:
        return self.counted_ok and self.start_over

    def line(self) -> str:
        def s(v):
            return f"{v:.2f} s" if v is not None else "no value"
        cont = f"; steps at {self.contention:.2f}x the probe fit's prediction" if self.contention else ""
        return (f"measured at the busiest rate (each request's ITL p99): {self.knobs.token_budget}/"
                f"{self.knobs.max_chunk} {COUNTED_QUANTILE:.0%} of requests within "
                f"{s(self.counted_itl)} (predicted {self.predicted_itl:.2f} s, must be <= {CHECK_SHARE:g} x "
                f"{self.itl_slo:g} s), start-up knobs {1 - START_QUANTILE:.0%} of requests over "
                f"{s(self.start_itl)} (must be over the SLO){cont}")


@dataclass(frozen=True)
class Resize:
    """What the next check runs after a failed one: a re-plan of `config` on `model`, or, with `knobs`, those knobs
    checked again at `config` as it is (only its SLO moved)."""

    model: StepModel
    config: object
    knobs: Knobs | None = None
    why: str = ""


def next_plan(check: Check, model: StepModel, base, sized=None) -> Resize | None:
    """How to resize after a failed check (`base`: what plan() sized from, `sized`: what it sized):
    - the counted knobs kept the SLO but not the check's room under it (CHECK_SHARE): the SLO is widened to give
      them that room, as itl_slo() gives the smallest knobs theirs, if the start-up knobs still break the widened
      SLO; the load and the knobs stay (the prediction was near, the measurement decides);
    - the counted knobs broke the SLO itself: the model is slowed by what was measured and the load re-planned;
    - the start-up knobs kept the SLO for too many requests: a quarter more requests a second (more streams meet
      a long prompt), re-planned;
    - None when nothing was measured to resize from. MAX_CHECKS bounds how far it goes."""
    sized = base if sized is None else sized
    if not check.counted_ok:
        if check.counted_itl is None:
            return None
        widened = math.ceil(20 * check.counted_itl / CHECK_SHARE - 1e-9) / 20  # in 0.05 s, as itl_slo()
        if check.counted_itl <= check.itl_slo and check.start_itl is not None and check.start_itl > widened:
            return Resize(model, replace(sized, itl_slo=widened), check.knobs,
                          f"the counted knobs kept the SLO without its room: ITL SLO {check.itl_slo:g} -> "
                          f"{widened:g} s, same load")
        # at least a tenth slower (the check failed), at most 4x per resize (a failed request reads as infinite)
        slower = min(4.0, max(1.1, check.counted_itl / max(1e-9, check.predicted_itl)))
        return Resize(slow(model, slower), base, why=f"the counted knobs broke the SLO: the model {slower:.2f}x "
                                                     "slower, the load re-planned")
    if check.start_itl is None:
        return None
    return Resize(model, replace(base, rate=round(base.rate * RATE_UPS[1], 3)),
                  why="the start-up knobs kept the SLO: a quarter more requests a second, re-planned")


def slow(model: StepModel, factor: float) -> StepModel:
    """The model with every step `factor` times as long (intervals scaled alike)."""
    cov = None if model.covariance is None else tuple(tuple(c * factor * factor for c in row)
                                                       for row in model.covariance)
    return replace(model, coefficients={k: v * factor for k, v in model.coefficients.items()},
                   rms_error=model.rms_error * factor, mean_seconds=model.mean_seconds * factor, covariance=cov)


@dataclass
class Sizing:
    """What the sizing did, for the summary line and demo.json."""

    model: StepModel | None = None
    rounds: int = 0
    terms: str = ""
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready: an unbounded interval end or a failed request's infinite ITL is null (JSON has no Infinity)."""
        m = self.model

        def finite(v):
            return v if not isinstance(v, float) or math.isfinite(v) else None
        return {"rounds": self.rounds, "terms": self.terms, "notes": self.notes,
                "coefficients": m.coefficients if m else None,
                "intervals": {f: [finite(t.low), finite(t.high)] for f, t in m.identification().items()} if m else None,
                "statuses": {f: t.status for f, t in m.identification().items()} if m else None,
                "checks": [{**{k: finite(v) for k, v in c.__dict__.items()},
                            "knobs": [c.knobs.token_budget, c.knobs.max_chunk], "ok": c.ok} for c in self.checks]}


def size(config, model: StepModel, space: SearchSpace, measure, say=print, sizing: Sizing | None = None):
    """Plan on the probe's `model`, check by `measure(config, knobs, predicted_itl) -> Check`, resize from what
    was measured until the check passes (at most MAX_CHECKS). Returns the sized config and what it did."""
    sizing = sizing or Sizing(model=model)
    base, resize = config, None
    for attempt in range(1, MAX_CHECKS + 1):
        if resize is not None and resize.knobs is not None:
            config, knobs = resize.config, resize.knobs
        else:
            config, knobs = plan(base, model, space)
        if knobs is None:
            sizing.notes.append("no knobs are predicted to keep the ITL SLO at the smallest long prompts")
            say("sizing: no knobs are predicted to keep the ITL SLO even at the smallest long prompts")
            return config, sizing
        load = busy_load(config, config.rag_scale, model.upper(), space)
        predicted = predict(model.upper(), knobs, load).itl_p99
        say(f"sizing {attempt}: {config.rate:g} req/s at the busiest, ITL SLO {config.itl_slo:g} s, outputs {config.output_scale:g}x, long prompts at "
            f"{config.rag_scale:.0%}; counting on {knobs.token_budget}/{knobs.max_chunk} (predicted ITL p99 "
            f"{predicted:.2f} s); checking at the busiest rate...")
        check = measure(config, knobs, predicted)
        sizing.checks.append(check)
        say(check.line())
        if check.ok:
            return config, sizing
        # the next plan keeps what this one sized from, with the SLO and rate it got to
        resize = next_plan(check, model, replace(base, itl_slo=config.itl_slo, rate=config.rate), config)
        if resize is None:
            sizing.notes.append("the check cannot be met by resizing: " + check.line())
            say("the check measured nothing to resize from: the demo goes on as sized")
            return config, sizing
        say(f"resizing: {resize.why}")
        model, base = resize.model, (base if resize.knobs is not None else resize.config)
    sizing.notes.append(f"the check did not pass in {MAX_CHECKS} tries; the demo goes on with the last sizing")
    return config, sizing
