"""Replicas as the tuner's last knob: the decisions (pure, on a known step cost), HPA-style stabilization and the
scale-down hysteresis; the loop's coordination (no trial while the replicas change or pods are not ready, knobs
first, bounds kept in auto, recommend only while refused); the status, condition, Event and metrics; and the
fleet simulator's 1 -> 3 -> 1 ramp with fixed seeds (coordinated against replicas-only)."""

from __future__ import annotations

import pytest

from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner import autoscale, guide
from chunkpilot.tuner.autoscale import Autoscaler, ScalingPolicy
from chunkpilot.tuner.daemon import ClusterConfig, StatusPublisher, tuning_config
from chunkpilot.tuner.interfaces import ReplicaCount
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.measurement import Window
from chunkpilot.tuner.metrics import CURRENT_REPLICAS, DESIRED_REPLICAS, MAX_REPLICAS, TunerMetrics
from chunkpilot.tuner.predictor import Load
from chunkpilot.sim.costmodel import default
from chunkpilot.sim.experiment import _Quiet
from chunkpilot.sim.fleet import Fleet
from chunkpilot.sim.scaling import Ramp, run_policy
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.state import ScalingState, TunerState, conditions, dump, status_autoscaling
from chunkpilot.tuner.study import TunerStudy

SLO = SLOTargets(ttft=LatencyTarget(0.99, 20.0), itl=LatencyTarget(0.99, 0.5))
MODEL = default().as_step_model()
KNOBS = Knobs(256, 256)
POLICY = ScalingPolicy(mode="auto", min_replicas=1, max_replicas=4, down_stabilization=300.0)


def context(rate: float, pods: int = 1) -> guide.Context:
    """`rate` req/s for the whole deployment, measured on `pods` pods."""
    return guide.Context(MODEL, Load(request_rate=rate / pods, prompts=((64.0, 8.0), (512.0, 2.0)),
                                     running=4.0 / pods), pods)


def test_pods_needed_grows_with_the_load_and_keeps_prefill_under_the_target():
    needed = [autoscale.pods_needed(context(rate), KNOBS, SLO, 0.7) for rate in (0.5, 4.0, 8.0, 16.0)]
    assert needed == sorted(needed) and needed[0] == 1 and needed[-1] > needed[1], needed
    n = needed[2]
    # n pods fit; one fewer does not (the smallest such count)
    assert autoscale.fits(context(8.0), n, KNOBS, SLO, 0.7)
    assert not autoscale.fits(context(8.0), n - 1, KNOBS, SLO, 0.7)
    judged = guide.judge(autoscale.spread(context(8.0), n), KNOBS, SLO)
    assert judged.safe and judged.candidate.utilization <= 0.7
    # the same whole load measured on 3 pods needs the same count
    assert autoscale.pods_needed(context(8.0, pods=3), KNOBS, SLO, 0.7) == n


def test_scale_down_needs_room_below_the_target_hysteresis():
    up = autoscale.pods_needed(context(8.0), KNOBS, SLO, POLICY.target_utilization)
    # at exactly the pods needed: neither up nor down
    assert autoscale.recommend(context(8.0, pods=up), KNOBS, SLO, POLICY, up)[0] == up
    # one pod more than needed: down only if the fewer pods stay within 80 % of the target
    tight = autoscale.pods_needed(context(8.0), KNOBS, SLO, POLICY.target_utilization * autoscale.DOWN_HYSTERESIS)
    rec, needed, why = autoscale.recommend(context(8.0, pods=up + 1), KNOBS, SLO, POLICY, up + 1)
    assert needed == up and rec == min(up + 1, tight), why
    # the bounds: more than maxReplicas needed -> maxReplicas, and the reason says so
    rec, needed, why = autoscale.recommend(context(40.0), KNOBS, SLO, POLICY, 1)
    assert rec == 4 and needed > 4 and "maxReplicas 4 is too low" in why


