"""One measurement window and what the tuner concludes from it: pure functions, the same for Prometheus and for
the simulator."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LatencyTarget:
    percentile: float  # 0.99
    threshold: float  # seconds


@dataclass(frozen=True)
class SLOTargets:
    ttft: LatencyTarget | None = None
    itl: LatencyTarget | None = None


@dataclass(frozen=True)
class Window:
    """What one window measured. Latencies are at the SLO's percentile, over every request (TTFT) and every
    token gap (ITL) observed in the window, as `histogram_quantile` over the window computes them."""

    seconds: float
    requests: int  # requests finished in the window
    request_rate: float  # requests/s arriving (the offered load)
    output_tokens_per_s: float
    goodput: float  # requests/s meeting every SLO
    ttft: float | None = None
    itl: float | None = None
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    backlog_growth: float = 0.0  # requests/s by which the requests in the system (waiting + running) grew

    def to_dict(self) -> dict:
        return asdict(self)


def objective_value(w: Window, objective: str) -> float:
    """What Optuna maximizes. Goodput is told *per offered request* (goodput ÷ arrival rate of the same window):
    windows are short and Poisson arrivals make raw goodput swing ±30 % between windows of the same knobs, while
    the served share of the load barely moves; under a steady load both rank knobs alike (load-aware comparison,
    see loop.py for the rest)."""
    if objective == "goodput":
        return w.goodput / w.request_rate if w.request_rate > 0 else 0.0
    if objective == "throughput":
        return w.output_tokens_per_s
    raise ValueError(f"unknown objective {objective!r}; use goodput or throughput")


# The implicit SLO: knobs that cannot keep up with the load look fine in a short window (the queue is still
# filling) and fail everything minutes later. A queue that grew by more than this share of the window's arrivals
# counts as a violation.
MAX_BACKLOG_SHARE = 0.1


def constraints(w: Window, slo: SLOTargets) -> list[float]:
    """Optuna's convention: each value <= 0 means satisfied. Relative excess over the threshold, so TTFT and
    ITL weigh alike; a missing percentile (no data) counts as violated; last, the keeping-up constraint."""
    out = []
    for target, measured in ((slo.ttft, w.ttft), (slo.itl, w.itl)):
        if target is None:
            continue
        out.append(1.0 if measured is None or math.isnan(measured) else measured / target.threshold - 1.0)
    if w.request_rate > 0:
        out.append(w.backlog_growth / w.request_rate - MAX_BACKLOG_SHARE)
    return out


def feasible(w: Window, slo: SLOTargets) -> bool:
    return all(c <= 0 for c in constraints(w, slo))


def wide_breach(w: Window, slo: SLOTargets, factor: float) -> bool:
    """So far over an SLO (measured > factor × threshold) that the trial is cut short and the best knobs return."""
    return any(c > factor - 1.0 for c in constraints(w, slo))


def load_of(w: Window) -> tuple[float, float, float]:
    return (w.request_rate, w.mean_prompt_tokens, w.mean_output_tokens)


def load_shift(reference: tuple[float, float, float], now: tuple[float, float, float]) -> float:
    """Largest relative change of request rate, mean prompt length or mean output length."""
    shifts = [abs(b - a) / a for a, b in zip(reference, now) if a > 0]
    return max(shifts, default=0.0)
