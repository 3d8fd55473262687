"""A pool whose per-pod load is uneven, as a prefix-aware picker makes it (docs/routing.md): the tuner judges knobs
and pod counts on the busiest pod (predictor.Load.imbalance), measured from each pod's arrivals. On the fleet
simulator with 60 % of the arrivals on one of three pods, judging the mean pod scaled up after each breach and
down again as soon as the model said the mean pod had room (attainment 0.89-0.93 over the last 1,000 s, seeds
0-3); judging the busiest pod holds every pod's SLO."""

from __future__ import annotations

import random

import pytest

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.stats import meets
from chunkpilot.sim import simulator
from chunkpilot.sim.costmodel import default
from chunkpilot.sim.experiment import Scenario, _Quiet
from chunkpilot.sim.fleet import Fleet, FleetScaler
from chunkpilot.sim.simulator import SimActuator, SimMeasurer
from chunkpilot.tuner.autoscale import ScalingPolicy
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.predictor import Load, imbalance_of, predict
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.study import TunerStudy

SLO = SLOTargets.p99(ttft=20.0, itl=0.5)
SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)
HOT = (0.6, 0.2, 0.2)


def poisson(rng: random.Random, mean: float) -> int:
    n, t = 0, rng.expovariate(1.0)
    while t < mean:
        n, t = n + 1, t + rng.expovariate(1.0)
    return n


def test_an_even_pool_reads_even_and_a_concentrated_one_does_not():
    rng = random.Random(0)
    even = [imbalance_of([float(poisson(rng, 40)) for _ in range(3)], 3) for _ in range(300)]
    assert sum(1 for x in even if x == 1.0) >= 0.95 * len(even)  # Poisson noise is not imbalance
    assert imbalance_of([72.0, 24.0, 24.0], 3) == pytest.approx((72 - 2 * 40 ** 0.5) / 40)
    assert imbalance_of([], 3) == imbalance_of([0.0, 0.0], 2) == 1.0
    # a pod that gets nothing counts in the mean: two pods of three busy read as imbalance
    assert imbalance_of([60.0, 60.0, 0.0], 3) > 1.0


def test_knobs_are_predicted_on_the_busiest_pod_and_the_imbalance_survives_a_change_of_pods():
    model = default().as_step_model()
    load = Load(request_rate=0.8, prompts=((64.0, 0.8), (512.0, 0.2)), running=4.0)
    hot = Load(request_rate=0.8, prompts=load.prompts, running=4.0, imbalance=1.5)
    knobs = Knobs(256, 256)
    assert predict(model, knobs, hot) == predict(model, knobs, load.scaled(1.5))
    assert predict(model, knobs, hot).utilization > predict(model, knobs, load).utilization
    assert hot.scaled(0.5).imbalance == 1.5 and hot.scaled(0.5).request_rate == pytest.approx(0.4)


def test_uneven_routing_needs_a_weight_per_replica():
    with pytest.raises(ValueError, match="one non-negative weight per replica"):
        Fleet(default(), [], Knobs(256, 256), replicas=3, balancer="uneven", weights=(1.0, 1.0))
    fleet = Fleet(default(), Scenario(rate=2.0).workload(120), Knobs(256, 256), replicas=3, balancer="uneven",
                  weights=HOT)
    fleet.run()
    served = [len(r.sim.records) for r in fleet.live]
    assert served[0] > served[1] + served[2] - 20, served  # about 60 % on the first


def tuned_attainment(seed: int, seconds: float = 3000, last: float = 1000) -> tuple[float, list]:
    """The tuner with autoscaling (3-6 pods) on a pool with 60 % of 2.6 req/s on one pod: the share of the
    last `last` seconds' requests within every SLO, on the busiest pod (the first), and the replica timeline."""
    fleet = Fleet(default(), Scenario(rate=2.6, seed=seed).workload(seconds), Knobs(2048, 2048), replicas=3,
                  balancer="uneven", weights=HOT, seed=seed, sim_options={"max_num_seqs": 64}, startup=60)
    settings = TunerSettings(window=60, warmup=10, max_trials=12, min_requests=15)
    study = TunerStudy(":memory:", "uneven", SPACE, SLO, settings.objective, seed=seed)
    loop = TunerLoop(settings, SPACE, study, SimActuator(fleet), SimMeasurer(fleet, SLO), _Quiet(), SLO,
                     scaler=FleetScaler(fleet), clock=lambda: fleet.now,
                     scaling=ScalingPolicy(mode="auto", min_replicas=3, max_replicas=6, down_stabilization=300))
    fleet.advance(settings.warmup + settings.window)
    while fleet.now < seconds:
        loop.iterate()
    fleet.run()
    hot = [r for r in fleet.live[0].sim.records if r.start >= seconds - last]
    return sum(1 for r in hot if meets(r, SLO)) / len(hot), fleet.timeline


def test_the_tuner_keeps_the_busiest_pods_slo_and_does_not_flap():
    share, timeline = tuned_attainment(0)  # seeds 1-3 alike (docs/routing.md); one keeps the suite short
    assert share >= 0.99, (share, timeline)
    downs = sum(1 for (_, a, _), (_, b, _) in zip(timeline, timeline[1:]) if b < a)
    assert downs <= 1, timeline


def test_judged_on_the_mean_pod_the_same_pool_flaps_and_misses(monkeypatch):
    """What the busiest pod's view fixed: the same run with the imbalance read as 1 (even spread)."""
    monkeypatch.setattr(simulator, "imbalance_of", lambda arrivals, pods: 1.0)
    share, timeline = tuned_attainment(0)
    assert share < 0.95, (share, timeline)