def test_stabilization_has_hpa_semantics():
    p = ScalingPolicy(mode="auto", min_replicas=1, max_replicas=10, up_stabilization=60, down_stabilization=300)
    # down: the highest recommendation of the last 300 s
    assert autoscale.stabilize([(0, 5), (100, 2), (200, 3)], 250, 5, p) == 5
    assert autoscale.stabilize([(0, 5), (100, 2), (200, 3)], 350, 5, p) == 3
    # up: the lowest of the last 60 s
    assert autoscale.stabilize([(0, 8), (30, 4), (50, 6)], 60, 2, p) == 4
    assert autoscale.stabilize([(0, 8), (30, 4), (50, 6)], 100, 2, p) == 6
    scaler = Autoscaler(p)
    first = scaler.decide(context(16.0, pods=4), KNOBS, SLO, 4, now=0)
    assert first.desired == first.recommendation  # nothing before it to hold it
    calm = scaler.decide(context(0.5, pods=4), KNOBS, SLO, 4, now=30)
    assert calm.recommendation < 4 and calm.desired == 4 and "stabilization" in calm.reason
    assert scaler.decide(context(0.5, pods=4), KNOBS, SLO, 4, now=400).desired == calm.recommendation


def test_policy_refuses_nonsense_with_what_to_change():
    with pytest.raises(ValueError, match="minReplicas <= maxReplicas"):
        ScalingPolicy(mode="auto", min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="mode must be one of"):
        ScalingPolicy(mode="sometimes")


class FakeScaler:
    def __init__(self, spec: int, ready: int | None = None, refused: str = "") -> None:
        self.spec, self.ready, self._refused, self.calls = spec, spec if ready is None else ready, refused, []

    def replicas(self) -> ReplicaCount:
        return ReplicaCount(self.spec, self.ready)

    def scale(self, replicas: int, version: str | None = None) -> bool:
        self.calls.append(replicas)
        self.spec, self.ready = replicas, min(self.ready, replicas)  # the ReplicaSet removes unready pods first
        return True

    def refused(self) -> str:
        return self._refused


class CountingMeasurer:
    """A measurer whose windows are never used as trials here: it counts waits and fails `check` on demand."""

    def __init__(self) -> None:
        self.waited = 0.0

    def check(self) -> None:
        pass

    def wait(self, seconds: float) -> None:
        self.waited += seconds

    def measure(self, seconds: float) -> Window:
        return Window(seconds=seconds, requests=0, request_rate=0.0, output_tokens_per_s=0.0, goodput=0.0)


class NullActuator:
    def apply(self, knobs): return 1
    def applied(self, generation): return True
    def current(self): return KNOBS


def loop_with(scaler, policy=POLICY, measurer=None, clock=None, **settings) -> TunerLoop:
    space = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)
    study = TunerStudy(":memory:", "t", space, SLO, "goodput", seed=0)
    return TunerLoop(TunerSettings(window=20, warmup=2, min_requests=1, **settings), space, study, NullActuator(),
                     measurer or CountingMeasurer(), _Quiet(), SLO, scaler=scaler, scaling=policy, clock=clock)


def test_no_trial_while_pods_are_not_ready_and_a_warmup_window_after_a_change():
    scaler = FakeScaler(spec=3, ready=2)
    loop = loop_with(scaler)
    assert loop.iterate() == "scaling" and loop.state.phase == "Scaling"
    assert "2 of 3 replicas ready" in loop.state.reason and not loop.study.completed()
    scaler.ready = 3  # ready now: one window of warm-up before any trial
    assert loop.iterate() == "scaling" and "warm-up" in loop.state.reason
    scaler.spec = scaler.ready = 4  # someone scaled: again
    assert loop.iterate() == "scaling"
    assert loop.iterate() != "scaling"  # settled: tuning goes on (a thin window here, not a scaling one)


def test_auto_keeps_the_bounds_and_recommends_only_while_refused():
    scaler = FakeScaler(spec=9)
    loop = loop_with(scaler)
    loop.iterate()
    assert scaler.calls == [4] and "outside [1, 4]" in loop.state.scaling.reason
    hpa = FakeScaler(spec=9, refused="HorizontalPodAutoscaler llm targets this InferenceDeployment")
    loop = loop_with(hpa)
    loop.iterate()
    assert hpa.calls == []  # refused: the other controller owns the replicas
    cond = {c.type: c for c in conditions(loop.state, SLO)}["Autoscaling"]
    assert (cond.status, cond.reason) == ("False", "ConflictingAutoscaler")
    assert "HorizontalPodAutoscaler llm" in dump(status_autoscaling(loop.state))["reason"]
    zero = FakeScaler(spec=0)  # scaled to zero by hand: autoscaling pauses, as an HPA's does
    loop_with(zero).iterate()
    assert zero.calls == []


