"""The decode pods' disaggregation threshold as a tuned knob (issue 53, item 5): searched only with
spec.disaggregation.mode auto and tuning.mode auto, "never" (colocated) measured first and kept unless a split
measures better under the same SLO rules; every other resource tunes exactly as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chunkpilot.api.types import SchedulerStatus
from chunkpilot.contract.knobs import DISAGG_NEVER, SchedulerKnobs, dumps_knobs, parse_knobs, threshold_text
from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner import reasons
from chunkpilot.tuner.choice import Memory, Observation, choose
from chunkpilot.tuner.daemon import ClusterConfig, measurement_selector, tuning_config
from chunkpilot.tuner.history import HistoryEntry, TrialKind, WindowKind
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.measurement import Window
from chunkpilot.tuner.space import DEFAULT_THRESHOLD_MAX, Knobs, SearchSpace, threshold_grid
from chunkpilot.tuner.state import TunerState, status_tuning
from chunkpilot.tuner.study import TunerStudy

from .test_choice import GRID, PINNED, safe
from .test_choice import SLO as CHOICE_SLO
from .test_tuner_core import SLO, SPACE, Fake, make, window

SPLIT_SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2, threshold=(16, 4096))
PROMPT = 500  # the scripted system's mean prompt (test_tuner_core.window): thresholds below it send prompts away


# ---- the contract and the space ------------------------------------------------------------------------------
def test_never_is_one_integer_the_engine_already_takes_and_people_read_as_never():
    # the engine sends a prompt away when its uncached tokens are > the threshold; no admitted prompt is longer
    assert DISAGG_NEVER == 1_048_576
    knobs = SchedulerKnobs(128, 64, 3, DISAGG_NEVER)
    assert parse_knobs(dumps_knobs(knobs)) == knobs.validated()
    assert (threshold_text(DISAGG_NEVER), threshold_text(512), threshold_text(None)) == ("never", "512", "start-up")
    assert Knobs(128, 64, DISAGG_NEVER).colocated and Knobs(128, 64).colocated and not Knobs(128, 64, 512).colocated
    # without a threshold the knobs are the two numbers as before: equal, hashed and written alike
    assert Knobs(128, 64) == Knobs(128, 64, None) and SchedulerKnobs.of(Knobs(128, 64), 2) == SchedulerKnobs(128, 64, 2)
    assert dumps_knobs(SchedulerKnobs.of(Knobs(128, 64), 2)) == '{"generation": 2, "max_chunk": 64, "token_budget": 128}'
    assert SchedulerKnobs.of(Knobs(128, 64, 256), 2).knobs == Knobs(128, 64, 256)
    assert reasons.holding(Knobs(128, 64)) == "holding the best knobs 128/64"
    assert reasons.holding(Knobs(128, 64, DISAGG_NEVER)).endswith("128/64 with disaggregation threshold never")


def test_the_threshold_grid_is_powers_of_two_from_a_block_to_the_longest_prompt_then_never():
    assert threshold_grid(16, 4096) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, DISAGG_NEVER)
    assert threshold_grid(16, 3000) == (16, 32, 64, 128, 256, 512, 1024, 2048, 3000, DISAGG_NEVER)  # hi kept
    assert threshold_grid(16, 16) == (16, DISAGG_NEVER)
    with pytest.raises(ValueError):
        threshold_grid(0, 16)
    space = SPLIT_SPACE
    assert space.thresholds[-1] == DISAGG_NEVER and len(space.all_knobs()) == len(space.pairs()) * 10
    assert {k.disagg_threshold for k in space.pairs()} == {None}
    # known knobs map to the nearest grid point; knobs without a threshold (the start-up ones) to never
    assert space.params(Knobs(128, 64, 300)) == {**SPACE.params(Knobs(128, 64)), "threshold_index": 4}
    assert space.params(Knobs(128, 64))["threshold_index"] == 9
    assert space.colocated(Knobs(128, 64, 256)) == Knobs(128, 64, DISAGG_NEVER)
    assert space.clamp(Knobs(10_000, 5, 3)) == Knobs(2048, 32, 16)
    assert space.clamp(Knobs(128, 64, DISAGG_NEVER)) == Knobs(128, 64, DISAGG_NEVER)
    # without a searched threshold, nothing of it anywhere
    assert "threshold_index" not in SPACE.params(Knobs(128, 64, 256))
    assert SPACE.clamp(Knobs(128, 64, 256)) == Knobs(128, 64) and SPACE.colocated(Knobs(128, 64)) == Knobs(128, 64)
    assert SPACE.all_knobs() == SPACE.pairs()


# ---- the loop: colocated first, a split kept only where it measures better -----------------------------------
def split_window(knobs: Knobs, pays: str, rate: float = 2.0, seconds: float = 60.0, prompt: int = PROMPT,
                 slo: SLOTargets = SLO) -> Window:
    """The scripted system with remote prefill: prompts above the threshold go to a prefill pod. `pays`:
    "pays": colocated, the prompts' chunks stall the decodes (ITL 0.15 s > the 0.1-s SLO at any knobs), with the
    split the decode pods only decode (ITL 0.04 s) and TTFT grows by the remote prefill and transfer (1.2 s);
    "costs": colocated keeps both SLOs, the split's TTFT (2.5 s) breaches the 2-s SLO;
    "ties": both keep both SLOs, the split with a longer TTFT: equal goodput."""
    remote = not knobs.colocated and knobs.disagg_threshold < prompt
    if pays == "pays":
        itl, ttft = (0.04, 1.2) if remote else (0.15, 0.5)
    else:
        itl, ttft = (0.04, 2.5 if pays == "costs" else 1.5) if remote else (0.04, 0.5)
    served = rate * (1.0 if itl <= slo.itl.threshold and ttft <= slo.ttft.threshold else 0.5)
    return Window(seconds=seconds, requests=100, request_rate=rate, output_tokens_per_s=rate * 40, goodput=served,
                  ttft=ttft, itl=itl, mean_prompt_tokens=prompt, mean_output_tokens=40)


class SplitFake(Fake):
    prompt, slo = PROMPT, SLO

    def __init__(self, pays: str, **kw) -> None:
        super().__init__(**kw)
        self.pays = pays

    def measure(self, seconds):
        return split_window(self.knobs, self.pays, self.rate, seconds, self.prompt, self.slo)


def make_split(fake, storage=":memory:", slo=SLO, **kw):
    settings = TunerSettings(**{"window": 60, "warmup": 5, "max_trials": 8, "min_requests": 20, **kw})
    study = TunerStudy(storage, "ns/split", SPLIT_SPACE, slo, settings.objective, seed=1)
    return TunerLoop(settings, SPLIT_SPACE, study, fake, fake, fake, slo), study


def run_until_exploiting(loop, limit: int = 30) -> None:
    for _ in range(limit):
        if loop.iterate() == "exploit":
            return
    raise AssertionError(f"not exploiting after {limit} iterations: {loop.state.reason}")


def test_where_the_split_pays_the_tuner_keeps_a_finite_threshold():
    fake = SplitFake("pays", start=Knobs(128, 128))
    loop, study = make_split(fake)
    run_until_exploiting(loop)
    # the colocated reference was measured first, at the running budget and chunk
    assert fake.applied_log[0] == Knobs(128, 128, DISAGG_NEVER)
    assert study.records()[0].kind == TrialKind.COLOCATED
    best = study.best()
    assert best.feasible and not best.knobs.colocated and best.knobs.disagg_threshold < PROMPT
    assert fake.knobs == best.knobs  # exploiting holds the split
    # what status and people see
    state = TunerState(mode="auto", best=best, current=best.knobs)
    assert status_tuning(state, SLO, "goodput").best.disagg_threshold == best.knobs.disagg_threshold
    assert f"threshold {best.knobs.disagg_threshold}" in loop.state.reason


@pytest.mark.parametrize("pays", ["costs", "ties"])
def test_where_the_split_does_not_pay_the_tuner_ends_on_never(pays):
    fake = SplitFake(pays, start=Knobs(128, 128))
    loop, study = make_split(fake)
    run_until_exploiting(loop)
    assert fake.applied_log[0] == Knobs(128, 128, DISAGG_NEVER)
    # splits were tried (else this would prove nothing), and lost or only tied
    assert any(not r.knobs.colocated and r.knobs.disagg_threshold < PROMPT for r in study.records())
    best = study.best()
    assert best.feasible and best.knobs.disagg_threshold == DISAGG_NEVER
    assert fake.knobs.disagg_threshold == DISAGG_NEVER
    assert loop.state.reason.endswith("with disaggregation threshold never")


def test_a_split_that_only_ties_colocated_is_not_kept():
    """Goodput is a share: every setting within the SLOs scores 1. Among equals the point that keeps more prefill
    on the decode pods wins (no transfers to pay for), before the smaller budget that decides otherwise."""
    study = TunerStudy(":memory:", "ns/split", SPLIT_SPACE, SLO, "goodput", seed=0)
    same = window(Knobs(128, 128))
    for knobs in (Knobs(128, 128, DISAGG_NEVER), Knobs(64, 64, 256), Knobs(64, 64, 1024)):
        study.enqueue(knobs, TrialKind.PREDICTED)
        trial, asked = study.ask()
        assert asked == knobs
        study.tell(trial, same)
    assert {m.objective for m in study.measured()} == {1.0}
    assert study.best().knobs == Knobs(128, 128, DISAGG_NEVER)
    # where colocated serves only part of the requests within the SLOs, the split that serves them all is kept
    study = TunerStudy(":memory:", "ns/split", SPLIT_SPACE, SLO, "goodput", seed=0)
    for knobs, goodput in ((Knobs(128, 128, DISAGG_NEVER), 1.5), (Knobs(64, 64, 256), 2.0)):
        study.enqueue(knobs, TrialKind.PREDICTED)
        trial, _ = study.ask()
        study.tell(trial, Window(**{**same.to_dict(), "goodput": goodput}))
    assert study.best().knobs == Knobs(64, 64, 256)


def test_each_new_epoch_measures_colocated_first_again():
    fake = SplitFake("pays", start=Knobs(128, 128))
    loop, study = make_split(fake, max_trials=4)
    run_until_exploiting(loop)
    fake.rate = 5.0  # the load moved: a new epoch
    assert loop.iterate() == "reopen" and study.epoch == 1
    loop.iterate()
    loop.iterate()
    kinds = [r.kind for r in study.records()]
    assert TrialKind.COLOCATED in kinds
    colocated = next(r for r in study.records() if r.kind == TrialKind.COLOCATED)
    assert colocated.knobs.colocated


def test_the_threshold_is_stored_with_the_trial_and_the_window_and_comes_back_after_a_restart(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    fake = SplitFake("pays", start=Knobs(128, 128))
    loop, study = make_split(fake, storage=url)
    for _ in range(4):
        loop.iterate()
    thresholds = [r.knobs.disagg_threshold for r in study.records()]
    assert all(t is not None for t in thresholds)
    _, again = make_split(fake, storage=url)
    assert [r.knobs.disagg_threshold for r in again.records()] == thresholds
    assert [h.knobs for h in again.memory()] == [h.knobs for h in loop.state.history]
    entry = HistoryEntry(0, WindowKind.COMPLETE, Knobs(128, 64, 256), True, window(Knobs(128, 64)))
    assert entry.to_dict()["disagg_threshold"] == 256 and HistoryEntry.from_dict(entry.to_dict()) == entry
    plain = HistoryEntry(0, WindowKind.COMPLETE, Knobs(128, 64), True, window(Knobs(128, 64)))
    assert "disagg_threshold" not in plain.to_dict()


def test_without_a_searched_threshold_the_trials_are_exactly_todays():
    """The same Optuna parameters, the same seeded draws, the same stored attributes: a resource without
    disaggregation auto tunes as before. Pinned: the knobs this seed's first trials tried before the threshold
    existed (commit 3606d65), which any change to the ask or the sampler's parameters would move."""
    fake = Fake()
    loop, study = make(fake)
    for _ in range(6):
        loop.iterate()
    assert [(k.token_budget, k.max_chunk) for k in fake.applied_log] == TODAYS_FIRST_TRIALS
    assert all(k.disagg_threshold is None for k in fake.applied_log)
    for t in study.study.trials:
        assert set(t.params) == {"budget_index", "chunk_index"}
        assert "disagg_threshold" not in t.user_attrs
    assert all(r.kind != TrialKind.COLOCATED for r in study.records(None))


