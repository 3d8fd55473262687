"""The tuner's choice of the next trial as a pure function: memory and observation in, a Choice out; no study, no
Optuna, no loop."""

from __future__ import annotations

from chunkpilot.contract.step_cost import FEATURES
from chunkpilot.tuner import guide
from chunkpilot.tuner.choice import Choice, Memory, Observation, choose
from chunkpilot.tuner.history import TrialKind
from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner.predictor import Load
from chunkpilot.tuner.space import SearchSpace
from chunkpilot.tuner.step_model import StepModel
from chunkpilot.tuner.study import Measured

SLO = SLOTargets(ttft=LatencyTarget(0.99, 8.0), itl=LatencyTarget(0.99, 0.5))
GRID = tuple(SearchSpace.from_bounds((32, 2048), (32, 2048)).all_knobs())
LOAD = Load(request_rate=0.3, prompts=((256, 1.0),), running=4, mean_context=800)
DRIFT = 0.5


def context(kv_se: float) -> guide.Context:
    """A CPU-shaped fit whose terms are pinned down but for the KV term, with standard error `kv_se` (wide: the
    pick among the safe knobs turns on it)."""
    c = {"overhead": 0.03, "prefill_tokens": 0.0008, "decode_seqs": 0.004, "kv_kilotokens": 0.0004,
         "tokens_over_512": 0.0, "tokens_over_2048": 0.0}
    se = {"overhead": 0.0005, "prefill_tokens": 1e-6, "decode_seqs": 1e-4, "kv_kilotokens": kv_se,
          "tokens_over_512": 1e-8, "tokens_over_2048": 1e-9}
    cov = tuple(tuple((se[a] ** 2 if a == b else 0.0) for b in FEATURES) for a in FEATURES)
    return guide.Context(StepModel(c, steps=2000, rms_error=0.002, mean_seconds=0.1, covariance=cov), LOAD)


PINNED, OPEN = context(1e-6), context(0.001)


def memory(**given) -> Memory:
    return Memory(**{"guided": True, "epoch": 0, "grid": GRID, "slo": SLO, "drift_load_shift": DRIFT,
                     "max_trials": 10, **given})


def safe(ctx: guide.Context, slo: SLOTargets = SLO) -> list[guide.Judged]:
    return [c for c in guide.screen(ctx, list(GRID), slo, stress=DRIFT) if c.safe]


def test_without_a_model_optunas_ask_is_taken_as_it_comes():
    assert choose(memory(guided=False), Observation(PINNED)) == Choice()
    assert choose(memory(), Observation(None)) == Choice()  # too few steps to fit


def test_an_epochs_first_trial_is_the_predicted_best():
    made = choose(memory(), Observation(PINNED))
    best = safe(PINNED)[0]
    assert (made.queue, made.kind) == (best.knobs, TrialKind.PREDICTED)
    assert made.load_moved is None and made.judgement.feasible and made.judgement.allowed == len(safe(PINNED))
    assert made.screen.allowed == {c.knobs for c in safe(PINNED)} and made.screen.fallback == best.knobs


def test_knobs_the_unidentified_term_separates_are_measured_first():
    expected, terms = guide.separating(guide.stressed(OPEN, DRIFT), safe(OPEN), SLO)
    assert terms == ["kv_kilotokens"] and expected != safe(OPEN)[0].knobs
    made = choose(memory(), Observation(OPEN))
    assert (made.queue, made.kind) == (expected, TrialKind.IDENTIFY)
    # once identified, the predicted best follows
    after = choose(memory(completed_kinds=(TrialKind.IDENTIFY,)), Observation(PINNED))
    assert (after.queue, after.kind) == (safe(PINNED)[0].knobs, TrialKind.PREDICTED)


def test_a_queued_incumbent_is_asked_unscreened_and_nothing_else_is_queued():
    """The loop queues the incumbent's re-measurement before it asks: the choice queues nothing on top, and takes
    the incumbent even where it is no longer predicted safe, while Optuna's own asks outside the set are
    rejected with their predicted constraints."""
    unsafe = next(k for k in GRID if k not in {c.knobs for c in safe(PINNED)})
    made = choose(memory(waiting=1, completed_kinds=(TrialKind.PREDICTED, None), explored=2), Observation(PINNED))
    assert made.queue is None and made.kind is None
    assert made.screen.takes(unsafe, TrialKind.INCUMBENT) and not made.screen.takes(unsafe, None)
    constraints, why = made.screen.rejection(unsafe)
    assert max(constraints) > 0 and why.startswith("predicted pressure")
    assert made.screen.takes(safe(PINNED)[0].knobs, None)


def test_measured_knobs_count_by_their_measurement_at_about_this_load():
    best = safe(PINNED)[0].knobs
    window = {"request_rate": LOAD.request_rate, "mean_prompt_tokens": 256.0, "pods": 1}
    breached = Measured(best, 0.5, False, window)
    made = choose(memory(measured=(breached,), trial_windows=(window,), completed_kinds=(TrialKind.PREDICTED,),
                         explored=1), Observation(PINNED))
    assert best not in made.screen.allowed and made.queue is None  # not the first trial: Optuna draws
    assert made.screen.rejection(best)[1] == "measured infeasible"
    # measured at another load, the prediction decides again
    busy = {**window, "request_rate": 3 * LOAD.request_rate}
    elsewhere = choose(memory(measured=(Measured(best, 0.5, False, busy),), completed_kinds=(TrialKind.PREDICTED,),
                              explored=1), Observation(PINNED))
    assert best in elsewhere.screen.allowed


def test_a_moved_load_opens_a_new_epoch_that_starts_from_the_predicted_best():
    before = {"request_rate": 3 * LOAD.request_rate, "mean_prompt_tokens": 256.0, "pods": 1}
    made = choose(memory(trial_windows=(before,), completed_kinds=(TrialKind.PREDICTED,), explored=1, waiting=1),
                  Observation(PINNED))
    assert made.load_moved == 2 / 3
    assert (made.queue, made.kind) == (safe(PINNED)[0].knobs, TrialKind.PREDICTED)  # the old epoch forgotten


def test_nothing_predicted_safe_queues_the_closest_knobs_and_says_why():
    tight = SLOTargets(ttft=LatencyTarget(0.99, 0.01), itl=LatencyTarget(0.99, 0.001))
    made = choose(memory(slo=tight), Observation(PINNED))
    assert made.kind == TrialKind.CLOSEST and made.screen is None
    assert made.queue == guide.closest(guide.screen(PINNED, list(GRID), tight), tight)
    assert made.judgement.feasible is False and made.judgement.allowed == 0
    assert made.judgement.reason.startswith("no knobs in bounds are predicted to keep the SLOs")
    assert f"the closest, {made.queue.token_budget}/{made.queue.max_chunk}" in made.judgement.reason
