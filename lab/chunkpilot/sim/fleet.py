"""Several simulated engines behind a load balancer, on one virtual clock: what the tuner's replica decisions are
measured on (bench/autoscale.py, tests/tuner/test_autoscale.py).

* Each replica is a Simulator (the real scheduler, a fitted step cost). The fleet routes every arrival, at its
  arrival time, to a ready replica: round-robin, or least-loaded (fewest requests in the system), as a
  Kubernetes Service or a gateway would; or uneven (each arrival to replica i with probability `weights[i]`,
  seeded): the per-pod load a prefix-aware picker makes when it keeps a big tenant's prompts on the pod that
  caches its prefix (docs/routing.md).
* A scale-up adds replicas that take `startup` seconds before they are ready (a pod loading its model); a
  scale-down stops routing to the newest replicas and removes each once it has finished its requests (a
  draining pod). Replica-seconds count every replica from its start to its removal: what the cluster pays for.
* Knobs apply to every replica, and to those started later.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.stats import RequestRecord
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.tuner.guide import Context
from chunkpilot.tuner.interfaces import ReplicaCount
from chunkpilot.tuner.measurement import Window
from chunkpilot.sim.costmodel import StepCost
from chunkpilot.sim.simulator import Simulator, load_over, model_over, window_over
from chunkpilot.tuner.space import Knobs

BALANCERS = ("least-loaded", "round-robin", "uneven")


@dataclass
class Replica:
    sim: Simulator
    ready_at: float
    draining: bool = False
    started: float = 0.0


@dataclass
class Fleet:
    cost: StepCost
    requests: list[RequestSpec]
    knobs: Knobs
    replicas: int = 1
    balancer: str = "least-loaded"
    startup: float = 30.0
    sim_options: dict = field(default_factory=dict)
    count_from: float = 0.0  # replica-seconds are counted from this time on
    weights: tuple[float, ...] = ()  # uneven: each replica's share of the arrivals, in the order they started
    seed: int = 0  # uneven: the routing's random stream

    def __post_init__(self) -> None:
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {', '.join(BALANCERS)}, got {self.balancer!r}")
        if self.balancer == "uneven" and (len(self.weights) != self.replicas or min(self.weights) < 0
                                          or sum(self.weights) <= 0):
            raise ValueError(f"uneven routing needs one non-negative weight per replica ({self.replicas}), "
                             f"got {self.weights!r}")
        self._rng = random.Random(self.seed)
        self.now = 0.0
        self.generation = 0
        self.pending = deque(sorted(self.requests, key=lambda r: r.arrival))
        self.live: list[Replica] = [self._replica(ready_at=0.0) for _ in range(self.replicas)]
        self.retired: list[Replica] = []  # drained and removed: their records still count
        self.replica_seconds = 0.0
        self._next = 0  # round-robin position
        self.spec_replicas = self.replicas
        self.timeline: list[tuple[float, int, int]] = [(0.0, self.replicas, self.replicas)]  # (t, spec, ready)

    def _replica(self, ready_at: float) -> Replica:
        sim = Simulator(self.cost, [], self.knobs, **self.sim_options)
        sim.now = self.now
        sim.holder.set(SchedulerKnobs(self.knobs.token_budget, self.knobs.max_chunk, self.generation))
        return Replica(sim, ready_at=ready_at, started=self.now)

    # -- routing and time --------------------------------------------------------------------------------
    def _routable(self) -> list[Replica]:
        ready = [r for r in self.live if not r.draining and r.ready_at <= self.now]
        return ready or [r for r in self.live if not r.draining] or self.live

    def _route(self, spec: RequestSpec) -> None:
        targets = self._routable()
        if self.balancer == "round-robin":
            target = targets[self._next % len(targets)]
            self._next += 1
        elif self.balancer == "uneven":
            # a replica beyond the weights (one a scale-up added) gets the mean share
            mean = sum(self.weights) / len(self.weights)
            weights = [self.weights[self.live.index(r)] if self.live.index(r) < len(self.weights) else mean
                       for r in targets]
            target = self._rng.choices(targets, weights=weights)[0]
        else:
            target = min(targets, key=lambda r: r.sim.in_system)
        target.sim.pending.append(spec)

    def _step_to(self, t: float) -> None:
        for r in self.live:
            r.sim.advance(t)
        self.replica_seconds += len(self.live) * max(0.0, t - max(self.now, self.count_from))
        self.now = t
        for r in [r for r in self.live if r.draining and r.sim.in_system == 0 and not r.sim.scheduler.has_work]:
            self.live.remove(r)
            self.retired.append(r)

    def advance(self, until: float) -> None:
        while self.pending and self.pending[0].arrival <= until:
            spec = self.pending.popleft()
            self._step_to(max(self.now, spec.arrival))
            self._route(spec)
        self._step_to(max(self.now, until))
        self._note()

    def _note(self) -> None:
        ready = self.ready
        if (self.spec_replicas, ready) != self.timeline[-1][1:]:
            self.timeline.append((self.now, self.spec_replicas, ready))

    # -- replicas and knobs --------------------------------------------------------------------------------
    @property
    def ready(self) -> int:
        return sum(1 for r in self.live if not r.draining and r.ready_at <= self.now)

    def scale(self, replicas: int) -> None:
        serving = [r for r in self.live if not r.draining]
        if replicas > len(serving):
            self.live += [self._replica(ready_at=self.now + self.startup) for _ in range(replicas - len(serving))]
        for r in serving[replicas:]:  # the newest (the list's tail) drain first, as a ReplicaSet's youngest pods
            r.draining = True
        self.spec_replicas = replicas
        self._note()

    def set_knobs(self, knobs: Knobs) -> int:
        self.knobs = knobs
        self.generation += 1
        for r in self.live:
            r.sim.holder.set(SchedulerKnobs(knobs.token_budget, knobs.max_chunk, self.generation))
        return self.generation

    # -- measurement ---------------------------------------------------------------------------------------
    def _all_sims(self) -> list[Simulator]:
        return [r.sim for r in self.live + self.retired]

    def window(self, seconds: float, slo: SLOTargets) -> Window:
        w = window_over(self._all_sims(), self.now, seconds, slo)
        return replace(w, pods=max(1, self.ready))

    def context(self, seconds: float) -> Context | None:
        pods = max(1, self.ready)
        model = model_over(self._all_sims(), self.now, seconds)
        load = load_over(self._all_sims(), self.now, seconds, pods=pods)
        if not load.prompts or model is None:
            return None
        return Context(model=model, load=load, pods=pods)

    def records(self) -> list[RequestRecord]:
        return sorted((rec for s in self._all_sims() for rec in s.records), key=lambda r: r.start)

    def run(self) -> list[RequestRecord]:
        while self.pending or any(r.sim.scheduler.has_work for r in self.live):
            self.advance(self.now + 60.0)
        return self.records()


class FleetScaler:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def replicas(self) -> ReplicaCount:
        return ReplicaCount(spec=self.fleet.spec_replicas, ready=self.fleet.ready)

    def scale(self, replicas: int, version: str | None = None) -> bool:
        self.fleet.scale(replicas)  # the simulator has no other writer
        return True

    def refused(self) -> str:
        return ""


@dataclass(frozen=True)
class QueueScaler:
    """The replicas-only baseline: an HPA on the mean waiting queue per pod (vLLM production-stack's and KEDA's
    usual signal), desired = ceil(current x metric / target), every `period` seconds, with the HPA's 10 %
    tolerance and its default stabilization (none up, 300 s down)."""

    target: float  # waiting requests per pod
    min_replicas: int = 1
    max_replicas: int = 4
    period: float = 15.0
    down_stabilization: float = 300.0
    tolerance: float = 0.1

    def run(self, fleet: Fleet, until: float) -> None:
        history: list[tuple[float, int]] = []
        while fleet.now < until:
            fleet.advance(min(until, fleet.now + self.period))
            serving = [r for r in fleet.live if not r.draining and r.ready_at <= fleet.now]
            current = fleet.spec_replicas
            waiting = sum(len(r.sim.scheduler.waiting) + len(r.sim.pending) for r in serving) / max(1, len(serving))
            ratio = waiting / self.target
            proposal = current if abs(ratio - 1) <= self.tolerance else math.ceil(current * ratio)
            proposal = max(self.min_replicas, min(self.max_replicas, proposal))
            history = [(t, r) for t, r in history if fleet.now - t <= self.down_stabilization] + [(fleet.now, proposal)]
            desired = proposal if proposal >= current else max(r for _, r in history)
            if desired != current:
                fleet.scale(desired)
