"""What the tuning loop is written against: where measurements come from (Measurer, optionally a Forecaster),
where knobs go (Actuator), where its state is reported (Publisher) and, for replicas as the last knob, a Scaler.
Prometheus and a cluster, Prometheus and a knobs file, and the simulator each implement them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from chunkpilot.tuner.measurement import Window
from chunkpilot.tuner.space import Knobs

if TYPE_CHECKING:
    from chunkpilot.tuner import guide
    from chunkpilot.tuner.state import TunerState


class MeasurementUnavailable(RuntimeError):
    """Prometheus unreachable or returned nothing for the window; the message says which."""


class Measurer(Protocol):
    def check(self) -> None: ...  # raises MeasurementUnavailable when no data can be had now
    def wait(self, seconds: float) -> None: ...
    def measure(self, seconds: float) -> Window: ...  # the window of `seconds` that ends now


class Forecaster(Protocol):
    """Optional on a Measurer: the step-time model fitted on the window of `seconds` that ends now and that
    window's load per pod, or None when the window says too little. Without it the loop runs black-box."""
    def context(self, seconds: float) -> guide.Context | None: ...


class Actuator(Protocol):
    def apply(self, knobs: Knobs) -> int: ...  # returns the generation that carries these knobs
    def applied(self, generation: int) -> bool: ...  # every ready pod reports that generation
    def current(self) -> Knobs: ...


class Publisher(Protocol):
    def publish(self, state: TunerState) -> None: ...


@dataclass(frozen=True)
class ReplicaCount:
    spec: int  # the replicas asked for (spec.replicas)
    ready: int  # pods ready to serve
    version: str | None = None  # the resource's resourceVersion when read: a write against it fails if it moved


class Scaler(Protocol):
    """Optional: replicas as the last knob (chunkpilot.tuner.autoscale). `refused` says why the loop may only
    recommend (e.g. an HPA also targets the resource); empty when it may scale."""
    def replicas(self) -> ReplicaCount: ...
    # written only if the resource is still at `version` (None: unconditionally); False when it was not written
    # (it moved meanwhile, or is gone)
    def scale(self, replicas: int, version: str | None = None) -> bool: ...
    def refused(self) -> str: ...
