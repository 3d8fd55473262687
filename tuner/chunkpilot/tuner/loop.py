"""The tuning loop for one deployment, written against three small interfaces so that the same code runs against
Prometheus and the cluster, Prometheus and a knobs file, or the simulator's virtual clock.

One `iterate()` is one unit of work:
* Exploring: ask Optuna → apply → wait until every pod reports the generation → skip the warm-up → measure a
  probe (the first third of the window): a wide SLO breach cuts the trial short and restores the best knobs at
  once → measure the whole window → a window with too few requests is not a result (the trial fails) → tell.
  Every `incumbent_every` trials the incumbent is measured again (load-aware comparison: its repeated windows are
  averaged, and the trials around it ran under the same load).
* Exploiting (after max trials): hold the best knobs, keep measuring; a sustained SLO breach or a load shift
  beyond a threshold (rate, prompt or output length) starts a new epoch: a fresh study seeded with the incumbent.
* Holding: measurements failed (Prometheus down, or no data); knobs stay, no trial is recorded, retry with backoff.
* Advisory: measure whatever knobs run, recommend the best feasible seen; change nothing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

from chunkpilot.kube.conditions import now_rfc3339
from chunkpilot.tuner.measurement import SLOTargets, Window, feasible, load_of, load_shift, slo_met, wide_breach
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.state import TunerState
from chunkpilot.tuner.study import TunerStudy

log = logging.getLogger(__name__)


class MeasurementUnavailable(RuntimeError):
    """Prometheus unreachable or returned nothing for the window; the message says which."""


class Measurer(Protocol):
    def check(self) -> None: ...  # raises MeasurementUnavailable when no data can be had now
    def wait(self, seconds: float) -> None: ...
    def measure(self, seconds: float) -> Window: ...  # the window of `seconds` that ends now


class Forecaster(Protocol):
    """Optional on a Measurer: (the predictor's view of `knobs` at the window's load, the step-time model used),
    or None when the window says too little."""
    def forecast(self, knobs: Knobs, seconds: float): ...


class Actuator(Protocol):
    def apply(self, knobs: Knobs) -> int: ...  # returns the generation that carries these knobs
    def applied(self, generation: int) -> bool: ...  # every ready pod reports that generation
    def current(self) -> Knobs: ...


class Publisher(Protocol):
    def publish(self, state: TunerState) -> None: ...


@dataclass(frozen=True)
class TunerSettings:
    mode: str = "auto"  # auto | advisory
    objective: str = "goodput"
    window: float = 60.0
    warmup: float = 10.0
    max_trials: int = 30
    min_requests: int = 20
    breach_factor: float = 2.0  # cut a trial when a percentile exceeds factor × its SLO
    probe_fraction: float = 0.34
    incumbent_every: int = 5
    drift_load_shift: float = 0.5  # relative change of rate / prompt / output length that re-opens exploration
    drift_breach_windows: int = 3  # consecutive windows of the best knobs over a latency SLO re-open exploration
    apply_timeout: float = 60.0
    poll: float = 1.0
    backoff_initial: float = 2.0
    backoff_max: float = 60.0


class TunerLoop:
    def __init__(self, settings: TunerSettings, space: SearchSpace, study: TunerStudy, actuator: Actuator,
                 measurer: Measurer, publisher: Publisher, slo: SLOTargets) -> None:
        self.s = settings
        self.space = space
        self.study = study
        self.actuator = actuator
        self.measurer = measurer
        self.publisher = publisher
        self.slo = slo
        self.state = TunerState(mode=settings.mode, epoch=study.epoch, trial=study.total_completed(),
                                best=study.best())
        self._backoff = settings.backoff_initial
        self._breaches = 0
        self._since_incumbent = 0
        if study.closed_stale:
            self.state.reason = f"closed {study.closed_stale} trial(s) interrupted by a restart"

    # -- public -----------------------------------------------------------------------------------------
    def iterate(self) -> str:
        try:
            self.measurer.check()  # blind is no time to move knobs: check before starting anything
            if self.s.mode == "advisory":
                outcome = self._advise()
            elif self.study.explored() < self.s.max_trials:
                outcome = self._explore()
            else:
                outcome = self._exploit()
            self._backoff = self.s.backoff_initial
            self.state.healthy = True
        except MeasurementUnavailable as e:
            outcome = self._hold(str(e))
        self.state.best = self.study.best()
        self.state.trial = self.study.total_completed()
        self.state.epoch = self.study.epoch
        self.publisher.publish(self.state)
        return outcome

    def run(self, should_stop) -> None:
        while not should_stop():
            self.iterate()

    # -- phases -----------------------------------------------------------------------------------------
    def _explore(self) -> str:
        self.state.phase = "Exploring"
        best = self.study.best()
        if best is not None and self._since_incumbent >= self.s.incumbent_every:
            self.study.enqueue(best.knobs, "incumbent")
            self._since_incumbent = 0
        trial, knobs = self.study.ask()
        try:
            self._apply(knobs)
            self.measurer.wait(self.s.warmup)
            probe_len = self.s.window * self.s.probe_fraction
            self.measurer.wait(probe_len)
            probe = self.measurer.measure(probe_len)
            if probe.requests >= max(3, self.s.min_requests * self.s.probe_fraction / 2) and \
                    wide_breach(probe, self.slo, self.s.breach_factor):
                self.study.tell(trial, probe, cut_short=True)
                self._record(knobs, probe, "cut")
                self.state.reason = (f"trial {knobs.token_budget}/{knobs.max_chunk} breached an SLO by more than "
                                     f"{self.s.breach_factor:g}x: cut short, best knobs restored")
                if best is not None:
                    self._apply(best.knobs)
                return "cut"
            self.measurer.wait(self.s.window - probe_len)
            window = self.measurer.measure(self.s.window)
        except MeasurementUnavailable:
            self.study.fail(trial, "measurements unavailable")
            if best is not None and self.actuator.current() != best.knobs:
                self.actuator.apply(best.knobs)  # back to known-good knobs; no waiting, nothing can confirm it
                self.state.current = best.knobs
            raise
        except TimeoutError as e:
            self.study.fail(trial, str(e))
            self.state.reason = str(e)
            return "timeout"
        if window.requests < self.s.min_requests:
            self.study.fail(trial, f"only {window.requests} requests in the window (< {self.s.min_requests})")
            self.state.reason = f"window too thin ({window.requests} requests): not a trial result"
            self._record(knobs, window, "thin")
            return "thin"
        self.study.tell(trial, window)
        self._since_incumbent += 1
        self._record(knobs, window, "complete")
        self.state.reason = f"trial {self.study.explored()}/{self.s.max_trials} of epoch {self.study.epoch}"
        return "trial"

    def _exploit(self) -> str:
        self.state.phase = "Exploiting"
        best = self.study.best()
        if best is None:  # no trial completed at all (every window thin): nothing to hold yet
            self.study.new_epoch([])
            self.state.reason = "no trial completed within max trials: exploring a new epoch"
            return "reopen"
        if self.actuator.current() != best.knobs:
            self._apply(best.knobs)
            self.measurer.wait(self.s.warmup)
        self.measurer.wait(self.s.window)
        window = self.measurer.measure(self.s.window)
        self._record(best.knobs, window, "exploit")
        if window.requests < self.s.min_requests:
            self.state.reason = "holding the best knobs (window too thin to judge)"
            return "exploit"
        self._breaches = 0 if slo_met(window, self.slo) else self._breaches + 1
        shift = load_shift(_load(best.window), load_of(window))
        if self._breaches >= self.s.drift_breach_windows or shift > self.s.drift_load_shift:
            why = (f"SLO breached in {self._breaches} consecutive windows" if self._breaches >= self.s.drift_breach_windows
                   else f"load moved by {shift:.0%} since the best knobs were measured")
            self.study.new_epoch([best.knobs])
            self._breaches = 0
            self.state.reason = f"{why}: exploring again (epoch {self.study.epoch})"
            return "reopen"
        self.state.reason = f"holding the best knobs {best.knobs.token_budget}/{best.knobs.max_chunk}"
        return "exploit"

    def _advise(self) -> str:
        self.state.phase = "Advisory"
        knobs = self.actuator.current()
        self.study.enqueue(knobs, "observed")
        trial, _ = self.study.ask()
        # what really ran (the user's knobs need not lie on the grid)
        trial.set_user_attr("token_budget", knobs.token_budget)
        trial.set_user_attr("max_chunk", knobs.max_chunk)
        self.measurer.wait(self.s.window)
        window = self.measurer.measure(self.s.window)
        if window.requests < self.s.min_requests:
            self.study.fail(trial, "thin window")
            return "thin"
        self.study.tell(trial, window)
        self._record(knobs, window, "observed")
        best = self.study.best()
        self.state.recommendation = best.knobs if best else None
        self.state.reason = "advisory: recommending the best feasible knobs measured so far; nothing is changed"
        return "advise"

    def _hold(self, why: str) -> str:
        self.state.phase = "Holding"
        self.state.healthy = False
        self.state.reason = f"{why}; keeping the current knobs, retrying in {self._backoff:.0f}s"
        log.warning("%s", self.state.reason)
        try:
            self.measurer.wait(self._backoff)
        except MeasurementUnavailable:
            pass
        self._backoff = min(self._backoff * 2, self.s.backoff_max)
        return "hold"

    # -- helpers ----------------------------------------------------------------------------------------
    def _apply(self, knobs: Knobs) -> None:
        knobs = self.space.clamp(knobs)  # never leave the bounds, whatever asked
        if self.actuator.current() == knobs:
            return
        generation = self.actuator.apply(knobs)
        self.state.current = knobs
        self.state.last_change = now_rfc3339()
        waited = 0.0
        while not self.actuator.applied(generation):
            if waited >= self.s.apply_timeout:
                raise TimeoutError(f"pods did not report knob generation {generation} within "
                                   f"{self.s.apply_timeout:g}s")
            self.measurer.wait(self.s.poll)
            waited += self.s.poll

    def _record(self, knobs: Knobs, window: Window, kind: str) -> None:
        # judged as best() judges (against the epoch's load); a window told as a trial is in that load already
        extra = [] if kind in _TOLD else [window.to_dict()]
        ok = feasible(window, self.slo, self.study.reference_demand(extra))
        self.state.current = knobs
        self.state.current_window = window
        self.state.current_feasible = ok
        self.state.recorded += 1
        del self.state.history[:-999]  # the local report needs the recent past, not an unbounded list
        self.state.history.append({"epoch": self.study.epoch, "kind": kind, "token_budget": knobs.token_budget,
                                   "max_chunk": knobs.max_chunk, "feasible": ok,
                                   **window.to_dict(), **self._forecast(knobs, window.seconds)})

    def _forecast(self, knobs: Knobs, seconds: float) -> dict:
        """Predicted next to measured, for every window: how far to trust the step-time model (it does not
        steer the tuner yet). Nothing when the measurer cannot forecast or the window says too little."""
        forecast = getattr(self.measurer, "forecast", None)
        if forecast is None:
            return {}
        try:
            got = forecast(knobs, seconds)
        except MeasurementUnavailable:
            return {}
        except (ArithmeticError, ValueError) as e:  # a diagnostic must never cost a tuning window
            log.warning("no prediction for %s/%s: %s", knobs.token_budget, knobs.max_chunk, e)
            return {}
        if got is None:
            return {}
        prediction, model = got
        ttft = prediction.ttft_p99 if math.isfinite(prediction.ttft_p99) else None  # None: past capacity
        return {"predicted_itl": prediction.itl_p99, "predicted_ttft": ttft,
                "predicted_utilization": prediction.utilization, "step_model_error": model.relative_error}


_TOLD = ("complete", "cut", "observed")  # _record kinds whose window the study already holds as a trial


def _load(window: dict) -> tuple[float, float, float]:
    return (window.get("request_rate", 0.0), window.get("mean_prompt_tokens", 0.0),
            window.get("mean_output_tokens", 0.0))
