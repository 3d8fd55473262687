"""The latency SLO, the one value type every part judges latency against: the tuner (its constraints, SLOMet, the
status and metrics), the simulator, the load generator's goodput, the demo and the CLI. The API's `spec.slo`
converts to it with `SLOSpec.targets`. Torch-free: operator and tuner images carry this package, not the engine.

The quantile is a fraction (0.99 for p99) everywhere; a text that needs per cent (`p99`, numpy's percentile)
multiplies by 100 where it formats or calls, not in a field of its own."""

from __future__ import annotations

from dataclasses import dataclass

# The quantile an SLO applies to when its author names none: the CRD's default and the CLI's `--itl-slo 0.2`.
DEFAULT_QUANTILE = 0.99


@dataclass(frozen=True)
class LatencyTarget:
    """At most `threshold` seconds at the `quantile` (a fraction, 0 < q < 1: 0.99 is p99) of the latencies."""

    quantile: float
    threshold: float  # seconds


@dataclass(frozen=True)
class SLOTargets:
    """The time-to-first-token and inter-token latency objectives; None: not judged."""

    ttft: LatencyTarget | None = None
    itl: LatencyTarget | None = None

    @classmethod
    def p99(cls, ttft: float | None = None, itl: float | None = None) -> "SLOTargets":
        """Thresholds in seconds (None: not judged), each at the default quantile."""
        return cls(ttft=None if ttft is None else LatencyTarget(DEFAULT_QUANTILE, ttft),
                   itl=None if itl is None else LatencyTarget(DEFAULT_QUANTILE, itl))
