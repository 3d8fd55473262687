"""The model-guided tuner: the safe-set filter and its calibration (pure, on a known step cost), the loop on the
simulator (first trial = the predicted best, nothing tried outside the predicted-safe set, rejected asks told to
Optuna as pruned), and NoFeasibleKnobs with the replicas needed, through status, condition, Event and metric."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner import guide
from chunkpilot.tuner.history import TrialKind
from chunkpilot.tuner.daemon import StatusPublisher
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.metrics import FEASIBLE, REPLICAS_NEEDED, TunerMetrics
from chunkpilot.tuner.predictor import Load
from chunkpilot.sim.costmodel import default
from chunkpilot.sim.experiment import Scenario, _Quiet
from chunkpilot.sim.simulator import SimActuator, SimMeasurer, Simulator
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.state import conditions, dump, status_tuning
from chunkpilot.tuner.step_model import StepModel
from chunkpilot.tuner.study import TunerStudy

SLO = SLOTargets(ttft=LatencyTarget(0.99, 20.0), itl=LatencyTarget(0.99, 0.25))
SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)
COST = default()
# The CPU fit as a step-time model, exact (no residual): what the filter decides is the predictor's alone.
MODEL = COST.as_step_model()
LOAD = Load(request_rate=0.9, prompts=((64.0, 8.0), (1024.0, 2.0)), running=5.0)


def context(load: Load = LOAD, model: StepModel = MODEL, pods: int = 1) -> guide.Context:
    return guide.Context(model=model, load=load, pods=pods)


def test_safe_means_every_predicted_quantity_within_its_limit():
    screened = guide.screen(context(), SPACE.all_knobs(), SLO)
    safe = [c for c in screened if c.safe]
    assert 0 < len(safe) < len(screened)
    for c in screened:
        ratios = [c.candidate.ttft / (20.0 * 0.9), c.candidate.itl / (0.25 * 0.9), c.candidate.utilization / 0.8]
        assert c.pressure == pytest.approx(max(ratios))
        assert c.safe == all(r <= 1 for r in ratios)
    # ordered by pressure: the predicted best first
    assert [c.pressure for c in screened] == sorted(c.pressure for c in screened)
    # big unchunked budgets stall decodes for a whole 1024-token prompt: predicted over the ITL SLO
    assert not next(c for c in screened if c.knobs == Knobs(2048, 2048)).safe
    # a tiny budget cannot keep up with the prompts
    tiny = next(c for c in screened if c.knobs == Knobs(32, 32))
    assert not tiny.safe and tiny.candidate.utilization > 0.8


def test_a_measured_underprediction_nearby_shrinks_the_safe_set_there():
    best = guide.screen(context(), SPACE.all_knobs(), SLO)[0]
    # measured twice the predicted ITL at the predicted best: one window, shrunk towards "the model is right" by
    # one pseudo-window, scales the prediction by sqrt(2), and the spread it reveals widens the margin on top
    seen = guide.Observation(best.knobs, predicted_itl=0.1, measured_itl=0.2, predicted_ttft=None, measured_ttft=None)
    again = {c.knobs: c for c in guide.screen(context(), SPACE.all_knobs(), SLO, [seen])}
    assert again[best.knobs].candidate.itl > 2 ** 0.5 * best.candidate.itl
    assert not again[best.knobs].safe
    # five octaves away and more: only the bias every window shares moves its calibration (a third of the way:
    # log 2 shrunk by one pseudo-window is log 2 / 2, and the near knob gets its local deviation on top)
    far = Knobs(2048, 1024)
    alone = guide.judge(context(), far, SLO)
    moved = again[far].candidate.itl / alone.candidate.itl
    near = again[best.knobs].candidate.itl / best.candidate.itl
    assert 1.0 < moved < near


def test_the_margin_widens_with_the_models_uncertainty():
    noisy = StepModel(coefficients=MODEL.coefficients, steps=500, rms_error=0.06, mean_seconds=0.1)  # 60 % residual
    exact = sum(c.safe for c in guide.screen(context(), SPACE.all_knobs(), SLO))
    wide = sum(c.safe for c in guide.screen(context(model=noisy), SPACE.all_knobs(), SLO))
    assert wide < exact


def test_safe_keeps_a_load_headroom():
    # knobs that only just fit the measured load are not tried: safe means safe at 1.5x the arrivals and decodes
    light = context(Load(request_rate=0.6, prompts=LOAD.prompts, running=3.0))
    stressed = guide.stressed(light, 0.5)
    assert stressed.load.request_rate == pytest.approx(0.9) and stressed.load.running == pytest.approx(4.5)
    plain = {c.knobs for c in guide.screen(light, SPACE.all_knobs(), SLO) if c.safe}
    kept = {c.knobs for c in guide.screen(light, SPACE.all_knobs(), SLO, stress=0.5) if c.safe}
    assert kept and kept < plain


def test_replicas_needed_spread_the_measured_load():
    heavy = Load(request_rate=4.0, prompts=LOAD.prompts, running=LOAD.running * 4)
    assert not any(c.safe for c in guide.screen(context(heavy), SPACE.all_knobs(), SLO))
    best = guide.screen(context(heavy), SPACE.all_knobs(), SLO)[0].knobs
    need = guide.replicas_needed(context(heavy), best, SLO)
    assert need is not None and need >= 2
    per_pod = Load(request_rate=4.0 / need, prompts=LOAD.prompts, running=LOAD.running * 4 / need)
    assert guide.judge(context(per_pod, pods=need), best, SLO).safe
    # two pods measured at that load per pod already count as two
    assert guide.replicas_needed(context(heavy, pods=2), best, SLO) == max(2, need * 2)
    # a single step over the ITL SLO: no number of replicas helps
    slow = StepModel(coefficients={**MODEL.coefficients, "overhead": 1.0}, steps=500, rms_error=0.0,
                     mean_seconds=1.0)
    assert guide.replicas_needed(context(model=slow), best, SLO) is None
    # knobs predicted safe at the pods that run are here only because a measurement overruled that: never "as many
    # replicas as now"
    safe = next(c for c in guide.screen(context(), SPACE.all_knobs(), SLO) if c.safe).knobs
    assert guide.replicas_needed(context(), safe, SLO) != 1


def test_closest_keeps_the_inter_token_slo_first():
    # past the prefill headroom everywhere, while a few knobs still keep the ITL SLO and keep up
    heavy = Load(request_rate=1.5, prompts=LOAD.prompts, running=LOAD.running * 1.5 / 0.9)
    screened = guide.screen(context(heavy), SPACE.all_knobs(), SLO)
    assert not any(c.safe for c in screened)
    chosen = next(c for c in screened if c.knobs == guide.closest(screened, SLO))
    assert chosen.knobs != screened[0].knobs  # not simply the least pressure
    assert chosen.candidate.itl <= 0.25 * 0.9 and chosen.candidate.utilization < 1
    keeping = [c for c in screened if c.candidate.itl <= 0.25 * 0.9 and c.candidate.utilization < 1]
    assert chosen.candidate.ttft == min(c.candidate.ttft for c in keeping)
    # nothing keeps the ITL SLO (every step is too slow): among the knobs that keep up, those within
    # STALL_TOLERANCE of the least inter-token stall, and of those the least TTFT; not the least pressure (which
    # the TTFT prediction drives near saturation)
    slow = StepModel(coefficients={**MODEL.coefficients, "overhead": 1.0}, steps=500, rms_error=0.0,
                     mean_seconds=1.0)
    screened = guide.screen(context(model=slow), SPACE.all_knobs(), SLO)
    chosen = next(c for c in screened if c.knobs == guide.closest(screened, SLO))
    up = [c for c in screened if c.candidate.utilization < 1]
    assert up
    least = min(c.candidate.itl for c in up)
    near = [c for c in up if c.candidate.itl <= least * (1 + guide.STALL_TOLERANCE)]
    assert chosen in near and chosen.candidate.ttft == min(c.candidate.ttft for c in near)
    # the tolerance matters here: the least stall alone would have waited longer
    stall_only = min(up, key=lambda c: c.candidate.itl)
    assert chosen.candidate.ttft < stall_only.candidate.ttft
    # and it stays narrow: nothing chosen stalls decodes more than the tolerance above the least
    far = [c for c in up if c.candidate.itl > least * (1 + guide.STALL_TOLERANCE)]
    assert far and min(c.candidate.ttft for c in far) < chosen.candidate.ttft
    # without an ITL SLO: the least pressure
    ttft_only = SLOTargets(ttft=SLO.ttft)
    screened = guide.screen(context(model=slow), SPACE.all_knobs(), ttft_only)
    assert guide.closest(screened, ttft_only) == screened[0].knobs


def _loop(rate: float, guidance: str = "model", trials: int = 6, start: Knobs = Knobs(2048, 2048), seed: int = 0):
    sim = Simulator(COST, Scenario(rate=rate, seed=3).workload(3600), start)
    settings = TunerSettings(window=60, warmup=10, max_trials=trials, min_requests=5, guidance=guidance)
    study = TunerStudy(":memory:", "sim", SPACE, SLO, "goodput", seed=seed)
    loop = TunerLoop(settings, SPACE, study, SimActuator(sim), SimMeasurer(sim, SLO), _Quiet(), SLO)
    sim.advance(70)  # a window served at the start-up knobs before the tuner looked
    return loop, study, sim


def test_guided_first_trial_is_the_predicted_best_and_nothing_predicted_unsafe_is_tried():
    loop, study, sim = _loop(0.7)
    stress = loop.s.drift_load_shift  # safe means safe with the load headroom the tuner keeps
    first = guide.screen(loop._context(180), SPACE.all_knobs(), SLO, stress=stress)[0]
    assert first.safe
    for _ in range(6):
        before = {k: m.feasible for k, m in ((m.knobs, m) for m in study.measured())}
        context = loop._context(180)
        allowed = {c.knobs for c in guide.screen(context, SPACE.all_knobs(), SLO, loop._observations(), stress)
                   if c.safe and c.knobs not in before} | {k for k, ok in before.items() if ok}
        loop.iterate()
        assert loop.state.history[-1].knobs in allowed | {first.knobs}
    trials = study.records(None)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete[0].kind == TrialKind.PREDICTED and complete[0].knobs == first.knobs
    # every rejected ask is pruned with a violated constraint: constrained TPE counts it infeasible
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert all(t.rejected and max(t.constraints) > 0 for t in pruned)
    assert loop.state.feasible is True and loop.state.replicas_needed is None
    # every window is over neither SLO (the scenario is feasible; the guide tries only what it predicts keeps them)
    assert all(h.window.itl <= 0.25 and h.window.ttft <= 20 for h in loop.state.history)


def test_blackbox_mode_asks_optuna_alone():
    loop, study, _ = _loop(0.9, guidance="blackbox")
    for _ in range(3):
        loop.iterate()
    trials = study.records(None)
    assert not any(t.state == TrialState.PRUNED for t in trials)
    assert not any(t.kind == TrialKind.PREDICTED for t in trials)
    assert loop.state.feasible is None
    with pytest.raises(ValueError, match="guidance"):
        TunerLoop(TunerSettings(guidance="magic"), SPACE, study, None, None, None, SLO)


class _Events:
    def __init__(self):
        self.posted, self.written = [], []

    def __call__(self, type_, reason, message):
        self.posted.append((type_, reason, message))

    # StatusPublisher's writer
    namespace, name = "ns", "heavy"

    def write(self, **parts):
        self.written.append(parts)


def test_no_feasible_knobs_says_so_with_the_replicas_needed_and_applies_the_closest():
    loop, study, sim = _loop(4.0, trials=3)  # four times what one CPU engine prefills within the SLOs
    events = _Events()
    metrics = TunerMetrics()
    from chunkpilot.tuner.config import TuningConfig

    publisher = StatusPublisher(events, TuningConfig(deployment="ns/heavy", slo=SLO), metrics, post_event=events)
    for _ in range(3):
        loop.iterate()
        publisher.publish(loop.state)
    state = loop.state
    assert state.feasible is False and state.replicas_needed and state.replicas_needed >= 2
    assert state.reason.startswith("NoFeasibleKnobs:") and f"about {state.replicas_needed} replicas" in state.reason
    # the closest knobs, not an exploration: every trial was the least-pressure knobs of its moment
    assert [t.kind for t in study.records()] == [TrialKind.CLOSEST] * 3
    tuning = dump(status_tuning(state, SLO, "goodput"))
    assert tuning["feasible"] is False and tuning["replicasNeeded"] == state.replicas_needed
    tuning_condition = next(c for c in conditions(state, SLO) if c.type == "Tuning")
    assert tuning_condition.reason == "NoFeasibleKnobs" and tuning_condition.status == "True"
    assert [e for e in events.posted if e[1] == "NoFeasibleKnobs"][0][0] == "Warning"
    assert len([e for e in events.posted if e[1] == "NoFeasibleKnobs"]) == 1  # once, not every window
    assert metrics.registry.get_sample_value(FEASIBLE, {"namespace": "ns", "deployment": "heavy"}) == 0
    assert metrics.registry.get_sample_value(REPLICAS_NEEDED, {"namespace": "ns", "deployment": "heavy"}) == \
        state.replicas_needed
    assert events.written[-1]["tuning"].replicas_needed == state.replicas_needed


def _model_with_kv_spread(kv_se: float) -> StepModel:
    """A CPU-shaped fit whose terms are pinned down but for the KV term, which has standard error `kv_se`."""
    from chunkpilot.contract.step_cost import FEATURES

    c = {"overhead": 0.03, "prefill_tokens": 0.0008, "decode_seqs": 0.004, "kv_kilotokens": 0.0004,
         "tokens_over_512": 0.0, "tokens_over_2048": 0.0}
    se = {"overhead": 0.0005, "prefill_tokens": 1e-6, "decode_seqs": 1e-4, "kv_kilotokens": kv_se,
          "tokens_over_512": 1e-8, "tokens_over_2048": 1e-9}
    cov = tuple(tuple((se[a] ** 2 if a == b else 0.0) for b in FEATURES) for a in FEATURES)
    return StepModel(c, steps=2000, rms_error=0.002, mean_seconds=0.1, covariance=cov)


def test_the_separating_trial_is_the_safe_one_the_unidentified_term_weighs_on_most():
    """The KV term's interval is wide: at its low end the pick is one knob setting, at its high end another. The
    next trial is then the predicted-safe knobs whose full step the KV term weighs on most; with the KV term
    identified, nothing needs separating."""
    from chunkpilot.tuner.predictor import full_step_features

    slo = SLOTargets(ttft=LatencyTarget(0.99, 8.0), itl=LatencyTarget(0.99, 0.5))
    load = Load(request_rate=0.3, prompts=((256, 1.0),), running=4, mean_context=800)
    space = SearchSpace.from_bounds((32, 2048), (32, 2048))  # the tuner's default grid
    context = guide.Context(_model_with_kv_spread(0.001), load)
    safe = [c for c in guide.screen(context, space.all_knobs(), slo) if c.safe]
    assert len(safe) > 2
    knobs, terms = guide.separating(context, safe, slo)
    assert terms == ["kv_kilotokens"] and knobs in {c.knobs for c in safe}

    def kv_share(k):
        full = full_step_features(k, load)[-1]
        return full[3] / context.model.step_seconds(full)
    assert kv_share(knobs) == max(kv_share(c.knobs) for c in safe)
    assert knobs != safe[0].knobs  # not the predicted best: the measurement that tells them apart

    pinned = guide.Context(_model_with_kv_spread(1e-6), load)
    assert guide.separating(pinned, [c for c in guide.screen(pinned, space.all_knobs(), slo) if c.safe], slo) is None


def test_the_loop_measures_the_separating_knobs_before_the_predicted_best():
    """The tuner online, its window's fit leaving the KV term open in a case built for it: the first trial is the
    separating one (kind "identify"), not the predicted best."""
    loop, study, sim = _loop(0.5)
    built = guide.Context(_model_with_kv_spread(0.001), Load(request_rate=0.5, prompts=((256, 1.0),), running=3,
                                                             mean_context=800))
    loop.measurer.context = lambda seconds: built
    stressed = guide.stressed(built, loop.s.drift_load_shift)
    safe = [c for c in guide.screen(built, SPACE.all_knobs(), SLO, stress=loop.s.drift_load_shift) if c.safe]
    expected, terms = guide.separating(stressed, safe, SLO)
    assert terms == ["kv_kilotokens"] and expected != safe[0].knobs
    loop.iterate()
    first = study.records()[0]
    assert first.kind == TrialKind.IDENTIFY and first.knobs == expected
    # then the predicted best, as an epoch starts: the identification goes before it, not in its place (the
    # simulated load can drift from the built one and open a new epoch, which identifies once more first)
    for _ in range(2):
        loop.iterate()
    kinds = [t.kind for t in study.records()]
    assert "predicted" in kinds and kinds[:kinds.index("predicted")] == ["identify"] * kinds.index("predicted")


def test_measured_knobs_do_not_lock_out_those_safe_at_the_load_now():
    """Measured knobs are judged at the load they met, unmeasured ones with the tuner's load headroom. When that
    headroom leaves nothing unmeasured and the measured pick kept the SLOs, the least-pressure knobs predicted safe
    at the load now are tried next (the contention benchmark's miss: the tuner held its first pick for the hour)."""
    loop, study, sim = _loop(0.8, trials=6)
    loop.iterate()
    first = loop.state.history[-1].knobs
    assert [m.feasible for m in study.measured()] == [True]
    now = loop._context(loop.s.window)
    loop.measurer.context = lambda seconds: now  # the ask below sees this context, as the iteration would
    observations = loop._observations()
    stressed = [c.knobs for c in guide.screen(now, SPACE.all_knobs(), SLO, observations,
                                              stress=loop.s.drift_load_shift) if c.safe]
    at_load = [c.knobs for c in guide.screen(now, SPACE.all_knobs(), SLO, observations) if c.safe]
    assert set(stressed) <= {first} and set(at_load) - {first}  # the case: only the headroom keeps the rest out
    _, knobs = loop._ask(now)
    assert knobs != first and knobs == next(k for k in at_load if k != first)
    assert loop.state.predicted_safe == 2