# what make(Fake()) applied in its first six iterations at 3606d65, before the threshold existed (trials and the
# restores after the cut ones)
TODAYS_FIRST_TRIALS = [(2048, 368), (128, 96), (512, 512), (128, 96), (32, 32), (1456, 512), (128, 96), (720, 32),
                       (128, 96)]


# ---- the guide: it judges budget and chunk, the threshold is Optuna's ------------------------------------------
def test_the_guide_screens_colocated_asks_and_takes_a_split_as_it_comes():
    unsafe = next(k for k in GRID if k not in {c.knobs for c in safe(PINNED)})
    memory = Memory(guided=True, epoch=0, grid=GRID, slo=SLOTargets(ttft=LatencyTarget(0.99, 8.0),
                                                                      itl=LatencyTarget(0.99, 0.5)),
                    drift_load_shift=0.5, max_trials=10, waiting=1, completed_kinds=(TrialKind.COLOCATED,))
    made = choose(memory, Observation(PINNED))
    colocated = Knobs(unsafe.token_budget, unsafe.max_chunk, DISAGG_NEVER)
    split = Knobs(unsafe.token_budget, unsafe.max_chunk, 256)
    assert not made.screen.takes(colocated, None)  # predicted unsafe as a colocated pod: rejected as today
    assert max(made.screen.rejection(colocated)[0]) > 0
    assert made.screen.takes(split, None)  # the model knows no remote prefill: measured, not predicted
    good = safe(PINNED)[0].knobs
    assert made.screen.takes(Knobs(good.token_budget, good.max_chunk, DISAGG_NEVER), None)
    # after the colocated reference, the epoch's next trial is still the predicted best
    first = choose(Memory(guided=True, epoch=0, grid=GRID, slo=memory.slo, drift_load_shift=0.5, max_trials=10,
                          completed_kinds=(TrialKind.COLOCATED,)), Observation(PINNED))
    assert (first.queue, first.kind) == (good, TrialKind.PREDICTED)


