"""Measuring the tuner with the simulator: the exhaustive grid, fixed knobs, and the tuner online, on the same
workload and cost model. Used by bench/tuner_vs_grid.py and (small and seeded) by the tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.loadgen.workloads import MIXES, SHAPES, Phase, build_workload, scaled
from chunkpilot.tuner.history import HistoryEntry
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.measurement import Window
from chunkpilot.sim.costmodel import Contended, StepCost
from chunkpilot.sim.simulator import SimActuator, SimMeasurer, Simulator
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.state import TunerState
from chunkpilot.tuner.study import TunerStudy


@dataclass(frozen=True)
class Scenario:
    rate: float = 1.0  # requests/s
    mix: str = "mixed"
    rag_scale: float = 0.25  # rag prompts of 2k-8k tokens scaled to what a 2-core CPU prefills in seconds
    seed: int = 0
    vocab: int = 49152
    contention: float = 0.0  # each step up to 1 + this times as long, at random (sim.costmodel.Contended)

    def cost(self, cost: StepCost, seed_offset: int = 0) -> StepCost:
        return Contended(cost, self.contention, self.seed + seed_offset) if self.contention else cost

    def workload(self, seconds: float, seed_offset: int = 0):
        shapes = {"chat": SHAPES["chat"], "rag": scaled(SHAPES["rag"], self.rag_scale, None)}
        return build_workload([Phase(seconds, self.rate, dict(MIXES[self.mix]))], vocab_size=self.vocab,
                              seed=self.seed + seed_offset, shapes=shapes)


def evaluate(knobs: Knobs, scenario: Scenario, cost: StepCost, slo: SLOTargets, seconds: float = 600.0,
             warmup: float = 60.0) -> Window:
    """Fixed knobs for the whole run; the window after the warm-up."""
    sim = Simulator(scenario.cost(cost, 1000), scenario.workload(seconds + warmup, seed_offset=1000), knobs)
    sim.advance(warmup + seconds)
    return sim.window(seconds, slo)


class _Quiet:
    def __init__(self) -> None:
        self.last: TunerState | None = None

    def publish(self, state: TunerState) -> None:
        self.last = state


@dataclass
class TuneResult:
    best: Knobs | None
    trials: list[HistoryEntry] = field(default_factory=list)  # every recorded window
    best_after: list[Knobs | None] = field(default_factory=list)  # the incumbent after each iteration


def tune(scenario: Scenario, cost: StepCost, slo: SLOTargets, space: SearchSpace, settings: TunerSettings,
         *, iterations: int, start: Knobs, storage: str = ":memory:", seed: int = 0) -> TuneResult:
    """The tuner online against one long simulated run (the load keeps arriving while it tries knobs)."""
    horizon = iterations * (settings.window + settings.warmup) * 2 + 600
    sim = Simulator(scenario.cost(cost, seed), scenario.workload(horizon), start)
    study = TunerStudy(storage, "sim", space, slo, settings.objective, seed=seed)
    pub = _Quiet()
    loop = TunerLoop(settings, space, study, SimActuator(sim), SimMeasurer(sim, slo), pub, slo)
    # The deployment served at the start-up knobs for a window before the tuner looked (as Prometheus holds the
    # minutes before a tuner starts): the guided tuner's first model and load come from it.
    sim.advance(settings.warmup + settings.window)
    out = TuneResult(best=None)
    for _ in range(iterations):
        loop.iterate()
        b = study.best()
        out.best_after.append(b.knobs if b else None)
    out.best = out.best_after[-1] if out.best_after else None
    out.trials = list(pub.last.history) if pub.last else []
    return out