def test_replicas_that_cannot_help_are_not_asked_for():
    """Review: at 0.05 req/s with an ITL SLO no step can meet, pods_needed is None and the tuner asked for
    maxReplicas (1000). More pods cannot make one request faster: the count is held, a breach adds nothing, and the
    condition says why."""
    slo = SLOTargets(itl=LatencyTarget(0.99, 0.001))
    policy = ScalingPolicy(mode="auto", min_replicas=1, max_replicas=1000, down_stabilization=0)
    assert autoscale.pods_needed(context(0.05), KNOBS, slo, policy.target_utilization) is None
    for breached in (False, True):
        d = Autoscaler(policy).decide(context(0.05, pods=2), KNOBS, slo, 2, now=0, breached=breached)
        assert (d.desired, d.needed, d.helps) == (2, None, False) and "would not help" in d.reason, d
    state = TunerState(mode="auto", phase="Exploiting")
    state.scaling = ScalingState(mode="auto", replicas=2, ready=2, desired=2, needed=None, helps=False,
                                 reason=d.reason)
    cond = {c.type: c for c in conditions(state, slo)}["Autoscaling"]
    assert (cond.status, cond.reason) == ("True", "ReplicasWouldNotHelp") and "holding 2" in cond.message


def test_advisory_tuning_never_scales_the_one_rule_of_the_crd():
    """Review: advisory tuning with autoscaling auto scaled 1 -> 4 while the status said nothing changes. One rule
    (api.types.autoscaling_refusal, also the CRD's CEL): advisory only recommends; the tuner enforces it for
    objects stored before the rule."""
    from dataclasses import replace

    from chunkpilot.api.types import AUTOSCALING_ALLOWED, autoscaling_refusal

    assert autoscaling_refusal("advisory", "auto") and not autoscaling_refusal("advisory", "recommend")
    assert autoscaling_refusal("off", "recommend") and not autoscaling_refusal("auto", "auto")
    assert set(AUTOSCALING_ALLOWED) == {"off", "advisory", "auto"}
    scaler = FakeScaler(spec=9)  # outside the bounds: auto would scale it to 4 at once
    loop = loop_with(scaler)
    loop.s = replace(loop.s, mode="advisory")
    loop.iterate()
    assert scaler.calls == []
    cond = {c.type: c for c in conditions(loop.state, SLO)}["Autoscaling"]
    assert (cond.status, cond.reason) == ("False", "AdvisoryTuning") and "advisory" in cond.message


class LoadMeasurer(CountingMeasurer):
    """Windows at a steady load on the scaler's ready pods; `breach` makes their ITL break the SLO, `on_window`
    runs as a window is read (a person's kubectl scale during it)."""

    def __init__(self, scaler, rate: float = 0.5) -> None:
        super().__init__()
        self.scaler, self.rate, self.breach, self.on_window = scaler, rate, False, None

    def context(self, seconds: float) -> guide.Context:
        return context(self.rate, pods=max(1, self.scaler.ready))

    def measure(self, seconds: float) -> Window:
        if self.on_window is not None and seconds >= 20:
            self.on_window()
        return Window(seconds=seconds, requests=40, request_rate=self.rate, output_tokens_per_s=30.0,
                      goodput=self.rate, ttft=1.0, itl=5.0 if self.breach else 0.1)


def test_a_pod_that_never_gets_ready_does_not_freeze_scaling_or_tuning():
    """Review: spec 4, ready 3 gave 0 scale calls in 50 iterations, phase stuck at Scaling: one crash-looping pod
    stopped scale-down and tuning for good. Now, as an HPA does, the ready pods decide: a scale-down goes on while
    a pod is not ready, and past the readiness timeout tuning goes on with the ready pods."""
    scaler = FakeScaler(spec=4, ready=3)
    measurer = LoadMeasurer(scaler, rate=0.5)  # one pod carries it
    loop = loop_with(scaler, ScalingPolicy(mode="auto", min_replicas=1, max_replicas=4, down_stabilization=0),
                     measurer, clock=lambda: measurer.waited)
    for _ in range(5):
        loop.iterate()
        if scaler.calls:
            break
    assert scaler.calls and scaler.calls[-1] < 4, (scaler.calls, loop.state.reason)

    stuck = FakeScaler(spec=2, ready=1)
    measurer = LoadMeasurer(stuck, rate=0.5)
    loop = loop_with(stuck, ScalingPolicy(mode="recommend", min_replicas=1, max_replicas=4), measurer,
                     clock=lambda: measurer.waited, readiness_timeout=60)
    outcomes = [loop.iterate() for _ in range(6)]
    assert outcomes[0] == "scaling"
    assert any(o != "scaling" for o in outcomes), outcomes
    assert loop.state.phase != "Scaling" and loop.study.completed()  # a trial on the ready pod
    cond = {c.type: c for c in conditions(loop.state, SLO)}["Autoscaling"]
    assert cond.reason == "ReplicasNotReady", cond
    stuck.ready = 2  # it recovered: a warm-up window on both, then tuning on both
    assert loop.iterate() == "scaling" and "warm-up" in loop.state.reason