class GuidedSplitFake(SplitFake):
    """The scripted split system with a step-time model to screen by (test_choice's pinned CPU fit), its windows
    at that fit's load (0.3 requests/s of 256-token prompts), so that no window reads as a moved load."""

    prompt, slo = 256, CHOICE_SLO

    def context(self, seconds):
        return PINNED


def test_guided_the_choices_picks_run_at_the_best_threshold_and_only_colocated_windows_calibrate():
    fake = GuidedSplitFake("pays", start=Knobs(128, 128), rate=0.3)
    loop, study = make_split(fake, slo=CHOICE_SLO, max_trials=6)
    for _ in range(8):
        loop.iterate()
    records = study.records()
    assert records[0].kind == TrialKind.COLOCATED and records[0].knobs.colocated
    # the predicted best came right after the colocated reference, run colocated (no split had measured better)
    assert records[1].kind == TrialKind.PREDICTED and records[1].knobs.disagg_threshold == DISAGG_NEVER
    assert all(r.knobs.disagg_threshold is not None for r in records)
    observations = loop._observations()
    assert observations and all(o.knobs.disagg_threshold is None for o in observations)
    assert len(observations) == sum(1 for h in loop.state.history
                                    if h.knobs.disagg_threshold == DISAGG_NEVER and h.forecast)
    # a window at the start-up knobs (the guided baseline) ran at the spec's threshold, a split: it calibrates nothing
    h = loop.state.history[0]
    loop.state.history.append(HistoryEntry(h.epoch, WindowKind.BASELINE, Knobs(128, 128), True, h.window, h.forecast))
    assert len(loop._observations()) == len(observations)
    memory = loop._choice_memory()
    assert set(memory.grid) == set(SPLIT_SPACE.pairs())
    assert all(m.knobs.disagg_threshold is None for m in memory.measured)


