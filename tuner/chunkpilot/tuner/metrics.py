"""The tuner's own metrics, for the dashboard (trials, objective, best, knobs, phase). One place for the names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.tuner.measurement import objective_value
from chunkpilot.tuner.state import TunerState, status_slo

PREFIX = "chunkpilot:tuner_"
TRIALS = PREFIX + "trials_total"
OBJECTIVE = PREFIX + "objective"
BEST_OBJECTIVE = PREFIX + "best_objective"
TOKEN_BUDGET = PREFIX + "token_budget"
MAX_CHUNK = PREFIX + "max_chunk"
PHASE = PREFIX + "phase"
HEALTHY = PREFIX + "healthy"
SLO_ATTAINMENT = PREFIX + "slo_attainment"
SLO_SECONDS = PREFIX + "slo_seconds"  # the deployment's SLO thresholds, for the dashboard's SLO lines
FEASIBLE = PREFIX + "feasible_knobs"
REPLICAS_NEEDED = PREFIX + "replicas_needed"
# autoscaling (recommend or auto): what an HPA's external metric or KEDA's Prometheus scaler reads, next to the
# replicas that run and the bound, for the dashboard and the alert when the load needs more than maxReplicas
DESIRED_REPLICAS = PREFIX + "desired_replicas"
CURRENT_REPLICAS = PREFIX + "current_replicas"
SCALING_NEEDED_REPLICAS = PREFIX + "scaling_needed_replicas"
MAX_REPLICAS = PREFIX + "max_replicas"
ALL_NAMES = (TRIALS, OBJECTIVE, BEST_OBJECTIVE, TOKEN_BUDGET, MAX_CHUNK, PHASE, HEALTHY, SLO_ATTAINMENT, SLO_SECONDS,
             FEASIBLE, REPLICAS_NEEDED, DESIRED_REPLICAS, CURRENT_REPLICAS, SCALING_NEEDED_REPLICAS, MAX_REPLICAS)
PHASES = ("Exploring", "Exploiting", "Holding", "Advisory", "Scaling")
LABELS = ["namespace", "deployment"]


class TunerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # prometheus_client appends _total itself; give it the base name.
        self.trials = Counter(TRIALS.removesuffix("_total"), "Tuner windows by result (complete, cut, thin, "
                              "exploit, observed).", LABELS + ["result"], registry=r)
        self.objective = Gauge(OBJECTIVE, "Objective of the last window.", LABELS, registry=r)
        self.best = Gauge(BEST_OBJECTIVE, "Objective of the best feasible knobs.", LABELS, registry=r)
        self.budget = Gauge(TOKEN_BUDGET, "Token budget the tuner applied last.", LABELS, registry=r)
        self.chunk = Gauge(MAX_CHUNK, "Max chunk the tuner applied last.", LABELS, registry=r)
        self.phase = Gauge(PHASE, "1 for the tuner's current phase.", LABELS + ["phase"], registry=r)
        self.healthy = Gauge(HEALTHY, "1 while measurements succeed, 0 while holding.", LABELS, registry=r)
        self.attainment = Gauge(SLO_ATTAINMENT, "Share of requests within the SLOs in the last window.", LABELS,
                                registry=r)
        self.slo_seconds = Gauge(SLO_SECONDS, "SLO threshold in seconds (slo=ttft|itl) at its percentile.",
                                 LABELS + ["slo", "percentile"], registry=r)
        self.feasible = Gauge(FEASIBLE, "Model-guided tuning: 1 while some knobs in bounds are predicted (or were "
                              "measured) to keep the SLOs at the measured load, 0 when none are (NoFeasibleKnobs).",
                              LABELS, registry=r)
        self.replicas_needed = Gauge(REPLICAS_NEEDED, "Replicas predicted to meet the SLOs at the closest knobs "
                                     "while no knobs are feasible (absent otherwise).", LABELS, registry=r)
        self.desired_replicas = Gauge(DESIRED_REPLICAS, "Autoscaling: replicas the tuner recommends (recommend) or "
                                      "asks for (auto), within min and max, after stabilization.", LABELS, registry=r)
        self.current_replicas = Gauge(CURRENT_REPLICAS, "Autoscaling: spec.replicas the tuner sees.", LABELS,
                                      registry=r)
        self.scaling_needed = Gauge(SCALING_NEEDED_REPLICAS, "Autoscaling: replicas predicted to keep the SLOs at the "
                                    "best knobs, before the bounds (absent: more would not help).", LABELS, registry=r)
        self.max_replicas = Gauge(MAX_REPLICAS, "Autoscaling: spec.autoscaling.maxReplicas.", LABELS, registry=r)
        self._seen: dict[tuple[str, str], int] = {}

    def update_scaling(self, namespace: str, deployment: str, state: TunerState, max_replicas: int | None) -> None:
        sc = state.scaling
        values = ((self.desired_replicas, sc.desired if sc else None),
                  (self.current_replicas, sc.replicas if sc else None),
                  (self.scaling_needed, sc.needed if sc else None),
                  (self.max_replicas, max_replicas if sc else None))
        _set_or_remove(values, namespace, deployment)

    def update(self, namespace: str, deployment: str, state: TunerState, slo: SLOTargets, objective: str) -> None:
        key = (namespace, deployment)
        for kind, target in (("ttft", slo.ttft), ("itl", slo.itl)):
            if target is not None:
                self.slo_seconds.labels(namespace, deployment, kind, f"{target.quantile:g}").set(target.threshold)
        new = min(state.recorded - self._seen.get(key, 0), len(state.history))
        for entry in state.history[len(state.history) - new:] if new > 0 else []:
            self.trials.labels(namespace, deployment, entry.kind.value).inc()
        self._seen[key] = state.recorded
        if state.current_window is not None:
            self.objective.labels(namespace, deployment).set(objective_value(state.current_window, objective))
            slo_status = status_slo(state.current_window, slo)
            if slo_status is not None and slo_status.attainment is not None:
                self.attainment.labels(namespace, deployment).set(slo_status.attainment)
        if state.best is not None:
            self.best.labels(namespace, deployment).set(state.best.objective)
        if state.current is not None:
            self.budget.labels(namespace, deployment).set(state.current.token_budget)
            self.chunk.labels(namespace, deployment).set(state.current.max_chunk)
        for p in PHASES:
            self.phase.labels(namespace, deployment, p).set(1 if state.phase == p else 0)
        self.healthy.labels(namespace, deployment).set(1 if state.healthy else 0)
        # no stale advice: each series goes away once it says nothing (black-box, advisory, feasible again)
        _set_or_remove(((self.feasible, None if state.feasible is None else int(state.feasible)),
                        (self.replicas_needed, state.replicas_needed)), namespace, deployment)


def _set_or_remove(values, namespace: str, deployment: str) -> None:
    for gauge, value in values:
        if value is not None:
            gauge.labels(namespace, deployment).set(value)
        else:
            try:
                gauge.remove(namespace, deployment)
            except KeyError:
                pass
