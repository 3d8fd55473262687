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

ReplicaCoordinator is the stateful part the tuning loop holds: it reads and writes the replicas through a Scaler,
tells the loop when the pods settled enough for a trial, and turns a decision into a scale write.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from chunkpilot.api.types import autoscaling_refusal
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.kube.conditions import now_rfc3339
from chunkpilot.tuner import guide, reasons
from chunkpilot.tuner.interfaces import Scaler
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.state import ScalingState

log = logging.getLogger(__name__)

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
    """The deployment's whole load (per-pod load times the pods measured) spread over `pods` as it is spread now
    (the measured imbalance kept: a pod a scale-up adds takes a mean share)."""
    return guide.Context(context.model, context.load.scaled(max(1, context.pods) / pods), pods)


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
    if up is None:
        held = policy.clamp(current)
        return held, None, reasons.replicas_would_not_help(guide.REPLICAS_CAP, knobs, held)
    if up > current:
        return policy.clamp(up), up, reasons.replicas_needed(up, knobs, policy.target_utilization,
                                                             policy.max_replicas)
    down = pods_needed(context, knobs, slo, policy.target_utilization * DOWN_HYSTERESIS, observations) or current
    if down < current:
        return policy.clamp(down), up, reasons.replicas_fewer(down, knobs,
                                                              policy.target_utilization * DOWN_HYSTERESIS)
    return policy.clamp(current), up, reasons.replicas_keep(current, knobs)


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
            predicted = recommendation
            recommendation = self.policy.clamp(current + 1)
            needed = max(needed or 0, current + 1)
            reason = reasons.replicas_breached(knobs, current, predicted)
        self.history.append((now, recommendation))
        keep = max(self.policy.up_stabilization, self.policy.down_stabilization)
        self.history[:] = [(t, r) for t, r in self.history if now - t <= keep] or self.history[-1:]
        desired = stabilize(self.history, now, current, self.policy)
        if desired != recommendation:
            reason += reasons.replicas_stabilized(desired, down=recommendation < current)
        return Decision(desired=desired, needed=needed, recommendation=recommendation, reason=reason)


