"""What the tuner tells the world after every step: turned into `status.tuning`, `status.slo` and the Tuning and
SLOMet conditions (cluster), a line of log and a JSON file (local), and the tuner's own metrics. Built as the API's
own status models (chunkpilot.api), the one owner of those shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkpilot.api.types import (AutoscalingStatus, ClassSLOStatus, Condition, ConditionType, KnobsMeasurement,
                                  SLOStatus, TuningStatus)
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.tuner.history import HistoryEntry
from chunkpilot.tuner.measurement import ClassWindow, Window, slo_met
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.study import Measured


@dataclass
class TunerState:
    mode: str
    phase: str = "Exploring"  # Exploring | Exploiting | Holding | Advisory | Scaling
    trial: int = 0  # completed trials, all epochs
    epoch: int = 0
    current: Knobs | None = None
    current_window: Window | None = None
    current_feasible: bool | None = None  # the tuner's judgement of that window (margin, keeping up, headroom)
    best: Measured | None = None
    recommendation: Knobs | None = None
    last_change: str | None = None
    reason: str = ""
    healthy: bool = True  # False while measurements fail (Tuning=False)
    history: list[HistoryEntry] = field(default_factory=list)  # recent windows, for the local report
    recorded: int = 0  # windows recorded since start (history keeps only the last 1000)
    # model-guided tuning: whether any knobs are predicted (or measured) to keep the SLOs at the measured load,
    # the replicas that would be needed when none are, why, and how many candidates are allowed now
    feasible: bool | None = None
    replicas_needed: int | None = None
    feasible_reason: str = ""
    predicted_safe: int | None = None
    scaling: ScalingState | None = None  # replicas as the last knob (None: autoscaling off)


@dataclass
class ScalingState:
    mode: str  # recommend | auto (auto refused: recommend, with refused saying why)
    replicas: int | None = None  # spec.replicas seen
    ready: int | None = None
    desired: int | None = None
    needed: int | None = None
    reason: str = ""
    refused: str = ""  # why auto is not in effect (e.g. an HPA targets the resource)
    refused_reason: str = "ConflictingAutoscaler"  # the Autoscaling condition's reason while refused
    helps: bool = True  # False: no replica count is predicted to keep the SLOs, the count is held
    not_ready_long: bool = False  # pods not ready past the readiness timeout: tuning goes on the ready ones
    last_scale: str | None = None


def _measurement(knobs: Knobs, window: Window | dict | None, objective: float | None,
                 is_feasible: bool | None) -> KnobsMeasurement:
    w = window.to_dict() if isinstance(window, Window) else (window or {})
    return KnobsMeasurement(token_budget=knobs.token_budget, max_chunk=knobs.max_chunk,
                            disagg_threshold=knobs.disagg_threshold, prefill_pods=knobs.prefill_pods,
                            prefill_token_budget=knobs.prefill_budget,
                            objective=objective,
                            ttft_seconds=w.get("ttft"), itl_seconds=w.get("itl"), feasible=is_feasible)


def status_tuning(state: TunerState, slo: SLOTargets, objective: str) -> TuningStatus:
    from chunkpilot.tuner.measurement import objective_value

    out = TuningStatus(mode=state.mode, phase=state.phase, trial=state.trial, reason=state.reason[:1024],
                       last_change=state.last_change or None)
    if state.feasible is not None:
        out.feasible = state.feasible
        out.replicas_needed = state.replicas_needed
    if state.current is not None:
        w = state.current_window
        out.current = _measurement(state.current, w, objective_value(w, objective) if w else None,
                                   state.current_feasible if w else None)
    if state.best is not None:
        out.best = _measurement(state.best.knobs, state.best.window, state.best.objective, state.best.feasible)
    if state.recommendation is not None:
        out.recommendation = _measurement(state.recommendation, None, None, None)
    return out


def status_autoscaling(state: TunerState) -> AutoscalingStatus | None:
    sc = state.scaling
    if sc is None:
        return None
    return AutoscalingStatus(mode=sc.mode, desired_replicas=sc.desired, needed_replicas=sc.needed,
                             current_replicas=sc.replicas, last_scale_time=sc.last_scale,
                             reason=(f"{sc.refused}; " if sc.refused else "") + sc.reason[:900])


def status_slo(window: Window | None, slo: SLOTargets) -> SLOStatus | None:
    if window is None:
        return None
    out = SLOStatus(window_seconds=int(window.seconds), ttft_seconds=window.ttft, itl_seconds=window.itl)
    if window.request_rate > 0 and window.requests > 0:
        # goodput over completed requests per second = the share of requests within every SLO
        completed_rate = window.requests / window.seconds
        out.attainment = max(0.0, min(1.0, window.goodput / completed_rate))
    if window.classes:
        out.classes = [ClassSLOStatus(name=c.name, ttft_seconds=c.ttft, itl_seconds=c.itl, attainment=c.attainment,
                                      met=class_met(c)) for c in window.classes]
    return out


def class_met(c: ClassWindow) -> bool | None:
    """A class's latencies within its own thresholds; None when the window saw none of its latencies."""
    judged = [(t, v) for t, v in ((c.ttft_slo, c.ttft), (c.itl_slo, c.itl)) if t is not None and v is not None]
    return all(v <= t for t, v in judged) if judged else None


