"""Replicas as the tuner's last knob, as pure functions: how many pods the load needs at the best knobs, and what to
ask for after HPA-style stabilization and a scale-down hysteresis.

* The knobs come first: replicas are judged at the best knobs the tuner has (measured, else predicted), and the
  tuner asks for more pods only when those knobs, spread over the pods that run, are predicted to break an SLO or
  leave prefill busier than `target_utilization`.
* Scaling down needs the SLOs predicted to hold on fewer pods with room to spare: utilization within
  DOWN_HYSTERESIS of the target (HPA's own tolerance is 10 %), so that a deployment just at the target does not
  flap between n and n + 1.
* When no replica count up to guide.REPLICAS_CAP is predicted to keep the SLOs (a single request is too slow for
  them), more pods cannot help: the count is held, never raised towards maxReplicas, and the reason says so. The
  tuner never asks for more pods than a count it evaluated as fitting, or one more after a measured breach.
* Stabilization has the HPA's semantics (behavior.scaleUp/scaleDown.stabilizationWindowSeconds): scale up to the
  lowest recommendation of the up window, down to the highest of the down window.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.tuner import guide
from chunkpilot.tuner.measurement import SLOTargets
from chunkpilot.tuner.predictor import Load
from chunkpilot.tuner.space import Knobs

MODES = ("off", "recommend", "auto")
DOWN_HYSTERESIS = 0.8  # scale down only when fewer pods stay within this share of the target utilization


@dataclass(frozen=True)
class ScalingPolicy:
    mode: str = "off"  # off | recommend | auto
    min_replicas: int = 1
    max_replicas: int = 4
    up_stabilization: float = 0.0  # seconds
    down_stabilization: float = 300.0
    target_utilization: float = 0.8  # the prefill headroom the tuner keeps for knobs (MAX_PREFILL_UTILIZATION)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"autoscaling mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= minReplicas <= maxReplicas, got {self.min_replicas} and {self.max_replicas}")
        if not 0 < self.target_utilization < 1:
            raise ValueError(f"targetPrefillUtilization must be in (0, 1), got {self.target_utilization}")

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Decision:
    desired: int  # within the bounds, after stabilization: what to ask for
    needed: int | None  # before the bounds and stabilization (None: more pods would not help)
    recommendation: int  # this window's, bounded, before stabilization
    reason: str

    @property
    def helps(self) -> bool:
        """False when no replica count is predicted to keep the SLOs: the count is held."""
        return self.needed is not None


def spread(context: guide.Context, pods: int) -> guide.Context:
    """The deployment's whole load (per-pod load times the pods measured) spread evenly over `pods`."""
    load, total = context.load, max(1, context.pods)
    return guide.Context(context.model, Load(request_rate=load.request_rate * total / pods, prompts=load.prompts,
                                             running=load.running * total / pods, mean_context=load.mean_context),
                         pods)


def fits(context: guide.Context, pods: int, knobs: Knobs, slo: SLOTargets, target: float,
         observations: list[guide.Observation] = ()) -> bool:
    """`knobs` on `pods` pods: every SLO predicted kept (the guide's judgement, calibrated) and prefill utilization
    at most `target`."""
    judged = guide.judge(spread(context, pods), knobs, slo, observations)
    return judged.safe and judged.candidate.utilization <= target


def pods_needed(context: guide.Context, knobs: Knobs, slo: SLOTargets, target: float,
                observations: list[guide.Observation] = (), cap: int = guide.REPLICAS_CAP) -> int | None:
    """The fewest pods (1..cap) on which `knobs` fit the whole load; None when not even `cap` would."""
    return next((n for n in range(1, cap + 1) if fits(context, n, knobs, slo, target, observations)), None)


def recommend(context: guide.Context, knobs: Knobs, slo: SLOTargets, policy: ScalingPolicy, current: int,
              observations: list[guide.Observation] = ()) -> tuple[int, int | None, str]:
    """This window's recommendation (bounded), the pods needed (unbounded), and why."""
    up = pods_needed(context, knobs, slo, policy.target_utilization, observations)
    at = f"at {knobs.token_budget}/{knobs.max_chunk}"
    if up is None:
        held = policy.clamp(current)
        return held, None, (f"more replicas would not help: no count up to {guide.REPLICAS_CAP} is predicted to "
                            f"keep the SLOs {at} (a single request is too slow for them); holding {held}")
    if up > current:
        why = f"{up} replicas predicted needed {at} (prefill within {policy.target_utilization:.0%}, SLOs kept)"
        if up > policy.max_replicas:
            why += f"; maxReplicas {policy.max_replicas} is too low for the load"
        return policy.clamp(up), up, why
    down = pods_needed(context, knobs, slo, policy.target_utilization * DOWN_HYSTERESIS, observations) or current
    if down < current:
        return policy.clamp(down), up, (f"{down} replicas predicted to keep the SLOs {at} with prefill within "
                                        f"{policy.target_utilization * DOWN_HYSTERESIS:.0%}")
    return policy.clamp(current), up, f"{current} replicas keep the SLOs {at}"


def stabilize(history: list[tuple[float, int]], now: float, current: int, policy: ScalingPolicy) -> int:
    """HPA semantics over (time, recommendation) pairs: up to the lowest recommendation of the last
    up_stabilization seconds, down to the highest of the last down_stabilization seconds, else stay."""
    up = [r for t, r in history if now - t <= policy.up_stabilization] or [history[-1][1]]
    down = [r for t, r in history if now - t <= policy.down_stabilization] or [history[-1][1]]
    if min(up) > current:
        return policy.clamp(min(up))
    if max(down) < current:
        return policy.clamp(max(down))
    return policy.clamp(current)


class Autoscaler:
    """Remembers the recommendations for stabilization; everything else is the pure functions above."""

    def __init__(self, policy: ScalingPolicy, history: list[tuple[float, int]] | None = None) -> None:
        self.policy = policy
        # kept in place (never rebound): a caller's list outlives this object
        self.history: list[tuple[float, int]] = [] if history is None else history

    def decide(self, context: guide.Context, knobs: Knobs, slo: SLOTargets, current: int, now: float,
               observations: list[guide.Observation] = (), breached: bool = False) -> Decision:
        """`breached`: the last window, measured at `knobs` on `current` pods, broke an SLO. A measurement wins
        over a prediction: then at least one pod more, whatever the model says (the model had said 2 pods for
        the simulator's 2.4 req/s peak on one seed, and the window at 2 pods breached for 13 minutes)."""
        recommendation, needed, reason = recommend(context, knobs, slo, self.policy, current, observations)
        if breached and recommendation <= current and needed is not None:  # (None: no count helps, not even +1)
            recommendation = self.policy.clamp(current + 1)
            needed = max(needed or 0, current + 1)
            reason = (f"the last window at {knobs.token_budget}/{knobs.max_chunk} on {current} replicas broke an SLO "
                      f"(the model said {reason.split(' ')[0]}): one more")
        self.history.append((now, recommendation))
        keep = max(self.policy.up_stabilization, self.policy.down_stabilization)
        self.history[:] = [(t, r) for t, r in self.history if now - t <= keep] or self.history[-1:]
        desired = stabilize(self.history, now, current, self.policy)
        if desired != recommendation:
            reason += (f"; held at {desired} by the {'scale-down' if recommendation < current else 'scale-up'} "
                       f"stabilization window")
        return Decision(desired=desired, needed=needed, recommendation=recommendation, reason=reason)