class ReplicaCoordinator:
    """The tuning loop's replicas: guards the bounds and refusals, says when the pods have settled for a trial
    (count unchanged, every pod ready, a window of warm-up after a change), and decides and writes the replicas
    after a measured window. `scaling` is the loop's ScalingState, updated in place (it is what status shows)."""

    def __init__(self, scaler: Scaler, policy: ScalingPolicy, scaling: ScalingState, readiness_timeout: float,
                 clock, history: list[tuple[float, int]] | None = None) -> None:
        self.scaler, self.scaling, self.readiness_timeout, self._clock = scaler, scaling, readiness_timeout, clock
        self.autoscaler = Autoscaler(policy, history)
        self._seen: int | None = None
        self._serving: int | None = None  # pods a trial's window is measured on: spec, or the ready ones (below)
        self._unready_since: float | None = None
        self.warm = True  # False from a replica change until a window has passed with every pod ready

    @property
    def policy(self) -> ScalingPolicy:
        return self.autoscaler.policy

    @property
    def waiting_for_pods(self) -> bool:
        return self._unready_since is not None

    def guard(self, tuning_mode: str) -> None:
        """Auto mode, every iteration: refused while another autoscaler targets the resource; otherwise
        spec.replicas is kept within [minReplicas, maxReplicas] (as an HPA does; 0 means scaled to zero by hand,
        which pauses autoscaling, as it does an HPA's)."""
        sc = self.scaling
        sc.refused, sc.refused_reason = "", "ConflictingAutoscaler"
        if sc.mode == "auto" and tuning_mode == "advisory":
            # one rule with the CRD's CEL (api.types.autoscaling_refusal): advisory tuning changes nothing, so it
            # does not scale either; it recommends
            sc.refused, sc.refused_reason = autoscaling_refusal(tuning_mode, sc.mode), "AdvisoryTuning"
        elif sc.mode == "auto":
            sc.refused = self.scaler.refused()
        if sc.mode != "auto" or sc.refused:
            return
        r = self.scaler.replicas()
        bounded = self.policy.clamp(r.spec)
        if r.spec > 0 and bounded != r.spec:
            if not self.scaler.scale(bounded, r.version):
                return  # someone changed the replicas since the read: judged again next iteration
            sc.desired, sc.last_scale = bounded, now_rfc3339()
            sc.reason = reasons.replicas_outside_bounds(r.spec, self.policy.min_replicas, self.policy.max_replicas,
                                                        bounded)
            log.info("%s", sc.reason)

    def settled(self) -> bool:
        """True when the replica count has not changed since the last look, every pod is ready, and a window has
        passed since the last change (the window after a scale event is a warm-up: new pods start cold, and the
        load per pod moved)."""
        r = self.scaler.replicas()
        sc = self.scaling
        sc.replicas, sc.ready = r.spec, r.ready
        changed = self._seen is not None and r.spec != self._seen
        self._seen = r.spec
        if r.ready >= r.spec:
            self._unready_since = None
        elif self._unready_since is None or changed:
            self._unready_since = self._clock()
        sc.not_ready_long = self._unready_since is not None and \
            self._clock() - self._unready_since >= self.readiness_timeout
        if changed:
            self.warm, self._serving = False, r.spec
            return False
        if r.ready < r.spec:
            if r.ready == 0 or self._clock() - self._unready_since < self.readiness_timeout:
                self.warm = False
                return False
            if self._serving != r.ready:  # past the deadline: the ready pods are the deployment, from a warm-up on
                self._serving, self.warm = r.ready, False
                return False
            return self.warm
        if self._serving is not None and self._serving < r.spec:  # the others became ready: warm up on all
            self._serving, self.warm = r.spec, False
            return False
        self._serving = r.spec
        return self.warm

    def settling(self) -> str:
        """Why no trial runs now; the window the loop then waits counts as the warm-up where one is due."""
        sc = self.scaling
        if self._serving is not None and sc.ready == self._serving and sc.ready < sc.replicas:
            self.warm = True
            return reasons.replicas_ready_long(sc.ready, sc.replicas, self.readiness_timeout)
        if sc.ready is not None and sc.replicas is not None and sc.ready < sc.replicas:
            return reasons.replicas_not_ready(sc.ready, sc.replicas, self.readiness_timeout)
        self.warm = True  # the window the loop waits next is that warm-up
        return reasons.replicas_changed(sc.replicas)

    def moved(self) -> bool:
        """During a trial: did the replicas change or a pod stop being ready? Then the window says nothing about
        the knobs (and the next one is a warm-up)."""
        r = self.scaler.replicas()
        moved = r.spec != self._seen or r.ready < (self._serving if self._serving is not None else r.spec)
        if moved:
            self.warm = False
        return moved

    def apply(self, context: guide.Context, knobs: Knobs, slo: SLOTargets, observations: list[guide.Observation],
              *, breached: bool, exploring: bool, settling: bool = False) -> None:
        """After a measured window: the replicas the load needs at `knobs` (the loop's pick: the best knobs, or
        while exploring those that need the fewest pods), stabilized; scaling down waits for the best knobs
        (not while exploring), more pods wait while some are not ready (until the readiness timeout). In auto
        mode the count is written, unless refused (then it is only recommended)."""
        sc = self.scaling
        decision = self.autoscaler.decide(context, knobs, slo, sc.replicas, self._clock(), observations,
                                          breached=breached)
        desired, why = decision.desired, decision.reason
        if exploring and desired < sc.replicas:
            desired, why = sc.replicas, why + reasons.scale_down_waits()
        unready_for = self._clock() - self._unready_since if self._unready_since is not None else 0.0
        if settling and desired > sc.replicas and unready_for < self.readiness_timeout:
            desired, why = sc.replicas, why + reasons.more_pods_wait(sc.replicas - (sc.ready or 0),
                                                                    self.readiness_timeout)
        sc.desired, sc.needed, sc.reason, sc.helps = desired, decision.needed, why, decision.helps
        if sc.mode == "auto" and not sc.refused and desired != sc.replicas:
            # decided on the count read before the window: read it again and write against that version, so a
            # person's `kubectl scale` (to 0 in an incident) during the window is never overwritten
            r = self.scaler.replicas()
            if r.spec != sc.replicas:
                sc.reason = why + reasons.scaled_by_someone(r.spec)
                sc.replicas, sc.desired = r.spec, r.spec
                return
            log.info("scaling %d -> %d replicas: %s", sc.replicas, desired, why)
            if self.scaler.scale(desired, r.version):
                sc.last_scale = now_rfc3339()
            else:
                sc.reason = why + reasons.scale_conflict()
