"""One factory for a tuning loop, shared by local mode, the cluster daemons and the demo: settings in, a
TunerLoop wired to its study storage, sampler, measurer, actuator and publisher out."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkpilot.contract.slo import DEFAULT_QUANTILE, LatencyTarget, SLOClasses, SLOTargets
from chunkpilot.tuner.autoscale import ScalingPolicy
from chunkpilot.tuner.interfaces import Actuator, Measurer, Publisher, Scaler
from chunkpilot.tuner.loop import TunerLoop, TunerSettings
from chunkpilot.tuner.retry import Backoff
from chunkpilot.tuner.space import SearchSpace
from chunkpilot.tuner.study import TunerStudy


@dataclass(frozen=True)
class TuningConfig:
    deployment: str  # "namespace/name" (the study's name)
    slo: SLOTargets
    budget_bounds: tuple[int, int] = (64, 8192)
    chunk_bounds: tuple[int, int] = (32, 8192)
    step: int = 16  # the KV block size: knobs in whole blocks
    storage: str = "sqlite:///chunkpilot-tuner.db"
    seed: int | None = None
    settings: TunerSettings = field(default_factory=TunerSettings)
    scaling: ScalingPolicy = field(default_factory=ScalingPolicy)  # replicas as the last knob (off by default)
    # disaggregation mode auto (with tuning mode auto): the decode pods' threshold is searched between these
    # uncached-token counts (space.threshold_grid, "never" added); None: not searched, knobs carry no threshold
    threshold_bounds: tuple[int, int] | None = None
    # and the resource's pods, whose split between the roles is searched with it (None: not searched)
    pods: int | None = None
    # cluster mode: the Prometheus selector of the series this resource is judged by (daemon.measurement_selector)
    selector: str | None = None
    # with per-request SLO classes (spec.sloClasses): every non-sheddable class is a constraint at its own SLOs and
    # the objective weighs the classes (measurement.py); spec.slo is measured on the default class
    classes: SLOClasses | None = None

    def space(self) -> SearchSpace:
        return SearchSpace.from_bounds(self.budget_bounds, self.chunk_bounds, self.step,
                                       threshold=self.threshold_bounds, pods=self.pods)


def parse_slo(text: str | None, what: str) -> LatencyTarget | None:
    """'0.99:0.2' (percentile:seconds) or '0.2' (p99) -> LatencyTarget; a clear error otherwise."""
    if not text:
        return None
    try:
        if ":" in text:
            p, t = text.split(":", 1)
            target = LatencyTarget(float(p), float(t))
        else:
            target = LatencyTarget(DEFAULT_QUANTILE, float(text))
    except ValueError:
        raise ValueError(f"--{what}-slo must be PERCENTILE:SECONDS like 0.99:0.2, got {text!r}") from None
    if not 0 < target.quantile < 1 or target.threshold <= 0:
        raise ValueError(f"--{what}-slo needs 0 < percentile < 1 and seconds > 0, got {text!r}")
    return target


def parse_bounds(text: str, what: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--{what} must be MIN:MAX like 64:8192, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--{what} needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def build_loop(config: TuningConfig, actuator: Actuator, measurer: Measurer, publisher: Publisher,
               scaler: Scaler | None = None, scaling_history: list | None = None,
               backoff: Backoff | None = None) -> TunerLoop:
    if config.slo.ttft is None and config.slo.itl is None:
        raise ValueError("tuning needs at least one SLO (TTFT or ITL)")
    space = config.space()
    study = TunerStudy(config.storage, config.deployment, space, config.slo, config.settings.objective,
                       seed=config.seed)
    return TunerLoop(config.settings, space, study, actuator, measurer, publisher, config.slo, scaler=scaler,
                     scaling=config.scaling, scaling_history=scaling_history, backoff=backoff)
