"""The tuner's loop and Optuna adapter against scripted windows: every online reality the issue lists."""

from __future__ import annotations

import pytest

from chunkpilot.tuner.history import TrialKind
from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner.interfaces import MeasurementUnavailable
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.measurement import (LATENCY_MARGIN, MAX_PREFILL_UTILIZATION, Window, constraints, feasible,
                                          load_shift, objective_value, slo_met, wide_breach)
from chunkpilot.tuner.state import TunerState, conditions, status_tuning
from chunkpilot.tuner.space import Knobs, SearchSpace, log_grid
from chunkpilot.tuner.study import TunerStudy

SLO = SLOTargets(ttft=LatencyTarget(0.99, 2.0), itl=LatencyTarget(0.99, 0.1))
SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)


def window(knobs: Knobs, rate: float = 2.0, requests: int = 100, seconds: float = 60.0) -> Window:
    """A made-up but plausible system: ITL grows with the budget, TTFT shrinks with it; best near 128."""
    itl = 0.02 + knobs.token_budget / 2000
    ttft = 0.5 + 64 / knobs.max_chunk
    served = rate * (1.0 if itl <= 0.1 and ttft <= 2.0 else 0.5)
    return Window(seconds=seconds, requests=requests, request_rate=rate, output_tokens_per_s=rate * 40,
                  goodput=served, ttft=ttft, itl=itl, mean_prompt_tokens=500, mean_output_tokens=40)


class Fake:
    """Actuator + measurer + publisher in one: the scripted system."""

    def __init__(self, start=Knobs(2048, 2048), *, fail=False, rate=2.0, requests=100, lag=0) -> None:
        self.knobs, self.generation, self.reported = start, 0, 0
        self.fail, self.rate, self.requests, self.lag = fail, rate, requests, lag
        self.applied_log: list[Knobs] = []
        self.waited = 0.0
        self.states = []

    def apply(self, knobs):
        self.knobs = knobs
        self.generation += 1
        self.applied_log.append(knobs)
        return self.generation

    def applied(self, generation):
        return self.lag >= 0 and self.generation >= generation and self.lag == 0

    def current(self):
        return self.knobs

    def check(self):
        if self.fail:
            raise MeasurementUnavailable("Prometheus at http://127.0.0.1:1 unreachable")

    def wait(self, seconds):
        self.waited += seconds

    def measure(self, seconds):
        if self.fail:
            raise MeasurementUnavailable("Prometheus at http://127.0.0.1:1 unreachable")
        return window(self.knobs, self.rate, self.requests, seconds)

    def publish(self, state):
        self.states.append((state.phase, state.healthy, state.reason))


def make(fake, storage=":memory:", **kw):
    settings = TunerSettings(**{"window": 60, "warmup": 5, "max_trials": 8, "min_requests": 20, **kw})
    study = TunerStudy(storage, "ns/demo", SPACE, SLO, settings.objective, seed=1)
    return TunerLoop(settings, SPACE, study, fake, fake, fake, SLO), study


def test_grid_is_log_spaced_step_multiples_inside_the_bounds():
    grid = log_grid(48, 4000, 16)
    assert grid[0] == 48 and grid[-1] == 4000 and all(v % 16 == 0 for v in grid[1:-1])
    ratios = [b / a for a, b in zip(grid, grid[1:])]
    assert max(ratios) < 1.35 and min(ratios) > 1.0  # 2^(1/4) apart, but for rounding to the step
    assert all(k.max_chunk <= k.token_budget for k in SPACE.all_knobs())
    assert SPACE.clamp(Knobs(10_000, 5)) == Knobs(2048, 32)


