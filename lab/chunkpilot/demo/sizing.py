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
import statistics
import time
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
# The checks stop after this many seconds (a check that would end past it is not started) or MAX_CHECKS.
SIZING_SECONDS = 300.0
MAX_CHECKS = 8
# A check during which other programs took more than this share of the machine's CPU time measured them: repeated.
BUSY_SHARE = 0.1
# What a resize leaves for the next check's noise: a measured figure 15 % worse still passes. (Three checks in a
# row on one quiet host read the counted knobs' steps at 1.29x, 1.33x and 1.37x the probe's fit.)
NOISE_ROOM = 0.15
# A rate step by a measured ratio is at least 10 % (smaller is noise) and at most 2x (a failed request reads as
# infinite); the search ends when the rates found too light and too heavy are within 10 % of each other.
STEP_BOUNDS = (1.1, 2.0)
MIN_BRACKET = 1.1
# The learnt slowness of the probe's fit stays within these (a check that measured 10x measured something else);
# a re-plan on it happens when it moved by more than MODEL_MOVED since the last plan.
CONTENTION_BOUNDS = (0.5, 4.0)
MODEL_MOVED = 0.1
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
    start_over_share: float | None = None  # the fixed group's requests whose own ITL p99 broke the SLO
    busy: float | None = None  # the share of the engines' CPU time other programs took meanwhile (demo.host)
    rate: float | None = None  # the busiest rate it ran (requests/s per engine)

    @property
    def counted_ok(self) -> bool:
        return self.counted_itl is not None and self.counted_itl <= CHECK_SHARE * self.itl_slo

    @property
    def start_over(self) -> bool:
        return self.start_itl is not None and self.start_itl > self.itl_slo

    @property
    def ok(self) -> bool:
        return self.counted_ok and self.start_over

    @property
    def host_busy(self) -> bool:
        return self.busy is not None and self.busy > BUSY_SHARE

    def line(self) -> str:
        def s(v):
            return f"{v:.2f} s" if v is not None else "no value"
        cont = f"; steps at {self.contention:.2f}x the probe fit's prediction" if self.contention else ""
        busy = f"; other programs took {self.busy:.0%} of the CPU" if self.busy is not None else ""
        return (f"measured at the busiest rate (each request's ITL p99): {self.knobs.token_budget}/"
                f"{self.knobs.max_chunk} {COUNTED_QUANTILE:.0%} of requests within "
                f"{s(self.counted_itl)} (predicted {self.predicted_itl:.2f} s, must be <= {CHECK_SHARE:g} x "
                f"{self.itl_slo:g} s), start-up knobs {1 - START_QUANTILE:.0%} of requests over "
                f"{s(self.start_itl)} (must be over the SLO){cont}{busy}")


@dataclass(frozen=True)
class Resize:
    """What the next check runs after a failed one: a re-plan at `rate` times the configured busiest rate on the
    probe's fit slowed `scale` times, or, with `knobs`, those knobs checked again at `config` as it is."""

    why: str
    scale: float = 1.0
    rate: float = 1.0
    config: object = None
    knobs: Knobs | None = None


@dataclass
class Search:
    """Where the sizing stands between checks: the probe fit's slowness it plans on (learnt from every check's
    steps), the rate multiplier it plans at, and the multipliers found too heavy and too light so far (the next
    one is bracketed between them)."""

    scale: float = 1.0
    rate: float = 1.0
    too_light: float = 0.0  # the largest rate multiplier whose load the start-up knobs kept
    too_heavy: float = math.inf  # the smallest one whose load the counted knobs broke
    contentions: list[float] = field(default_factory=list)

    def learnt_scale(self) -> float:
        """The median of every quiet check's measured contention (a transient moves a median little), within
        CONTENTION_BOUNDS; 1 (the probe fit as it is) before any."""
        if not self.contentions:
            return 1.0
        lo, hi = CONTENTION_BOUNDS
        return min(hi, max(lo, statistics.median(self.contentions)))


def slo_between(check: Check, floor: float) -> float | None:
    """An ITL SLO at which the measured figures say this very load passes: the counted knobs' figure with its
    room (CHECK_SHARE) and NOISE_ROOM more, at least `floor` (what was asked for), in 0.05 s, and still under the
    start-up knobs' figure by NOISE_ROOM; None when no SLO fits between them."""
    if check.counted_itl is None or check.start_itl is None or not math.isfinite(check.counted_itl):
        return None
    slo = max(floor, math.ceil(20 * check.counted_itl * (1 + NOISE_ROOM) / CHECK_SHARE - 1e-9) / 20)
    return slo if slo * (1 + NOISE_ROOM) < check.start_itl else None