# ---- cluster mode: which resources search it, and what is measured ----------------------------------------------
SPEC = {"model": {"source": "hostpath:///models/smollm2"}, "engine": {"resources": {"gpus": 0}},
        "slo": {"itl": {"thresholdSeconds": 0.2}}, "tuning": {"mode": "auto"}}
CLUSTER = ClusterConfig(prometheus_url="http://prometheus:9090", storage=":memory:")


def test_only_disaggregation_auto_with_tuning_auto_searches_the_threshold():
    plain = tuning_config("ml", "llm", SPEC, CLUSTER)
    assert plain.threshold_bounds is None and plain.space().thresholds == ()
    assert plain.selector == 'namespace="ml",service="llm"'
    on = tuning_config("ml", "llm", {**SPEC, "disaggregation": {"mode": "on"}}, CLUSTER)
    assert on.threshold_bounds is None and on.deployment == plain.deployment  # the same study as before
    auto = tuning_config("ml", "llm", {**SPEC, "disaggregation": {"mode": "auto"}}, CLUSTER)
    assert auto.threshold_bounds == (16, DEFAULT_THRESHOLD_MAX) and auto.space().thresholds[-1] == DISAGG_NEVER
    assert auto.deployment != plain.deployment  # another space: another study
    long = tuning_config("ml", "llm", {**SPEC, "model": {**SPEC["model"], "maxModelLen": 4096},
                                       "disaggregation": {"mode": "auto"}}, CLUSTER)
    assert long.threshold_bounds == (16, 4096)
    advisory = tuning_config("ml", "llm", {**SPEC, "tuning": {"mode": "advisory"},
                                           "disaggregation": {"mode": "auto"}}, CLUSTER)
    assert advisory.threshold_bounds is None