def test_window_judgements():
    ok = window(Knobs(128, 128))
    # TTFT, ITL (judged against LATENCY_MARGIN x the threshold), keeping up, prefill headroom (no capacity: unjudged)
    assert feasible(ok, SLO) and constraints(ok, SLO) == pytest.approx(
        [1.0 / (2 * LATENCY_MARGIN) - 1, 0.084 / (0.1 * LATENCY_MARGIN) - 1, -0.1, 0.0])
    bad = window(Knobs(2048, 2048))
    assert not feasible(bad, SLO) and wide_breach(bad, SLO, 2.0)
    assert objective_value(ok, "goodput") == pytest.approx(1.0)  # per offered request
    assert objective_value(ok, "throughput") == ok.output_tokens_per_s
    assert load_shift((2.0, 500, 40), (3.0, 500, 40)) == pytest.approx(0.5)
    no_data = Window(60, 0, 0.0, 0.0, 0.0)
    assert not feasible(no_data, SLO)
    falling_behind = Window(**{**ok.to_dict(), "backlog_growth": 0.5})  # a quarter of the arrivals queue up
    assert not feasible(falling_behind, SLO)


def test_goodput_is_the_share_of_served_requests_within_the_slo():
    w = window(Knobs(128, 128))  # every request within the SLOs, completions = arrivals
    draining = Window(**{**w.to_dict(), "requests": 150, "goodput": 2.5})  # 2.5/s done, 2/s arriving: a backlog drains
    assert objective_value(draining, "goodput") == pytest.approx(1.0)  # not 1.25: draining is not a merit
    behind = Window(**{**w.to_dict(), "requests": 60, "goodput": 1.0})  # 1/s done, 2/s arriving
    assert objective_value(behind, "goodput") == pytest.approx(0.5)


def test_the_tuner_keeps_a_margin_that_the_slo_status_does_not():
    near = Window(**{**window(Knobs(128, 128)).to_dict(), "itl": 0.095})  # inside 0.1 s, outside 0.9 x 0.1 s
    assert slo_met(near, SLO) and not feasible(near, SLO)
    assert not wide_breach(Window(**{**near.to_dict(), "itl": 0.19}), SLO, 2.0)  # the cut uses the SLO itself
    assert wide_breach(Window(**{**near.to_dict(), "itl": 0.21}), SLO, 2.0)
    state = TunerState(mode="auto", current_window=near)
    slo_cond = next(c for c in conditions(state, SLO) if c.type == "SLOMet")
    assert slo_cond.status == "True" and "ITL p99 0.095s (SLO 0.1s)" in slo_cond.message


def test_prefill_headroom_is_demand_against_capacity():
    w = window(Knobs(128, 128))  # 2 requests/s x 500 prompt tokens = 1000 prompt tokens/s arriving
    at = lambda capacity, demand=None: constraints(Window(**{**w.to_dict(), "prefill_capacity": capacity}), SLO,
                                                   demand)[-1]
    assert at(1000 / MAX_PREFILL_UTILIZATION) == pytest.approx(0.0)  # exactly the headroom
    assert at(1500) < 0 and at(1100) > 0  # utilization 0.67 fits, 0.91 does not
    assert at(1100, demand=600) < 0  # judged against the load it is given
    assert at(None) == 0.0  # engines without the metric: not judged
    assert at(0.0) == 1.0  # busy and nothing got through: violated


def test_capacity_is_judged_against_the_epochs_load_not_a_quiet_window():
    study = TunerStudy(":memory:", "ns/demo", SPACE, SLO, "goodput", seed=0)
    base = window(Knobs(128, 128))
    quiet = Window(**{**base.to_dict(), "request_rate": 0.5, "goodput": 0.5, "requests": 30, "prefill_capacity": 400})
    busy = Window(**{**base.to_dict(), "prefill_capacity": 2000, "goodput": 1.9})
    small, large = Knobs(32, 32), Knobs(128, 128)
    study.enqueue(small, TrialKind.PREDICTED)
    trial, knobs = study.ask()
    assert knobs == small
    study.tell(trial, quiet)  # 250 prompt tokens/s against 400: fine for that minute
    assert study.best().knobs == small and study.best().feasible
    for _ in range(2):
        study.enqueue(large, TrialKind.PREDICTED)
        trial, _ = study.ask()
        study.tell(trial, busy)  # the deployment's usual 1000 prompt tokens/s
    # the epoch's load is (250 + 1000 + 1000) / 3 = 750 tokens/s, far beyond 0.8 x 400: the small knobs are out
    assert study.reference_demand() == pytest.approx(750)
    by_knobs = {m.knobs: m for m in study.measured()}
    assert not by_knobs[small].feasible and by_knobs[large].feasible
    assert study.best().knobs == large