def test_a_replica_count_changed_during_the_window_is_never_overwritten():
    """Review: the exploiting phase decided on the count read before the window; a person scaled to 0 during a
    breaching window and the tuner wrote 2. Now the count is read again before writing and written against that
    resourceVersion."""
    scaler = FakeScaler(spec=1)
    measurer = LoadMeasurer(scaler)
    space = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)
    study = TunerStudy(":memory:", "t", space, SLO, "goodput", seed=0)
    loop = TunerLoop(TunerSettings(window=20, warmup=2, min_requests=1, max_trials=1), space, study, NullActuator(),
                     measurer, _Quiet(), SLO, scaler=scaler, scaling=POLICY)
    loop.iterate()  # the one trial
    measurer.breach = True

    def scale_to_zero():
        scaler.spec = scaler.ready = 0

    measurer.on_window = scale_to_zero
    assert loop.iterate() == "exploit"
    assert scaler.calls == [] and scaler.spec == 0
    assert "changed to 0 during the window" in loop.state.scaling.reason


def test_the_scale_write_carries_the_resource_version_and_a_conflict_is_not_an_error():
    from kubernetes.client.exceptions import ApiException

    from chunkpilot.tuner.daemon import StatusScaler

    class Kube:
        def __init__(self):
            self.writes = []

        def read_inference_deployment(self, namespace, name):
            return {"metadata": {"resourceVersion": "42"}, "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}

        def scale_inference_deployment(self, namespace, name, replicas, resource_version=None):
            self.writes.append((replicas, resource_version))
            if resource_version != "42":
                raise ApiException(status=409, reason="Conflict")

    kube = Kube()
    scaler = StatusScaler(kube, "team", "llm")
    r = scaler.replicas()
    assert (r.spec, r.ready, r.version) == (2, 2, "42")
    assert scaler.scale(3, r.version) is True
    assert scaler.scale(3, "41") is False  # moved since that read: not written, not an exception
    assert kube.writes == [(3, "42"), (3, "41")]


def test_status_condition_event_and_metrics(tmp_path):
    state = TunerState(mode="auto", phase="Exploiting")
    state.scaling = ScalingState(mode="auto", replicas=2, ready=2, desired=3, needed=6, reason="6 replicas needed",
                                 last_scale="2026-12-01T00:00:00Z")
    status = dump(status_autoscaling(state))
    assert status == {"mode": "auto", "desiredReplicas": 3, "neededReplicas": 6, "currentReplicas": 2,
                      "lastScaleTime": "2026-12-01T00:00:00Z", "reason": "6 replicas needed"}
    assert {c.type: c.reason for c in conditions(state, SLO)}["Autoscaling"] == "AtMaxReplicas"
    metrics = TunerMetrics()
    metrics.update_scaling("team", "llm", state, 3)
    value = metrics.registry.get_sample_value
    assert value(DESIRED_REPLICAS, {"namespace": "team", "deployment": "llm"}) == 3
    assert value(CURRENT_REPLICAS, {"namespace": "team", "deployment": "llm"}) == 2
    assert value(MAX_REPLICAS, {"namespace": "team", "deployment": "llm"}) == 3
    state.scaling = None  # autoscaling off: the series go away
    metrics.update_scaling("team", "llm", state, 3)
    assert value(DESIRED_REPLICAS, {"namespace": "team", "deployment": "llm"}) is None
    events = []

    class Writer:
        namespace, name = "team", "llm"

        def write(self, **parts):
            self.parts = parts

    spec = {"model": {"source": "pvc://m"}, "slo": {"itl": {"thresholdSeconds": 0.5}},
            "tuning": {"mode": "auto"}, "autoscaling": {"mode": "auto", "maxReplicas": 3}}
    config = tuning_config("team", "llm", spec, ClusterConfig(prometheus_url="http://x", storage="sqlite://"))
    assert config.scaling.mode == "auto" and config.scaling.max_replicas == 3
    writer = Writer()
    state.scaling = ScalingState(mode="auto", replicas=2, ready=2, desired=3, reason="3 needed",
                                 last_scale="2026-12-01T00:00:00Z", refused="")
    StatusPublisher(writer, config, None, post_event=lambda *e: events.append(e)).publish(state)
    assert ("Normal", "Scaled", "replicas -> 3: 3 needed") in events
    assert writer.parts["autoscaling"].desired_replicas == 3


def test_fleet_routes_scales_and_counts_replica_seconds():
    ramp = Ramp(base=0.6, peak=0.6, calm=60, ramp=0, busy=60, steps=1)
    fleet = Fleet(default(), ramp.requests(), Knobs(256, 256), replicas=1, startup=30.0)
    fleet.advance(60)
    fleet.scale(3)
    assert fleet.ready == 1 and fleet.spec_replicas == 3
    fleet.advance(100)
    assert fleet.ready == 3
    served = [len(r.sim.records) for r in fleet.live]
    assert all(n > 0 for n in served[1:]), served  # least-loaded sends the new pods work
    fleet.scale(1)
    fleet.advance(200)
    assert len(fleet.live) == 1 and len(fleet.retired) == 2  # drained, then removed
    assert 60 + 3 * 40 < fleet.replica_seconds < 200 * 3
    assert all(r.end is not None for r in fleet.run())  # nothing lost on a scale-down


def test_coordinated_beats_replicas_only_on_the_ramp():
    """The simulator scenario of bench/autoscale.py, seeded and shorter: on a ramp that needs 1 -> 3 -> 1
    replicas, coordinated tuning keeps the SLOs and pays fewer replica-seconds than a queue-length HPA at the
    knobs the tuner chose before the ramp (tuned once, then frozen) that reaches the same attainment; at vLLM's
    start-up knobs no queue target reaches it at all (unchunked prompts stall decodes on any replica count)."""
    ramp = Ramp(lead=600, calm=300, ramp=150, busy=500, steps=2, seed=0)
    scaling = ScalingPolicy(mode="auto", min_replicas=1, max_replicas=4, down_stabilization=120)
    settings = TunerSettings(window=60, warmup=10, max_trials=8, min_requests=10)
    coordinated = run_policy("coordinated", ramp, default(), scaling=scaling, settings=settings, seed=0)
    peak = max(n for _, n, _ in coordinated.timeline)
    assert peak >= 3 and coordinated.timeline[-1][1] < peak, coordinated.timeline  # up for the peak, down after
    assert coordinated.attainment >= 0.99
    frozen = coordinated.at_lead
    hpa = [run_policy("replicas", ramp, default(), scaling=scaling, settings=settings, queue_target=t, fixed=frozen)
           for t in (2.0, 1.0, 0.5)]
    reaching = [r for r in hpa if r.attainment >= coordinated.attainment]
    assert reaching, [r.attainment for r in hpa]
    cheapest = min(r.replica_seconds for r in reaching)
    assert coordinated.replica_seconds <= 0.9 * cheapest, (coordinated.replica_seconds, cheapest)
    startup = run_policy("replicas", ramp, default(), scaling=scaling, settings=settings, queue_target=0.5)
    assert startup.attainment < 0.95 < coordinated.attainment


def test_a_trial_whose_window_saw_the_replicas_change_is_failed_not_told():
    scaler = FakeScaler(spec=2)

    class ScalesDuringTheWindow(CountingMeasurer):
        def measure(self, seconds: float) -> Window:
            if seconds == 20:  # the whole window (not the probe): someone scaled meanwhile
                scaler.spec = scaler.ready = 3
            return Window(seconds=seconds, requests=30, request_rate=1.5, output_tokens_per_s=30.0, goodput=1.5,
                          ttft=1.0, itl=0.1)

    loop = loop_with(scaler, policy=ScalingPolicy(mode="recommend"), measurer=ScalesDuringTheWindow())
    # settled from the start: the first iteration is a trial, and the replicas change during its window
    assert loop.iterate() == "scaling" and "changed during the window" in loop.state.reason
    assert not loop.study.completed()
    assert loop.iterate() == "scaling" and "warm-up" in loop.state.reason  # and the next window is a warm-up


def test_a_breached_window_adds_a_pod_whatever_the_model_says():
    scaler = Autoscaler(POLICY)
    calm = scaler.decide(context(0.5, pods=2), KNOBS, SLO, 2, now=0)
    assert calm.recommendation == 1  # the model says one pod would do
    breached = Autoscaler(POLICY).decide(context(0.5, pods=2), KNOBS, SLO, 2, now=0, breached=True)
    assert breached.recommendation == 3 and breached.desired == 3 and "broke an SLO" in breached.reason