def test_a_disaggregated_resource_is_measured_on_its_decode_pods_alone():
    """The clients' TTFT and ITL are the decode pods' (end to end, remote prefill included): the prefill pods'
    series stay out whatever the template, by their Service and by their pod names."""
    assert measurement_selector('namespace="{namespace}",service="{name}"', "ml", "llm", False) == \
        'namespace="ml",service="llm"'
    sel = measurement_selector('namespace="{namespace}",service=~"{name}.*"', "ml", "llm", True)
    assert sel == 'namespace="ml",service=~"llm.*",service!="llm-prefill",pod!~"llm-prefill-.*"'
    on = tuning_config("ml", "llm", {**SPEC, "disaggregation": {"mode": "on"}}, CLUSTER)
    assert on.selector == 'namespace="ml",service="llm",service!="llm-prefill",pod!~"llm-prefill-.*"'


class StatusKube:
    """The resource's status as the API keeps it: merge patches applied, each one recorded."""

    def __init__(self):
        self.raw = {"metadata": {"resourceVersion": "1"}, "status": {}}
        self.patches = []

    def read_inference_deployment(self, namespace, name):
        return self.raw

    def patch_status(self, namespace, name, patch, resource_version=None):
        self.patches.append(patch)
        self.raw["status"] = {**self.raw["status"], **patch}


def test_the_tuner_writes_its_threshold_into_status_scheduler_and_waits_for_every_pod_at_its_roles_knobs():
    from chunkpilot.tuner.daemon import StatusActuator, StatusWriter

    kube = StatusKube()
    actuator = StatusActuator(StatusWriter(kube, "ml", "llm"), Knobs(128, 64), 3)
    generation = actuator.apply(Knobs(256, 32, DISAGG_NEVER))
    assert kube.patches[-1] == {"scheduler": {"tokenBudget": 256, "maxChunk": 32, "source": "tuner",
                                              "generation": 4, "disaggThreshold": DISAGG_NEVER}}
    pods = [{"pod": "d", "role": "decode", "tokenBudget": 256, "maxChunk": 32, "generation": 4,
             "disaggThreshold": DISAGG_NEVER},
            # a prefill pod runs its role's own knobs (api.types.desired_knobs), which the wait does not hold it to
            {"pod": "p", "role": "prefill", "tokenBudget": 2048, "maxChunk": 1024, "generation": 7}]
    kube.raw["status"] |= {"readyReplicas": 2, "knobs": {"tokenBudget": 256, "maxChunk": 32, "generation": 4,
                                                         "disaggThreshold": DISAGG_NEVER, "pods": pods}}
    assert actuator.applied(generation)
    kube.raw["status"]["knobs"]["pods"][0].pop("disaggThreshold")  # the decode pod did not take the threshold
    assert not actuator.applied(generation)
    # knobs without a threshold (the resource left auto) delete the one a merge patch would keep
    actuator.apply(Knobs(256, 32))
    assert kube.patches[-1]["scheduler"]["disaggThreshold"] is None
    # and a resource that never had one is written as before
    plain = StatusKube()
    StatusActuator(StatusWriter(plain, "ml", "llm"), Knobs(128, 64), 0).apply(Knobs(96, 32))
    assert plain.patches[-1] == {"scheduler": {"tokenBudget": 96, "maxChunk": 32, "source": "tuner", "generation": 1}}


def test_tune_one_measures_a_disaggregated_resource_on_its_decode_pods_and_searches_its_threshold():
    """The resource's thread builds its loop with the decode pods' selector and the threshold grid."""
    import threading

    import kopf

    from chunkpilot.tuner import daemon
    from chunkpilot.tuner.retry import Backoff

    raw = {"metadata": {"namespace": "ml", "name": "llm", "uid": "u1", "generation": 1},
           "spec": {**SPEC, "disaggregation": {"mode": "auto"}}}

    class Kube:
        def read_inference_deployment(self, namespace, name):
            return raw

    stop, built = threading.Event(), {}

    class Loop:
        class study:
            @staticmethod
            def total_completed():
                return 0

        def iterate(self):
            stop.set()

    def build_loop(config, actuator, measurer, publisher, **_):
        built.update(config=config, measurer=measurer, start=actuator.current())
        return Loop()

    sources = daemon.Sources(measurer=lambda selector, slo, sleep, classes: selector, events=lambda raw: lambda *e: None,
                             build_loop=build_loop, backoff=lambda: Backoff(0.01, 1.0))
    memo = kopf.Memo(kube=Kube(), cluster=CLUSTER, metrics=None)
    daemon.tune_one("ml", "llm", "u1", memo, stop, sources)
    assert built["measurer"] == 'namespace="ml",service="llm",service!="llm-prefill",pod!~"llm-prefill-.*"'
    assert built["config"].space().thresholds[-1] == DISAGG_NEVER
    assert built["start"].disagg_threshold is None  # the pods run the spec's threshold until the first trial


