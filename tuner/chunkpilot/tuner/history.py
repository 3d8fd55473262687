"""Why a trial was asked (`TrialKind`, stored with the trial by study.py and chosen by choice.py), and one recorded
window, as the tuning loop keeps it (`TunerState.history`), the study remembers it (study.py) and
the status file, the demo's report and the benchmarks read it. `HistoryEntry.to_dict` is the one serialized shape
(the study's memory, the local status file, the demo's JSON, bench results); `from_dict` reads it back."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chunkpilot.tuner.measurement import Window, window_of
from chunkpilot.tuner.space import Knobs


class TrialKind(StrEnum):
    """Why a trial was queued (stored as the trial's `kind`; str-valued so the study holds the same string).
    Optuna's own asks have no kind."""

    INCUMBENT = "incumbent"  # the best knobs measured again (load-aware comparison), or a new epoch's seed
    PREDICTED = "predicted"  # the step-time model's pick among the allowed knobs
    IDENTIFY = "identify"  # safe knobs whose steps pin down a term the pick turns on
    CLOSEST = "closest"  # nothing allowed: the knobs closest to keeping the SLOs
    OBSERVED = "observed"  # advisory: the knobs that run
    RESUMED = "resumed"  # Optuna's ask an earlier tuner left running, queued again
    # disaggregation auto: the running (or best) budget and chunk with no prompt sent to a prefill pod, measured
    # first in every epoch, so that a split is kept only where it measured better than colocated
    COLOCATED = "colocated"

    @property
    def unscreened(self) -> bool:
        """Tried as asked: the tuner (or the tuner before a restart) chose these knobs itself."""
        return self in (TrialKind.INCUMBENT, TrialKind.PREDICTED, TrialKind.IDENTIFY, TrialKind.RESUMED,
                        TrialKind.COLOCATED)


class WindowKind(StrEnum):
    """What a recorded window was (str-valued: the stored and serialized entries carry the string)."""

    COMPLETE = "complete"  # a trial's whole window, told to Optuna
    CUT = "cut"  # a trial's probe that breached an SLO widely, told as cut short
    THIN = "thin"  # a trial's window with too few requests: failed, not a result
    BASELINE = "baseline"  # the running knobs, measured once before any model could be fitted
    EXPLOIT = "exploit"  # the best knobs, held
    OBSERVED = "observed"  # advisory: the knobs that run, told as a trial

    @property
    def told(self) -> bool:
        """The study holds this window as a trial already (its load is in the epoch's reference load)."""
        return self in (WindowKind.COMPLETE, WindowKind.CUT, WindowKind.OBSERVED)

    @property
    def trial(self) -> bool:
        """A window of a trial the tuner tried (told, cut or thin): what a tuning run costs the deployment."""
        return self in (WindowKind.COMPLETE, WindowKind.CUT, WindowKind.THIN)


@dataclass(frozen=True)
class Forecast:
    """The step-time model's prediction for the window's knobs at the window's own load: what calibrates the
    guided tuner's predictions, and how far to trust them."""

    itl: float  # predicted ITL p99, seconds
    ttft: float | None  # predicted TTFT p99, seconds (None: past capacity)
    utilization: float  # predicted prefill utilization
    capacity: float  # predicted prefill capacity of the whole deployment, prompt tokens/s
    model_error: float  # the step-time fit's relative error

    def to_dict(self) -> dict:
        return {"predicted_itl": self.itl, "predicted_ttft": self.ttft, "predicted_utilization": self.utilization,
                "predicted_capacity": self.capacity, "step_model_error": self.model_error}


@dataclass(frozen=True)
class Screening:
    """What the guide judged before the window (guided tuning only)."""

    allowed: int  # knobs allowed (predicted or measured safe) at the last ask
    feasible_knobs: bool | None  # whether any were

    def to_dict(self) -> dict:
        return {"allowed": self.allowed, "feasible_knobs": self.feasible_knobs}


@dataclass(frozen=True)
class HistoryEntry:
    epoch: int
    kind: WindowKind
    knobs: Knobs
    feasible: bool  # the tuner's judgement of the window (margin, keeping up, headroom)
    window: Window
    forecast: Forecast | None = None  # None: the measurer cannot forecast, or the window said too little
    screening: Screening | None = None  # None: nothing was screened yet (black-box, or before the first screen)

    def to_dict(self) -> dict:
        """The flat shape every reader of the serialized history knows: the window's fields beside the entry's."""
        return {"epoch": self.epoch, "kind": self.kind.value, "token_budget": self.knobs.token_budget,
                "max_chunk": self.knobs.max_chunk,
                # only where the threshold is searched: every other entry keeps the shape its readers know
                **({} if self.knobs.disagg_threshold is None else {"disagg_threshold": self.knobs.disagg_threshold}),
                **({} if self.knobs.prefill_pods is None else {"prefill_pods": self.knobs.prefill_pods}),
                **({} if self.knobs.prefill_budget is None else {"prefill_budget": self.knobs.prefill_budget}),
                "feasible": self.feasible, **self.window.to_dict(),
                **(self.forecast.to_dict() if self.forecast is not None else {}),
                **(self.screening.to_dict() if self.screening is not None else {})}

    @classmethod
    def from_dict(cls, d: dict) -> HistoryEntry:
        forecast = None if "predicted_itl" not in d else Forecast(
            d["predicted_itl"], d.get("predicted_ttft"), d.get("predicted_utilization"), d.get("predicted_capacity"),
            d.get("step_model_error"))
        screening = Screening(d["allowed"], d.get("feasible_knobs")) if "allowed" in d else None
        return cls(epoch=d["epoch"], kind=WindowKind(d["kind"]), knobs=Knobs(d["token_budget"], d["max_chunk"], d.get("disagg_threshold"),
                                                                     d.get("prefill_pods"), d.get("prefill_budget")),
                   feasible=d["feasible"], window=window_of(d), forecast=forecast, screening=screening)