def _class_part(c: ClassWindow) -> str:
    got = [f"{what} {v:.3f}s (SLO {t:g}s)" for what, t, v in (("TTFT", c.ttft_slo, c.ttft), ("ITL", c.itl_slo, c.itl))
           if t is not None and v is not None]
    shed = ", sheddable" if c.sheddable else ""
    kept = "" if c.attainment is None else f", {100 * c.attainment:.0f}% kept"
    return f"{c.name}{shed}: {', '.join(got) or 'no traffic'}{kept}"


def _class_parts(window: Window) -> list[str]:
    """Each class's measurement for the SLOMet message, the breached non-sheddable ones first."""
    return [_class_part(c) for c in sorted(window.classes, key=lambda c: (c.sheddable or class_met(c) is not False))]


def conditions(state: TunerState, slo: SLOTargets) -> list[Condition]:
    if not state.healthy:
        reason = "MeasurementsUnavailable"
    else:  # an SRE alerting on the reason sees that no knobs can do it, not just that the tuner is exploring
        reason = "NoFeasibleKnobs" if state.feasible is False else state.phase
    tuning = Condition(type=ConditionType.TUNING, status="True" if state.healthy and state.mode != "off" else "False",
                       reason=reason, message=state.reason[:1024])
    scaling = [] if state.scaling is None else [_autoscaling_condition(state.scaling)]
    w = state.current_window
    if w is None:
        return [tuning, *scaling, Condition(type=ConditionType.SLO_MET, status="Unknown", reason="NotMeasured",
                                  message="no window measured yet")]
    ok = slo_met(w, slo)
    if w.classes:  # every class, the breached ones first: the one SLOMet answers for all non-sheddable classes
        message = "; ".join(_class_parts(w))
    else:
        parts = []
        if slo.ttft is not None and w.ttft is not None:
            parts.append(f"TTFT p{slo.ttft.quantile * 100:g} {w.ttft:.3f}s (SLO {slo.ttft.threshold:g}s)")
        if slo.itl is not None and w.itl is not None:
            parts.append(f"ITL p{slo.itl.quantile * 100:g} {w.itl:.3f}s (SLO {slo.itl.threshold:g}s)")
        message = ", ".join(parts) or "no latency measured"
    return [tuning, *scaling, Condition(type=ConditionType.SLO_MET, status="True" if ok else "False",
                              reason="WithinSLO" if ok else "SLOBreached", message=message[:1024]),
            *(_class_condition(c) for c in w.classes)]


def _class_condition(c: ClassWindow) -> Condition:
    """SLOMet.<class>: this class's own SLOs over the window (a sheddable class's too: reported, not judged)."""
    met = class_met(c)
    status, reason = {True: ("True", "WithinSLO"), False: ("False", "SLOBreached"),
                      None: ("Unknown", "NoTraffic")}[met]
    return Condition(type=ConditionType.slo_met_of(c.name), status=status, reason=reason,
                     message=_class_part(c)[:1024])


def _autoscaling_condition(sc: ScalingState) -> Condition:
    """Autoscaling=False while auto is refused (ConflictingAutoscaler, AdvisoryTuning); else True:
    ReplicasWouldNotHelp when no count is predicted to keep the SLOs (held), ReplicasNotReady when pods have not
    been ready past the readiness timeout (tuning and scaling go on from the ready ones), AtMaxReplicas; earlier:
    ReplicasWouldNotHelp when no count is predicted to keep the SLOs (held), AtMaxReplicas when the load needs more
    than the bound allows, Scaling while the replicas differ from the desired, Recommending, Stable."""
    if sc.refused:
        return Condition(type=ConditionType.AUTOSCALING, status="False", reason=sc.refused_reason,
                         message=sc.refused[:1024])
    if not sc.helps:
        reason = "ReplicasWouldNotHelp"
    elif sc.not_ready_long:
        reason = "ReplicasNotReady"
    elif sc.needed is not None and sc.desired is not None and sc.needed > sc.desired:
        reason = "AtMaxReplicas"
    elif sc.mode == "recommend":
        reason = "Recommending"
    elif sc.desired is not None and (sc.replicas != sc.desired or (sc.ready or 0) < (sc.replicas or 0)):
        reason = "Scaling"
    else:
        reason = "Stable"
    return Condition(type=ConditionType.AUTOSCALING, status="True", reason=reason, message=sc.reason[:1024])


def dump(model) -> dict:
    """A status model as the API (and the local status file) spells it: camelCase, with only the fields that were
    set and not None, because it goes out as a merge patch (a default would overwrite what is there)."""
    return model.model_dump(by_alias=True, exclude_none=True, exclude_unset=True)
