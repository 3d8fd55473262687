"""Knobs, replicas, or both, on a load ramp that needs 1 -> 3 -> 1 replicas: the three policies of
bench/autoscale.py (and, short and seeded, of tests/tuner/test_autoscale.py), on the same requests and cost.

* knobs-only: the tuner on a fixed replica count (minReplicas).
* replicas-only: vLLM's start-up knobs (token budget 2048, unchunked) and an HPA on the waiting queue per pod
  (fleet.QueueScaler), the signal vLLM production-stack and KEDA examples scale on.
* coordinated: the tuner with autoscaling auto - knobs first, replicas when no knobs keep the SLOs.

Each run reports the share of all requests that met every SLO and the replica-seconds it paid."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.stats import RequestRecord, meets
from chunkpilot.loadgen.workloads import MIXES, SHAPES, Phase, build_workload, scaled
from chunkpilot.tuner.autoscale import ScalingPolicy
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.sim.costmodel import StepCost
from chunkpilot.sim.fleet import Fleet, FleetScaler, QueueScaler
from chunkpilot.sim.simulator import SimActuator, SimMeasurer
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.state import TunerState
from chunkpilot.tuner.study import TunerStudy

START = Knobs(2048, 2048)
SPACE = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)


@dataclass(frozen=True)
class Ramp:
    """Calm at `base` req/s, up to `peak` (about three replicas' worth), calm again; the mixed workload with its
    long prompts scaled to what the CPU cost prefills in seconds (as the tuner-vs-grid harness)."""

    base: float = 0.7
    peak: float = 2.4
    # Served at `base` before the ramp and not counted: a deployment that has run a while, whose tuner has
    # converged (the tuner's first minutes at vLLM's start-up knobs are what tests/tuner/test_guide.py measures).
    lead: float = 900.0
    calm: float = 900.0  # seconds of each calm stretch
    ramp: float = 300.0  # seconds of each ramp (up and down), in steps
    busy: float = 1200.0
    steps: int = 3
    rag_scale: float = 0.25
    seed: int = 0
    ttft: float = 20.0
    itl: float = 0.5

    def phases(self) -> list[Phase]:
        up = [Phase(self.ramp / self.steps, self.base + (self.peak - self.base) * (i + 1) / (self.steps + 1),
                    dict(MIXES["mixed"])) for i in range(self.steps)]
        return ([Phase(self.lead, self.base, dict(MIXES["mixed"])), Phase(self.calm, self.base, dict(MIXES["mixed"]))]
                + up
                + [Phase(self.busy, self.peak, dict(MIXES["mixed"]))] + up[::-1]
                + [Phase(self.calm, self.base, dict(MIXES["mixed"]))])

    @property
    def seconds(self) -> float:
        return sum(p.duration for p in self.phases())

    def requests(self):
        shapes = {"chat": SHAPES["chat"], "rag": scaled(SHAPES["rag"], self.rag_scale, None)}
        return build_workload(self.phases(), vocab_size=49152, seed=self.seed, shapes=shapes)

    def slo(self) -> SLOTargets:
        return SLOTargets.p99(ttft=self.ttft, itl=self.itl)


@dataclass
class PolicyResult:
    policy: str
    attainment: float
    replica_seconds: float
    requests: int
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, spec replicas, ready)
    knobs: list[tuple[float, int, int]] = field(default_factory=list)  # (t, budget, chunk) the tuner applied
    at_lead: Knobs | None = None  # the knobs in effect when the counted part began

    def to_dict(self) -> dict:
        return {"policy": self.policy, "attainment": self.attainment, "replica_seconds": self.replica_seconds,
                "requests": self.requests, "timeline": self.timeline, "knobs": self.knobs,
                "at_lead": [self.at_lead.token_budget, self.at_lead.max_chunk] if self.at_lead else None}


def attainment(records: list[RequestRecord], ramp: Ramp) -> tuple[float, int]:
    """The share of the requests that arrived after the lead-in which met every SLO, and how many arrived."""
    slo = ramp.slo()
    counted = [r for r in records if r.start >= ramp.lead]
    return sum(1 for r in counted if r.end is not None and meets(r, slo)) / max(1, len(counted)), len(counted)


class _Quiet:
    def publish(self, state: TunerState) -> None:
        self.last = state


def _tuned(ramp: Ramp, cost: StepCost, fleet: Fleet, settings: TunerSettings, scaling: ScalingPolicy | None,
           seed: int) -> list[tuple[float, int, int]]:
    slo = ramp.slo()
    study = TunerStudy(":memory:", "scaling", SPACE, slo, settings.objective, seed=seed)
    loop = TunerLoop(settings, SPACE, study, SimActuator(fleet), SimMeasurer(fleet, slo), _Quiet(), slo,
                     scaler=FleetScaler(fleet) if scaling else None, scaling=scaling, clock=lambda: fleet.now)
    knobs = [(0.0, fleet.knobs.token_budget, fleet.knobs.max_chunk)]
    fleet.advance(settings.warmup + settings.window)  # Prometheus holds the minutes before the tuner starts
    while fleet.now < ramp.seconds:
        loop.iterate()
        if (fleet.knobs.token_budget, fleet.knobs.max_chunk) != knobs[-1][1:]:
            knobs.append((fleet.now, fleet.knobs.token_budget, fleet.knobs.max_chunk))
    return knobs


def run_policy(policy: str, ramp: Ramp, cost: StepCost, *, scaling: ScalingPolicy, settings: TunerSettings,
               queue_target: float = 1.0, seed: int = 0, startup: float = 60.0,
               balancer: str = "least-loaded", fixed: Knobs = START) -> PolicyResult:
    """One policy over the whole ramp, then every request left is served to the end (none is dropped). `fixed`:
    the knobs replicas-only keeps (the tuned policies start from START)."""
    replicas = scaling.min_replicas
    fleet = Fleet(cost, ramp.requests(), fixed if policy == "replicas" else START, replicas=replicas, balancer=balancer, startup=startup,
                  sim_options={"max_num_seqs": 64}, count_from=ramp.lead)
    knobs: list[tuple[float, int, int]] = []
    if policy == "knobs":
        knobs = _tuned(ramp, cost, fleet, settings, None, seed)
    elif policy == "replicas":
        QueueScaler(target=queue_target, min_replicas=scaling.min_replicas, max_replicas=scaling.max_replicas,
                    down_stabilization=scaling.down_stabilization).run(fleet, ramp.seconds)
    elif policy == "coordinated":
        knobs = _tuned(ramp, cost, fleet, settings, ScalingPolicy(**{**scaling.__dict__, "mode": "auto"}), seed)
    else:
        raise ValueError(f"policy must be knobs, replicas or coordinated, got {policy!r}")
    spent = fleet.replica_seconds  # what the ramp cost; the drain after it is the same work for every policy
    held = [(b, c) for t, b, c in knobs if t <= ramp.lead]  # the knobs the tuner held when the counting began
    share, counted = attainment(fleet.run(), ramp)
    return PolicyResult(policy, share, spent, counted, fleet.timeline, knobs,
                        Knobs(*held[-1]) if held else fleet.knobs)