def light_ratio(check: Check) -> float:
    """How many times more requests a second would have a quarter of the start-up knobs' requests break the SLO
    (with NOISE_ROOM), from the share that did: streams meet a long prompt as a Poisson process, so the share
    over is 1 - exp(-c x rate) and the rate needed scales as log(1 - target) / log(1 - measured)."""
    target = min(0.9, (1 - START_QUANTILE) * (1 + NOISE_ROOM))
    share = check.start_over_share
    if share is None or share <= 0:
        return STEP_BOUNDS[1]
    return min(STEP_BOUNDS[1], max(STEP_BOUNDS[0], math.log(1 - target) / math.log(1 - min(share, 0.99))))


def heavy_ratio(check: Check) -> float:
    """How many times the counted knobs' measured figure exceeds what the check asks (CHECK_SHARE of the SLO)."""
    over = (check.counted_itl or math.inf) / (CHECK_SHARE * check.itl_slo)
    return min(STEP_BOUNDS[1], max(STEP_BOUNDS[0], over))


def next_plan(check: Check, search: Search, floor: float, config) -> Resize | None:
    """How to resize after a failed check taken on a quiet host (`floor`: the SLO asked for; `config`: what was
    checked). `search` is updated with what the check measured. None: nothing to resize from, or the bracket
    closed (no rate between one too light and one too heavy). In order:
    1. the probe fit's slowness is learnt again from every quiet check's steps (their median contention);
    2. where an SLO fits between the two groups' measured figures, the same load and knobs are checked at it
       (this moves the SLO up for counted knobs that missed their room, and down for start-up knobs that kept a
       wider one: only a load change can help either otherwise);
    3. otherwise the rate moves by the measured ratio (down by how far the counted knobs were over, up by how
       many more requests a second put a quarter of the start-up knobs' requests over the SLO), kept inside the
       bracket of rates already found too light and too heavy: bisected (geometric) when the step leaves it.
       A re-plan also takes the learnt slowness, so a model that moved re-plans at the same rate first."""
    if check.counted_itl is None or check.start_itl is None:
        return None
    if check.contention is not None and math.isfinite(check.contention):
        search.contentions.append(check.contention)
    learnt = search.learnt_scale()
    slo = slo_between(check, floor)
    if slo is not None:
        return Resize(f"an ITL SLO of {slo:g} s lies between the measured figures: {check.itl_slo:g} -> {slo:g} s, "
                      "same load and knobs", search.scale, search.rate, replace(config, itl_slo=slo), check.knobs)
    heavy = not check.counted_ok
    if heavy:
        search.too_heavy = min(search.too_heavy, search.rate)
    else:
        search.too_light = max(search.too_light, search.rate)
    if search.too_heavy / max(search.too_light, 1e-9) < MIN_BRACKET:
        return None
    moved = abs(learnt / search.scale - 1) > MODEL_MOVED
    rate = search.rate
    if moved:  # the bracket was found on the old model: the new one starts its own, at the same rate
        search.too_light, search.too_heavy = 0.0, math.inf
    else:
        rate = rate / heavy_ratio(check) if heavy else rate * light_ratio(check)
        # search.rate is inside the bracket and a step moves away from the side it just set, so a step can leave
        # it only through the other side, which is then known: bisect
        if not search.too_light < rate < search.too_heavy and search.too_light > 0 and \
                math.isfinite(search.too_heavy):
            rate = math.sqrt(search.too_light * search.too_heavy)
    why = (f"the counted knobs over {CHECK_SHARE:g} x the SLO" if heavy else "the start-up knobs kept the SLO")
    how = (f"the probe fit {learnt:.2f}x slower (the checks' median contention), re-planned at the same rate"
           if moved else f"the busiest rate x{rate / search.rate:.2f}, re-planned")
    search.scale, search.rate = learnt, rate
    return Resize(f"{why}: {how}", learnt, rate)


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
    passed: bool = False
    probe_busy: float | None = None  # other programs' share of the CPU during the probe (demo.host)
    scale: float = 1.0  # how much slower than the probe's fit the last plan judged the engines (learnt)
    seconds: float = 0.0  # how long the checks took
    stopped: str = ""  # why the demo stops before the load (empty: it goes on)

    def to_dict(self) -> dict:
        """JSON-ready: an unbounded interval end or a failed request's infinite ITL is null (JSON has no Infinity)."""
        m = self.model

        def finite(v):
            return v if not isinstance(v, float) or math.isfinite(v) else None
        return {"rounds": self.rounds, "terms": self.terms, "notes": self.notes, "passed": self.passed,
                "probe_busy": self.probe_busy, "scale": self.scale, "seconds": self.seconds,
                "stopped": self.stopped,
                "coefficients": m.coefficients if m else None,
                "intervals": {f: [finite(t.low), finite(t.high)] for f, t in m.identification().items()} if m else None,
                "statuses": {f: t.status for f, t in m.identification().items()} if m else None,
                "checks": [{**{k: finite(v) for k, v in c.__dict__.items()},
                            "knobs": [c.knobs.token_budget, c.knobs.max_chunk], "ok": c.ok} for c in self.checks]}