def test_status_judges_a_quiet_window_against_the_epochs_load():
    # The engines get 1000 prompt tokens/s through at any knobs. Three busy minutes bring 1000 tokens/s each (over
    # the 0.8 headroom), then a quiet one 250: on its own that minute looks fine; against the epoch's mean
    # (812.5 tokens/s, each window counted once) it is not.
    class Loaded(Fake):
        def measure(self, seconds):
            return Window(**{**super().measure(seconds).to_dict(), "prefill_capacity": 1000})

    fake = Loaded(start=Knobs(128, 128))
    loop, study = make(fake)
    for _ in range(3):
        # knobs within the latency SLOs: only the headroom is in question
        study.enqueue(Knobs(128, 128), TrialKind.PREDICTED)
        loop.iterate()
        assert loop.state.current_feasible is False and loop.state.history[-1].feasible is False
    fake.rate = 0.5
    study.enqueue(Knobs(128, 128), TrialKind.PREDICTED)
    loop.iterate()
    quiet = loop.state.current_window
    assert feasible(quiet, SLO)  # against its own demand
    assert study.reference_demand() == pytest.approx(812.5)
    assert loop.state.current_feasible is False and loop.state.history[-1].feasible is False
    assert status_tuning(loop.state, SLO, "goodput").current.feasible is False
    assert next(c for c in conditions(loop.state, SLO) if c.type == "SLOMet").status == "True"


def test_trials_told_by_an_older_tuner_are_scored_as_this_one_scores():
    # An upgrade resumes the study: an old trial stored goodput / arrivals (1.25 for a window that drained a
    # queue), three constraints and a window without prefill capacity. Its score is recomputed from the window.
    study = TunerStudy(":memory:", "ns/demo", SPACE, SLO, "goodput", seed=0)
    old = window(Knobs(128, 128)).to_dict()
    old.update(requests=150, goodput=2.5)
    del old["prefill_capacity"]
    study.enqueue(Knobs(128, 128), TrialKind.PREDICTED)
    trial, _ = study.ask()
    # written as an older tuner wrote them, not through this version's tell
    trial.set_user_attr("window", old)
    trial.set_user_attr("constraints", [-0.5, -0.16, -0.1])
    study.study.tell(trial, 1.25)
    study.enqueue(Knobs(64, 64), TrialKind.PREDICTED)
    trial, _ = study.ask()
    study.tell(trial, Window(**{**window(Knobs(64, 64)).to_dict(), "prefill_capacity": 5000}))
    by_knobs = {m.knobs: m for m in study.measured()}
    assert by_knobs[Knobs(128, 128)].objective == pytest.approx(1.0)  # shrunk towards the median of 1.0 and 1.0
    assert all(m.feasible for m in by_knobs.values())
    trial, _ = study.ask()  # constrained TPE accepts the mixed constraint lengths
    assert trial.number == 2


def test_it_finds_the_feasible_region_and_then_holds_it():
    fake = Fake()
    # black-box (the scripted system has no step-time model): Optuna alone, seeded, needs 10 trials to land in the
    # feasible corner of this grid
    loop, study = make(fake, max_trials=10)
    outcomes = [loop.iterate() for _ in range(14)]
    assert "exploit" in outcomes and loop.state.phase == "Exploiting"
    best = study.best()
    assert best.feasible and feasible(window(best.knobs), SLO)
    assert fake.knobs == best.knobs  # exploiting holds the best knobs
    assert all(SPACE.clamp(k) == k for k in fake.applied_log)  # never left the bounds