# ---- the split: how many of the pods serve as prefill pods (the operator switches roles in place) ----------------
PODS_SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2, threshold=(16, 4096), pods=3)


def test_the_split_is_searched_with_the_threshold_and_never_runs_on_no_prefill_pod():
    space = PODS_SPACE
    assert space.splits == (1, 2) and SPLIT_SPACE.splits == ()  # no pod count: not searched
    never = len(space.thresholds) - 1
    assert space.knobs(0, 0, never, 1).prefill_pods == 0  # colocated: every pod serves clients
    # the prefill pods' budget (their chunk too): an octave grid over the budget bounds, the largest by default
    assert space.prefill_budgets == (32, 64, 128, 256, 512, 1024, 2048) and SPLIT_SPACE.prefill_budgets == ()
    assert space.knobs(0, 0, 3, 1) == Knobs(32, 32, 128, 2, 2048)
    assert space.knobs(0, 0, 3, 1, 2).prefill_knobs == Knobs(128, 128)
    assert space.knobs(0, 0, never, 1, 2).prefill_budget is None  # no prefill pod runs one
    assert space.colocated(Knobs(128, 64, 256, 2, 512)) == Knobs(128, 64, DISAGG_NEVER, 0)
    assert space.clamp(Knobs(128, 64, 256, 9)) == Knobs(128, 64, 256, 2, 2048)
    assert space.clamp(Knobs(128, 64, 256, 1, 8)) == Knobs(128, 64, 256, 1, 32)
    assert space.clamp(Knobs(128, 64, 256)) == Knobs(128, 64, 256, 1, 2048)
    assert space.clamp(Knobs(128, 64)) == Knobs(128, 64, None, 0)
    assert space.params(Knobs(128, 64, 256, 2, 512)) | {"budget_index": 0, "chunk_index": 0} == {
        "budget_index": 0, "chunk_index": 0, "threshold_index": 4, "split_index": 1, "prefill_index": 4}
    assert space.params(Knobs(128, 64, 256, 2))["prefill_index"] == 6
    # every finite threshold on each split at each prefill budget, and never once
    assert len(space.all_knobs()) == len(space.pairs()) * ((len(space.thresholds) - 1) * 2 * 7 + 1)
    assert reasons.holding(Knobs(128, 64, 256, 1)).endswith("threshold 256 on 1 prefill pod")
    assert reasons.holding(Knobs(128, 64, 256, 1, 512)).endswith("threshold 256 on 1 prefill pod at 512/512")
    assert Knobs(128, 64, 256, 2, 512).budget_and_chunk == Knobs(128, 64)
    # the split and its budget are more columns of the record, where they are searched
    entry = HistoryEntry(0, WindowKind.COMPLETE, Knobs(128, 64, 256, 2, 512), True, window(Knobs(128, 64)))
    assert entry.to_dict()["prefill_pods"] == 2 and entry.to_dict()["prefill_budget"] == 512
    assert HistoryEntry.from_dict(entry.to_dict()).knobs == entry.knobs
    assert not {"prefill_pods", "prefill_budget"} & HistoryEntry(0, WindowKind.COMPLETE, Knobs(128, 64), True,
                                                                  window(Knobs(128, 64))).to_dict().keys()


class PodSplitFake(SplitFake):
    """Three pods. Colocated, prompts stall the decodes (ITL over its SLO); split, the decode pods only decode, and
    one prefill pod keeps up with the prompts while two leave one decode pod for every client, whose TTFT then
    queues past its SLO."""

    def measure(self, seconds):
        w = split_window(self.knobs, "pays", self.rate, seconds, self.prompt, self.slo)
        if not self.knobs.colocated and self.knobs.prefill_pods == 2:
            w = Window(**{**w.to_dict(), "ttft": 2.5, "goodput": self.rate * 0.5})
        return w