def stop_message(sizing: Sizing, bound: float) -> str:
    """Why the demo stops before its load, what was measured, and what to do."""
    checks = sizing.checks
    busy = [c.busy for c in checks if c.busy is not None]
    lines = [f"the sizing did not pass its measured check within its bound ({len(checks)} check"
             f"{'s' * (len(checks) != 1)} in {sizing.seconds:.0f} s; none starts that would end past "
             f"{bound:.0f} s); the demo stops before its load, since a run sized like this could not show a "
             "difference between the groups."]
    lines += [f"  check {i}: {c.line()}" for i, c in enumerate(checks, 1)]
    if busy and max(busy) > BUSY_SHARE:
        lines.append(f"  other programs took up to {max(busy):.0%} of the engines' CPU (their cores, or the CPU "
                     "quota) during the checks: the engines' step times measured them, not the engines. Close them "
                     "and run the demo again, or give the demo cores nothing else uses (--cores).")
    else:
        lines.append("  on this machine now, no load the sizing can reach has the start-up knobs break the ITL SLO "
                     "while the tuner's knobs keep it. Try an ITL SLO of your own (--itl-slo), other cores "
                     "(--cores), or a quieter moment.")
    if busy and max(busy) > BUSY_SHARE:  # the SLO can matter on a busy host too
        lines.append("  An ITL SLO of your own (--itl-slo) can also help once the host is quiet.")
    lines.append("  --force runs the load anyway.")
    return "\n".join(lines)


def size(config, model: StepModel, space: SearchSpace, measure, say=print, sizing: Sizing | None = None,
         bound: float = SIZING_SECONDS, clock=time.monotonic, stop=None):
    """Plan on the probe's `model`, check by `measure(config, knobs, predicted_itl) -> Check`, resize from what
    was measured (`next_plan`) until the check passes, for at most `bound` seconds of checks (a check is not
    started that would end past it) and MAX_CHECKS. A check taken while other programs used the host (BUSY_SHARE)
    is repeated, not resized on. Returns the sized config and what it did (`sizing.passed`; `sizing.stopped`
    says why not)."""
    sizing = sizing or Sizing(model=model)
    probe_model, search, base = model, Search(), config
    t0 = clock()
    resize = None
    for attempt in range(1, MAX_CHECKS + 1):
        if clock() - t0 + config.check_seconds > bound and sizing.checks:
            break
        if stop is not None and stop.is_set():  # Ctrl-C: the demo reports an interruption, not a failed sizing
            sizing.notes.append("interrupted")
            return config, sizing
        if resize is not None and resize.knobs is not None:
            config, knobs = resize.config, resize.knobs
        else:
            config, knobs = plan(replace(base, rate=round(base.rate * search.rate, 3)), slow(probe_model, search.scale),
                                 space)
        if knobs is None:
            sizing.notes.append("no knobs are predicted to keep the ITL SLO at the smallest long prompts")
            say("sizing: no knobs are predicted to keep the ITL SLO even at the smallest long prompts")
            if not sizing.checks:  # else what the checks measured says more (stop_message below)
                sizing.stopped = ("no knobs are predicted to keep the ITL SLO even at the smallest long prompts: "
                                  "this machine is too slow now for the demo at any load the sizing can size "
                                  "(--itl-slo sets a wider SLO; --force runs anyway)")
            break
        judged = slow(probe_model, search.scale).upper()
        predicted = predict(judged, knobs, busy_load(config, config.rag_scale, judged, space)).itl_p99
        say(f"sizing {attempt}: {config.rate:g} req/s at the busiest, ITL SLO {config.itl_slo:g} s, outputs "
            f"{config.output_scale:g}x, long prompts at {config.rag_scale:.0%}"
            f"{f', the probe fit judged {search.scale:.2f}x slower' if search.scale != 1 else ''}; counting on "
            f"{knobs.token_budget}/{knobs.max_chunk} (predicted ITL p99 {predicted:.2f} s); checking at the "
            "busiest rate...")
        check = measure(config, knobs, predicted)
        sizing.checks.append(check)
        sizing.seconds = clock() - t0
        say(check.line())
        if check.host_busy:
            resize = Resize("busy host", search.scale, search.rate, config, knobs)
            say(f"other programs took {check.busy:.0%} of the CPU during the check (over {BUSY_SHARE:.0%}): "
                "checking the same load again, not resizing on it")
            continue
        if check.ok:
            sizing.passed, sizing.scale = True, search.scale
            return config, sizing
        resize = next_plan(check, search, base.itl_slo, config)
        if resize is None:
            sizing.notes.append("nothing to resize from: " + check.line())
            say("no load left between one too light and one too heavy: nothing to resize to")
            break
        say(f"resizing: {resize.why}")
    sizing.scale = search.scale
    if not sizing.stopped:
        sizing.stopped = stop_message(sizing, bound)
    sizing.notes.append(f"the check did not pass in {len(sizing.checks)} checks, {sizing.seconds:.0f} s")
    return config, sizing