def test_wide_breach_cuts_the_trial_and_restores_the_best_at_once():
    fake = Fake(start=Knobs(128, 128))
    loop, study = make(fake)
    study.enqueue(Knobs(128, 128), TrialKind.PREDICTED)
    loop.iterate()  # the good knobs: becomes the best
    study.enqueue(Knobs(2048, 2048), TrialKind.PREDICTED)
    assert loop.iterate() == "cut"
    assert fake.applied_log[-2:] == [Knobs(2048, 2048), Knobs(128, 128)]
    assert study.records()[-1].cut_short is True


def test_a_slow_rollout_of_the_restored_knobs_after_a_cut_does_not_crash_the_loop():
    # The cut trial is told first; the pods then never confirm the restore. Failing the finished trial raised
    # Optuna's UpdateFinishedTrialError and took the daemon down (found in review).
    class SlowRestore(Fake):
        hang = False

        def applied(self, generation):
            return not (self.hang and self.knobs == Knobs(128, 128)) and super().applied(generation)

    fake = SlowRestore(start=Knobs(128, 128))
    loop, study = make(fake, apply_timeout=3, poll=1)
    study.enqueue(Knobs(128, 128), TrialKind.PREDICTED)
    loop.iterate()  # the good knobs: becomes the best
    fake.hang = True
    study.enqueue(Knobs(2048, 2048), TrialKind.PREDICTED)
    assert loop.iterate() == "cut"
    assert "restoring the best knobs" in loop.state.reason and "did not report" in loop.state.reason
    assert study.records()[-1].cut_short is True


def test_a_thin_window_is_not_a_trial():
    fake = Fake(requests=5)
    loop, study = make(fake)
    study.enqueue(Knobs(128, 128), TrialKind.PREDICTED)  # knobs within the SLOs: the probe does not cut them short
    assert loop.iterate() == "thin"
    assert study.completed() == [] and study.study.trials[-1].state.name == "FAIL"


def test_prometheus_down_holds_the_knobs_and_backs_off_without_recording():
    fake = Fake(fail=True, start=Knobs(256, 128))
    loop, study = make(fake)
    waits = []
    for _ in range(3):
        before = fake.waited
        assert loop.iterate() == "hold"
        waits.append(fake.waited - before)
    assert loop.state.phase == "Holding" and not loop.state.healthy
    assert "unreachable" in loop.state.reason
    assert study.completed() == [] and study.study.trials == []  # no trial from missing data
    assert fake.applied_log == [] and fake.knobs == Knobs(256, 128)  # the knobs stay
    assert waits == [2.0, 4.0, 8.0]  # exponential backoff
    fake.fail = False
    loop.iterate()
    assert loop.state.healthy


def test_pods_that_never_report_the_generation_fail_the_trial():
    fake = Fake(lag=1)
    loop, study = make(fake, apply_timeout=3, poll=1)
    assert loop.iterate() == "timeout"
    assert study.completed() == [] and "did not report" in loop.state.reason


def test_load_shift_after_exploring_opens_a_new_epoch_seeded_with_the_incumbent():
    fake = Fake()
    loop, study = make(fake, max_trials=6)
    while loop.state.phase != "Exploiting":
        loop.iterate()
    incumbent = study.best().knobs
    fake.rate = 5.0  # 2.5x the load the best knobs were measured under
    assert loop.iterate() == "reopen"
    assert study.epoch == 1 and loop.iterate() == "trial"
    assert fake.knobs == incumbent  # the new epoch starts by re-measuring the incumbent
    assert study.records()[0].kind == TrialKind.INCUMBENT


def test_advisory_mode_changes_nothing_and_recommends():
    fake = Fake(start=Knobs(128, 64))
    loop, study = make(fake, mode="advisory")
    for _ in range(3):
        assert loop.iterate() == "advise"
    assert fake.applied_log == [] and loop.state.phase == "Advisory"
    assert loop.state.recommendation == Knobs(128, 64)