def test_the_tuner_chooses_how_many_pods_prefill():
    fake = PodSplitFake("pays", start=Knobs(128, 128))
    settings = TunerSettings(window=60, warmup=5, max_trials=10, min_requests=20)
    study = TunerStudy(":memory:", "ns/pods", PODS_SPACE, SLO, settings.objective, seed=1)
    loop = TunerLoop(settings, PODS_SPACE, study, fake, fake, fake, SLO)
    run_until_exploiting(loop, 40)
    assert fake.applied_log[0] == Knobs(128, 128, DISAGG_NEVER, 0)  # colocated first: every pod a decode pod
    tried = {r.knobs.prefill_pods for r in study.records() if r.knobs is not None and not r.knobs.colocated}
    assert tried == {1, 2}, study.records()  # both splits measured (else this would prove nothing)
    best = study.best()
    assert best.feasible and best.knobs.prefill_pods == 1 and best.knobs.disagg_threshold < PROMPT
    assert fake.knobs == best.knobs
    assert f"on 1 prefill pod at {best.knobs.prefill_budget}/" in loop.state.reason
    state = TunerState(mode="auto", best=best, current=best.knobs)
    assert status_tuning(state, SLO, "goodput").best.prefill_pods == 1


def test_of_two_splits_with_equal_goodput_the_one_with_fewer_prefill_pods_is_kept():
    study = TunerStudy(":memory:", "ns/pods", PODS_SPACE, SLO, "goodput", seed=0)
    same = window(Knobs(128, 128))
    for knobs in (Knobs(128, 128, 256, 2, 2048), Knobs(128, 128, 256, 1, 2048)):
        study.enqueue(knobs, TrialKind.PREDICTED)
        trial, asked = study.ask()
        assert asked == knobs
        study.tell(trial, same)
    assert study.best().knobs == Knobs(128, 128, 256, 1, 2048)  # one more pod serving clients


def test_the_tuner_writes_its_split_and_waits_for_the_pods_to_serve_in_it():
    from chunkpilot.tuner.daemon import StatusActuator, StatusWriter, split_applied

    auto = tuning_config("ml", "llm", {**SPEC, "disaggregation": {"mode": "auto", "prefill": {"replicas": 1},
                                                                  "decode": {"replicas": 2}}}, CLUSTER)
    assert auto.pods == 3 and auto.space().splits == (1, 2)

    kube = StatusKube()
    actuator = StatusActuator(StatusWriter(kube, "ml", "llm"), Knobs(128, 64), 3)
    generation = actuator.apply(Knobs(256, 32, 512, 2))
    assert kube.patches[-1]["scheduler"]["prefillPods"] == 2
    pods = [{"pod": p, "role": "decode", "tokenBudget": 256, "maxChunk": 32, "generation": 4,
             "disaggThreshold": 512} for p in ("a", "b", "c")]
    kube.raw["status"] |= {"readyReplicas": 3, "knobs": {"tokenBudget": 256, "maxChunk": 32, "generation": 4,
                                                         "disaggThreshold": 512, "pods": pods},
                           "disaggregation": {"prefill": {"readyReplicas": 1}, "decode": {"readyReplicas": 2}}}
    assert not actuator.applied(generation)  # every pod has the knobs, but one prefill pod where two were asked
    kube.raw["status"]["disaggregation"]["prefill"]["readyReplicas"] = 2
    assert actuator.applied(generation)
    # at most all ready pods but one: with two ready, one prefill pod is the split applied
    assert split_applied({"disaggregation": {"prefill": {"readyReplicas": 1}}}, 2, 2)
    assert split_applied({}, None, 3)
    # with the prefill pods' own budget: written beside the split, and waited for on the prefill pods alone
    generation = actuator.apply(Knobs(256, 32, 512, 1, 1024))
    assert kube.patches[-1]["scheduler"]["prefillTokenBudget"] == 1024
    decode = {"tokenBudget": 256, "maxChunk": 32, "generation": generation, "disaggThreshold": 512}
    prefill = {"pod": "c", "role": "prefill", "tokenBudget": 2048, "maxChunk": 2048, "generation": generation - 1}
    kube.raw["status"] |= {"knobs": {**decode, "pods": [{"pod": p, "role": "decode", **decode} for p in "ab"] + [prefill]},
                           "disaggregation": {"prefill": {"readyReplicas": 1}, "decode": {"readyReplicas": 2}}}
    assert not actuator.applied(generation)  # the prefill pod still runs the spec's knobs
    prefill |= {"tokenBudget": 1024, "maxChunk": 1024, "generation": generation}
    assert actuator.applied(generation)
    actuator.apply(Knobs(256, 32))
    assert kube.patches[-1]["scheduler"]["prefillPods"] is None
    assert kube.patches[-1]["scheduler"]["prefillTokenBudget"] is None


