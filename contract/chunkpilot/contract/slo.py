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


def kept(slo: SLOTargets, ttft: float | None, gaps: list[float]) -> bool:
    """Whether one finished request kept the SLO: its TTFT within the threshold, and its own inter-token gaps at
    the ITL quantile within the ITL threshold (a request's tail of stalls, not the population's quantile the tuner
    measures). The load generator's goodput and the engine's SLO-met counter judge by it."""
    if slo.ttft is not None and (ttft is None or ttft > slo.ttft.threshold):
        return False
    if slo.itl is not None and gaps:
        import numpy as np

        if float(np.percentile(gaps, slo.itl.quantile * 100)) > slo.itl.threshold:
            return False
    return True


# ---- per-request SLO classes (docs/slo-classes.md) ----------------------------------------------------------
MAX_SLO_CLASSES = 8
IMPLICIT_CLASS = "default"  # the one class of a deployment without sloClasses: spec.slo, today's scheduler
# The headers a request names its class with: chunkpilot's own, then the Gateway API Inference Extension's
# objective and llm-d's spelling of it (a gateway that resolves an InferenceObjective passes its name on).
CLASS_HEADERS = ("x-chunkpilot-slo-class", "x-gateway-inference-objective", "x-llm-d-inference-objective")
# OpenAI's service tiers that mean "whatever the deployment gives by default", not a class of that name.
DEFAULT_TIERS = ("auto", "default")


@dataclass(frozen=True)
class SLOClass:
    """One class of requests: its SLOs and how it is served under contention. `priority` has the Gateway API
    Inference Extension's polarity: higher is more important, below zero is sheddable."""

    name: str
    priority: int = 0
    slo: SLOTargets = SLOTargets()
    # The least share of each step's prompt tokens the class gets while it has prompt work and others compete
    # (0: none guaranteed, strict order). What the shares leave goes by priority, then deadline.
    share: float = 0.0
    # Sheddable classes: requests of the class allowed to wait; beyond it HTTP 429 with Retry-After.
    queue_limit: int | None = None

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    def to_dict(self) -> dict:
        d: dict = {"name": self.name, "priority": self.priority}
        if self.slo.ttft:
            d["ttft"] = {"quantile": self.slo.ttft.quantile, "threshold": self.slo.ttft.threshold}
        if self.slo.itl:
            d["itl"] = {"quantile": self.slo.itl.quantile, "threshold": self.slo.itl.threshold}
        if self.share:
            d["share"] = self.share
        if self.queue_limit is not None:
            d["queue_limit"] = self.queue_limit
        return d


def _target(d: dict | None, where: str) -> LatencyTarget | None:
    if d is None:
        return None
    q, t = d.get("quantile", DEFAULT_QUANTILE), d.get("threshold")
    if not isinstance(t, (int, float)) or t <= 0 or not isinstance(q, (int, float)) or not 0 < q < 1:
        raise ValueError(f"{where}: threshold must be seconds > 0 and quantile a fraction in (0, 1), got {d!r}")
    return LatencyTarget(float(q), float(t))


@dataclass(frozen=True)
class SLOClasses:
    """A deployment's classes and the one a request gets when it names none. The engine's `--slo-classes` (JSON,
    `to_json`), the CRD's spec.sloClasses and the tuner read them through this type."""

    classes: tuple[SLOClass, ...]
    default: str

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not 1 <= len(names) <= MAX_SLO_CLASSES:
            raise ValueError(f"between 1 and {MAX_SLO_CLASSES} SLO classes, got {len(names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"SLO class names must be distinct, got {names}")
        for c in self.classes:
            if not c.name or not all(ch.isalnum() or ch in "-_." for ch in c.name):
                raise ValueError(f"SLO class name {c.name!r}: letters, digits, '-', '_' and '.' only")
            if c.queue_limit is not None and (not c.sheddable or c.queue_limit < 0):
                raise ValueError(f"SLO class {c.name!r}: queueLimit is for sheddable classes (priority below 0) "
                                 f"and must be >= 0")
            if not 0 <= c.share <= 1:
                raise ValueError(f"SLO class {c.name!r}: share must be in [0, 1], got {c.share}")
        if sum(c.share for c in self.classes) > 1 + 1e-9:
            raise ValueError(f"the SLO classes' shares add up to {sum(c.share for c in self.classes):g}; at most 1")
        if self.default not in names:
            raise ValueError(f"the default SLO class {self.default!r} is not one of {names}")

    @classmethod
    def implicit(cls, slo: SLOTargets = SLOTargets()) -> "SLOClasses":
        """One class from the deployment's SLO: exactly the scheduler without classes."""
        return cls((SLOClass(IMPLICIT_CLASS, 0, slo),), IMPLICIT_CLASS)

    @property
    def is_implicit(self) -> bool:
        return len(self.classes) == 1

    def get(self, name: str) -> SLOClass | None:
        return next((c for c in self.classes if c.name == name), None)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.classes]

    def to_json(self) -> str:
        import json

        return json.dumps({"default": self.default, "classes": [c.to_dict() for c in self.classes]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "SLOClasses":
        """`--slo-classes`: {"default": name, "classes": [{name, priority, ttft: {threshold, quantile}, itl,
        share, queue_limit}]}. ValueError says what to change."""
        import json

        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--slo-classes is not JSON: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("classes"), list):
            raise ValueError('--slo-classes must be {"default": NAME, "classes": [{"name": ..., "priority": ...}]}')
        out = []
        for i, c in enumerate(d["classes"]):
            if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                raise ValueError(f"--slo-classes: class {i} needs a name")
            unknown = set(c) - {"name", "priority", "ttft", "itl", "share", "queue_limit"}
            if unknown:
                raise ValueError(f"--slo-classes: class {c['name']!r} has unknown fields {sorted(unknown)}")
            out.append(SLOClass(c["name"], int(c.get("priority", 0)),
                                SLOTargets(_target(c.get("ttft"), f"class {c['name']!r} ttft"),
                                           _target(c.get("itl"), f"class {c['name']!r} itl")),
                                float(c.get("share", 0.0)), c.get("queue_limit")))
        return cls(tuple(out), d.get("default", out[0].name if out else ""))