@pytest.fixture(params=["sqlite", "postgresql"])
def study_url(request, tmp_path):
    """The study's storage: a SQLite file (the chart's default, on a PVC) or a real PostgreSQL server (the
    chart's tuner.study.existingSecret), through the driver the tuner extra ships."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'study.db'}"
    return request.getfixturevalue("postgres").database()


def test_restart_resumes_the_study_and_closes_the_interrupted_trial(study_url):
    url = study_url
    fake = Fake()
    loop, study = make(fake, storage=url)
    for _ in range(4):
        loop.iterate()
    done = len(study.completed())
    study.ask()  # the tuner dies mid-window: a RUNNING trial is left behind
    loop2, study2 = make(fake, storage=url)
    assert study2.closed_stale == 1 and len(study2.completed()) == done  # nothing lost, nothing counted twice
    assert "interrupted" in loop2.state.reason
    loop2.iterate()
    assert len(study2.completed()) == done + 1 and study2.study.trials[-2].state.name == "FAIL"


def test_trial_count_spans_epochs_and_survives_a_restart(study_url):
    url = study_url
    fake = Fake()
    loop, study = make(fake, storage=url, max_trials=4)
    while loop.state.phase != "Exploiting":
        loop.iterate()
    first = len(study.completed())
    fake.rate = 5.0
    assert loop.iterate() == "reopen"
    loop.iterate()
    total = first + len(study.completed())
    assert study.epoch == 1 and study.total_completed() == total == loop.state.trial
    _, reopened = make(fake, storage=url, max_trials=4)
    assert reopened.epoch == 1 and reopened.total_completed() == total


def test_one_lucky_window_is_not_a_feasible_setting_where_most_windows_breach():
    """Under noisy steps, where the typical window breaches, a setting measured once within the SLOs stays
    infeasible until a second window agrees; where the typical window keeps the SLOs, one window is enough."""
    study = TunerStudy(":memory:", "ns/demo", SPACE, SLO, "goodput", seed=0)
    base = window(Knobs(128, 128))
    breach = Window(**{**base.to_dict(), "itl": 0.12, "goodput": 1.9})  # over the 0.1-s ITL SLO
    lucky = Window(**{**base.to_dict(), "itl": 0.085, "goodput": 1.5})

    def tell(knobs, w):
        study.enqueue(knobs, TrialKind.PREDICTED)
        trial, _ = study.ask()
        study.tell(trial, w)
    for _ in range(3):
        tell(Knobs(64, 64), breach)
    tell(Knobs(96, 64), lucky)
    by_knobs = {m.knobs: m for m in study.measured()}
    assert not by_knobs[Knobs(96, 64)].feasible  # one window against a typical breach
    tell(Knobs(96, 64), lucky)
    by_knobs = {m.knobs: m for m in study.measured()}
    assert by_knobs[Knobs(96, 64)].feasible and study.best().knobs == Knobs(96, 64)

    calm = TunerStudy(":memory:", "ns/demo", SPACE, SLO, "goodput", seed=0)
    calm.enqueue(Knobs(96, 64), TrialKind.PREDICTED)
    trial, _ = calm.ask()
    calm.tell(trial, lucky)
    assert calm.best().feasible  # nothing typical to doubt it against


def test_with_nothing_feasible_the_users_slos_rank_before_the_prefill_headroom():
    """Nothing meets every constraint (an overloaded deployment): the settings closest to the user's SLOs (latency,
    keeping up) are the candidates, and the prefill headroom - a proxy for what a longer run would show - only
    orders those alike. Before, a setting within its latency SLO but at 0.9 prefill utilization lost to one over
    its ITL SLO by 16 %: under contention noise the tuner settled on 96/64 (0.58 of the grid best) over 64/32
    (the grid best) in one scenario."""
    study = TunerStudy(":memory:", "ns/demo", SPACE, SLO, "goodput", seed=0)
    base = window(Knobs(128, 128))  # 1000 prompt tokens/s arriving
    busy = Window(**{**base.to_dict(), "itl": 0.08, "goodput": 1.6, "prefill_capacity": 1000.0})  # headroom +0.25
    slow = Window(**{**base.to_dict(), "itl": 0.1044, "goodput": 1.9, "prefill_capacity": 2000.0})  # ITL +0.16
    for knobs, w in ((Knobs(64, 64), busy), (Knobs(96, 64), slow)) * 2:
        study.enqueue(knobs, TrialKind.PREDICTED)
        trial, _ = study.ask()
        study.tell(trial, w)
    by_knobs = {m.knobs: m for m in study.measured()}
    assert not any(m.feasible for m in by_knobs.values())
    assert by_knobs[Knobs(64, 64)].violation == pytest.approx(0.25)
    assert by_knobs[Knobs(96, 64)].violation == pytest.approx(0.16, abs=1e-3)
    assert study.best().knobs == Knobs(64, 64)
    assert by_knobs[Knobs(64, 64)].slo_violation < 0


class Killed(BaseException):
    """The process dying mid-window (not an error the loop handles)."""


def test_a_tuner_killed_mid_trial_resumes_with_the_same_memory_and_the_same_next_decision(tmp_path):
    """The trials were always in the study; now the loop's other memory is too (the windows measured next to
    predicted, which calibrate its predictions), and a trial left running is measured again rather than replaced
    by a new ask: the restarted tuner's next decision is the one the uninterrupted tuner made."""
    twin = Fake()
    twin_loop, twin_study = make(twin, storage=f"sqlite:///{tmp_path / 'twin.db'}")
    memories, twin_outcomes = [], []  # the twin's policy.Memory before each iteration, and what it did
    for _ in range(7):  # as many as the killed tuner's 3 whole iterations and the restarted one's 4
        memories.append(twin_loop.memory())
        twin_outcomes.append(twin_loop.iterate())

    calls = {"n": 0}
    first = Fake()
    measure = first.measure

    def dies_on_the_fifth_measure(seconds):  # a probe per trial, a window for those not cut: dies in the fourth
        calls["n"] += 1
        if calls["n"] == 5:
            raise Killed()
        return measure(seconds)
    first.measure = dies_on_the_fifth_measure
    url = f"sqlite:///{tmp_path / 'study.db'}"
    loop, study = make(first, storage=url)
    with pytest.raises(Killed):
        for _ in range(6):
            loop.iterate()
    killed_at = first.applied_log[-1]
    before = list(loop.state.history)

    again = Fake(start=first.knobs)  # the pods keep the knobs they ran; a new tuner process starts
    loop2, study2 = make(again, storage=url)
    assert study2.closed_stale == 1
    assert [(h.kind, h.knobs) for h in loop2.state.history] == [(h.kind, h.knobs) for h in before]
    assert loop2.memory() == memories[3]  # what the fourth decision depends on, rebuilt from the study
    assert loop2.iterate() == twin_outcomes[3]
    # it measures the killed trial's knobs (already running: nothing to apply), the decision the twin made there
    assert again.applied_log in ([], [killed_at])
    assert loop2.state.history[-1].knobs.token_budget == killed_at.token_budget
    assert killed_at == twin.applied_log[len(first.applied_log) - 1]
    # and every decision after it is the twin's: the sampler's draws come from the stored trials, not from a random
    # state that died with the process
    for _ in range(3):
        loop2.iterate()
    resumed = first.applied_log + again.applied_log
    n = min(len(resumed), len(twin.applied_log))
    assert n >= len(first.applied_log) + 3 and resumed[:n] == twin.applied_log[:n]
    # the killed trial counted once (measured again, the stale one closed as failed): the same trials as the twin's
    def told(study):
        return [t.knobs for t in study.records()]
    assert told(study2) == told(twin_study)


def test_after_a_failed_trial_the_next_ask_is_a_new_draw():
    """The per-ask seed counts failed trials too (but not one a killed tuner left running): a thin window or an
    acknowledgement timeout is followed by another draw, not the same knobs asked again forever."""
    fake = Fake(requests=2)  # every window thin (and too thin for the probe to cut)
    loop, study = make(fake)
    assert [loop.iterate() for _ in range(3)] == ["thin"] * 3
    asked = [t.knobs for t in study.records(None)]
    assert len(set(asked)) == 3, asked