# ---- guided, with no colocated knobs predicted feasible: the splits are explored --------------------------------
TIGHT_ITL = SLOTargets(ttft=LatencyTarget(0.99, 8.0), itl=LatencyTarget(0.99, 0.1))  # no pair keeps it (PINNED)


def test_with_no_colocated_knobs_predicted_feasible_the_choice_explores_the_splits():
    memory = Memory(guided=True, epoch=0, grid=GRID, slo=TIGHT_ITL, drift_load_shift=0.5, max_trials=10,
                    splits=True)
    made = choose(memory, Observation(PINNED))
    assert made.judgement.feasible is False and made.queue is None  # not the closest colocated, tried again
    pair = made.screen.fallback  # the closest colocated knobs, should Optuna keep asking colocated ones
    assert made.screen.takes(Knobs(pair.token_budget, pair.max_chunk, 256, 1), None)
    assert not made.screen.takes(Knobs(pair.token_budget, pair.max_chunk, DISAGG_NEVER, 0), None)
    assert "exploring the prefill/decode splits" in made.notes[0]
    # without a searched threshold, or with the trials spent: the closest colocated knobs, as before
    for m in (replace(memory, splits=False), replace(memory, explored=10)):
        assert choose(m, Observation(PINNED)).kind == TrialKind.CLOSEST


class TightFake(GuidedSplitFake):
    """ITL far tighter than any colocated step allows (the model predicts no pair keeps it); the split's decode
    pods only decode and keep it, its TTFT within its SLO."""

    slo = TIGHT_ITL

    def measure(self, seconds):
        w = super().measure(seconds)
        if not self.knobs.colocated and self.knobs.disagg_threshold < self.prompt:
            return Window(**{**w.to_dict(), "itl": 0.05, "goodput": self.rate})
        return w


def test_guided_with_no_colocated_knobs_feasible_the_tuner_finds_the_split_that_keeps_the_slos():
    fake = TightFake("pays", start=Knobs(128, 128), rate=0.3)
    loop, study = make_split(fake, slo=TIGHT_ITL, max_trials=8)
    run_until_exploiting(loop)
    assert loop.state.predicted_safe == 0  # no colocated knobs are predicted to keep the SLOs
    records = [r for r in study.records() if r.knobs is not None]
    assert records[0].kind == TrialKind.COLOCATED
    assert sum(not r.knobs.colocated for r in records) >= 3, records  # the splits were explored
    best = study.best()
    assert best.feasible and not best.knobs.colocated and best.knobs.disagg_threshold < fake.prompt
    assert fake.knobs == best.knobs


class PrefillBudgetFake(SplitFake):
    """The split pays (see split_window), but only where the prefill pods take a prompt in steps of 256 tokens or
    more: below that, every prompt queues behind the others' small chunks and the TTFT breaches its SLO."""

    def measure(self, seconds):
        w = split_window(self.knobs, "pays", self.rate, seconds, self.prompt, self.slo)
        if not self.knobs.colocated and self.knobs.prefill_budget < 256:
            w = Window(**{**w.to_dict(), "ttft": 2.5, "goodput": self.rate * 0.5})
        return w


def test_the_tuner_chooses_the_prefill_pods_budget_by_the_clients_ttft():
    fake = PrefillBudgetFake("pays", start=Knobs(128, 128))
    settings = TunerSettings(window=60, warmup=5, max_trials=12, min_requests=20)
    study = TunerStudy(":memory:", "ns/prefill-budget", PODS_SPACE, SLO, settings.objective, seed=2)
    loop = TunerLoop(settings, PODS_SPACE, study, fake, fake, fake, SLO)
    run_until_exploiting(loop, 40)
    budgets = {r.knobs.prefill_budget for r in study.records() if r.knobs is not None and not r.knobs.colocated}
    assert min(budgets) < 256 <= max(budgets), study.records()  # both sides measured (else this proves nothing)
    best = study.best()
    assert best.feasible and not best.knobs.colocated and best.knobs.prefill_budget >= 256
    assert fake.knobs == best.knobs
    status = SchedulerStatus.of(best.knobs, source="tuner", generation=7)
    assert status.knobs == best.knobs and status.prefill_token_budget == best.knobs.prefill_budget
