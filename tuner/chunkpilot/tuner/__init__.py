"""The Optuna tuner: chooses each deployment's token budget and max chunk from live latency, while it serves.

The names below are the package's public ones (what the demo and other callers use); they load lazily (PEP 562),
so importing one part does not import them all, and the modules keep importing each other directly."""

from __future__ import annotations

from chunkpilot.contract import lazy

_EXPORTS = {
    # the loop and how it is configured and built
    "TunerLoop": "chunkpilot.tuner.loop", "TunerSettings": "chunkpilot.tuner.loop",
    "TuningConfig": "chunkpilot.tuner.config", "build_local": "chunkpilot.tuner.local",
    "FileActuator": "chunkpilot.tuner.local", "MeasurementUnavailable": "chunkpilot.tuner.interfaces",
    # what it tunes and against what
    "Knobs": "chunkpilot.tuner.space", "SearchSpace": "chunkpilot.tuner.space",
    "LatencyTarget": "chunkpilot.contract.slo", "SLOTargets": "chunkpilot.contract.slo",
    "MAX_PREFILL_UTILIZATION": "chunkpilot.tuner.measurement",
    # the step-time model and the predictor
    "StepModel": "chunkpilot.tuner.step_model", "reference_steps": "chunkpilot.tuner.step_model",
    "Load": "chunkpilot.tuner.predictor", "predict": "chunkpilot.tuner.predictor",
    "PRIOR_SPREAD": "chunkpilot.tuner.guide",
    # Prometheus: the queries
    "PrometheusSource": "chunkpilot.tuner.prometheus", "quantile_query": "chunkpilot.tuner.prometheus",
    "step_moments_query": "chunkpilot.tuner.prometheus",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy.exports(__name__, _EXPORTS)
