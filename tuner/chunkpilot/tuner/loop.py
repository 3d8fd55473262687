"""The tuning loop for one deployment, written against small interfaces (chunkpilot.tuner.interfaces) so that the
same code runs against Prometheus and the cluster, Prometheus and a knobs file, or the simulator's virtual clock.
What to do next is decided by chunkpilot.tuner.policy's pure functions over the loop's memory (`memory()`, all of
it rebuilt from the study after a restart), and which knobs a trial tries by chunkpilot.tuner.choice.choose; this
module carries the actions out.

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
* Scaling (with `spec.autoscaling`; chunkpilot.tuner.autoscale.ReplicaCoordinator holds the replicas' state and
  writes): while the replica count changes or not every pod is ready, and for one window after a change, no trial
  runs; after each measured window the replicas the load needs at the best knobs are recommended (and, in auto
  mode, set through the Scaler).

Model-guided (the default, `guidance="model"`; chunkpilot.tuner.guide): before every ask, the step-time model is
refitted on the last three windows and every candidate is judged at 1.5x the measured load. The epoch's first
trial is the predicted best; Optuna's asks that are predicted to breach an SLO are not tried (told to Optuna as pruned, with
their predicted constraints, so the sampler learns where not to go and refines inside the predicted-safe set);
knobs measured in the epoch at about this load count by their measurement. When no knobs are predicted safe and none measured so,
the loop says NoFeasibleKnobs with the replicas needed and applies the closest knobs instead of exploring.
`guidance="blackbox"` is the earlier tuner (Optuna alone), kept for comparison.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

from chunkpilot.contract.knobs import DISAGG_NEVER
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.kube.conditions import now_rfc3339
from chunkpilot.tuner import autoscale, choice, guide, policy, reasons
from chunkpilot.tuner.autoscale import ReplicaCoordinator, ScalingPolicy
from chunkpilot.tuner.history import TrialKind
from chunkpilot.tuner.history import Forecast, HistoryEntry, Screening, WindowKind
from chunkpilot.tuner.interfaces import Actuator, MeasurementUnavailable, Measurer, Publisher, Scaler
from chunkpilot.tuner.predictor import predict
from chunkpilot.tuner.measurement import Window, feasible, slo_met, wide_breach
from chunkpilot.tuner.policy import Outcome
from chunkpilot.tuner.retry import Backoff
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.state import ScalingState, TunerState
from chunkpilot.tuner.study import TunerStudy, kind_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TunerSettings:
    mode: str = "auto"  # auto | advisory
    guidance: str = "model"  # model: try only knobs the step-time model predicts safe | blackbox: Optuna alone
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
    # The guide fits its model and reads the load over this many windows: one window's burst must not make every
    # knob look unsafe (the load is the knobs' input, not their result), and more steps at more knobs fit better.
    lookback_windows: float = 3.0
    apply_timeout: float = 60.0
    # Pods not ready for this long (a crash loop, a node gone) no longer hold tuning: the ready pods are the
    # deployment, as an HPA decides from its ready pods.
    readiness_timeout: float = 600.0
    poll: float = 1.0
    backoff_initial: float = 2.0
    backoff_max: float = 60.0


class TunerLoop:
    def __init__(self, settings: TunerSettings, space: SearchSpace, study: TunerStudy, actuator: Actuator,
                 measurer: Measurer, publisher: Publisher, slo: SLOTargets, scaler: Scaler | None = None,
                 scaling: ScalingPolicy | None = None, clock=None, scaling_history: list | None = None,
                 backoff: Backoff | None = None) -> None:
        """`scaling_history`: the autoscaler's (time, recommendation) list, owned by the caller so that it outlives
        this loop (daemon.tune_one keeps one per resource). `backoff`: the driver's retry state (retry.py), shared
        so that its failures and this loop's outages count as one."""
        self.s = settings
        self.space = space
        self.study = study
        self.actuator = actuator
        self.measurer = measurer
        self.publisher = publisher
        self.slo = slo
        self.state = TunerState(mode=settings.mode, epoch=study.epoch, trial=study.total_completed(),
                                best=study.best())
        if settings.guidance not in GUIDANCE:
            raise ValueError(f"guidance must be one of {', '.join(GUIDANCE)}, got {settings.guidance!r}")
        self.backoff = backoff or Backoff(settings.backoff_initial, settings.backoff_max)
        # What the loop knows besides the trials comes back from the study after a restart: the windows measured
        # next to predicted (they calibrate every prediction), whether the baseline was measured, and how many
        # trials ran since the incumbent was last re-measured.
        self.state.history = study.memory()[-999:]
        epoch_kinds = [h.kind for h in self.state.history if h.epoch == study.epoch]
        # guided: the one window measured before any model could be fitted
        self._baseline = WindowKind.BASELINE in epoch_kinds
        self._breaches = policy.trailing_breaches(self.state.history, study.epoch, slo, settings.min_requests)
        # counted as the running loop counts: whole trials, not those cut short
        told = study.records()
        last = max((i for i, r in enumerate(told) if r.kind == TrialKind.INCUMBENT), default=0)
        self._since_incumbent = sum(1 for r in told[last:] if not r.cut_short)
        # guided needs a measurer that can fit the model (Prometheus, the simulator); others run black-box
        self._guided = settings.guidance == "model" and hasattr(measurer, "context")
        if study.closed_stale:
            self.state.reason = reasons.closed_stale(study.closed_stale)
        # replicas as the last knob: only with a scaler and a policy that is not off
        self._clock = clock or time.monotonic
        self.replicas: ReplicaCoordinator | None = None
        if scaler is not None and scaling is not None and scaling.mode != "off":
            self.state.scaling = ScalingState(mode=scaling.mode)
            self.replicas = ReplicaCoordinator(scaler, scaling, self.state.scaling, settings.readiness_timeout,
                                               self._clock, scaling_history)

    # -- public -----------------------------------------------------------------------------------------
    def memory(self) -> policy.Memory:
        """What the next decision depends on (policy.Memory), read from the study and the replicas now."""
        return policy.Memory(mode=self.s.mode, settled=self.replicas is None or self.replicas.settled(),
                             explored=self.study.explored(), max_trials=self.s.max_trials,
                             since_incumbent=self._since_incumbent, incumbent_every=self.s.incumbent_every,
                             has_best=self.study.best() is not None)

    def iterate(self) -> Outcome:
        try:
            if self.replicas is not None:
                self.replicas.guard(self.s.mode)  # a refusal and the bounds do not wait for measurements
            self.measurer.check()  # blind is no time to move knobs: check before starting anything
            action = policy.next_action(self.memory())
            if isinstance(action, policy.Settle):
                outcome = self._settle()
            elif isinstance(action, policy.Advise):
                outcome = self._advise()
            elif isinstance(action, policy.Explore):
                outcome = self._explore(action)
            else:
                outcome = self._exploit()
            self.backoff.succeeded()
            self.state.healthy = True
            if self.replicas is not None and outcome.measured:
                self._autoscale()
            elif self.replicas is not None and outcome == Outcome.SCALING and self.replicas.waiting_for_pods:
                # pods not ready: decide from the ready ones, as an HPA does; a scale-down (which removes unready
                # pods first) may go on, more pods wait for the deadline
                self._autoscale(settling=True)
        except MeasurementUnavailable as e:
            outcome = self._hold(str(e))
        if self.state.feasible is False and self.state.healthy and self.state.phase == "Exploring":
            self.state.reason = reasons.exploring_infeasible(self.state.feasible_reason, self.state.reason)
        self.state.best = self.study.best()
        self.state.trial = self.study.total_completed()
        self.state.epoch = self.study.epoch
        self.publisher.publish(self.state)
        return outcome

    def run(self, should_stop) -> None:
        while not should_stop():
            self.iterate()

    # -- phases -----------------------------------------------------------------------------------------
    def _explore(self, action: policy.Explore) -> Outcome:
        self.state.phase = "Exploring"
        best = self.study.best()
        if action.remeasure_incumbent:
            self.study.enqueue(best.knobs, TrialKind.INCUMBENT)
            self._since_incumbent = 0
        # an outage here holds (nothing moved yet), rather than asking blind
        context = self._context(self.s.window * self.s.lookback_windows, quiet=False) if self._guided else None
        if policy.needs_baseline(self._guided, context is not None, len(self.study.completed()), self._baseline):
            return self._measure_baseline()
        trial, knobs = self._ask(context)
        try:
            self._apply(knobs)
            self.measurer.wait(self.s.warmup)
            probe_len = self.s.window * self.s.probe_fraction
            self.measurer.wait(probe_len)
            probe = self.measurer.measure(probe_len)
            cut = probe.requests >= max(3, self.s.min_requests * self.s.probe_fraction / 2) and \
                wide_breach(probe, self.slo, self.s.breach_factor)
            if cut:
                self.study.tell(trial, probe, cut_short=True)
                self._record(knobs, probe, WindowKind.CUT)
                self.state.reason = reasons.cut(knobs, self.s.breach_factor)
            else:
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
            return Outcome.TIMEOUT
        if cut:
            # the trial is told: restoring the best knobs is outside it (a slow rollout must not fail a finished
            # trial; an outage here holds, as anywhere)
            if best is not None:
                try:
                    self._apply(best.knobs)
                except TimeoutError as e:
                    self.state.reason += reasons.not_restored(e)
            return Outcome.CUT
        if self.replicas is not None and self.replicas.moved():
            self.study.fail(trial, "the replicas changed during the window")
            self.state.reason = reasons.replicas_moved()
            return Outcome.SCALING
        if window.requests < self.s.min_requests:
            self.study.fail(trial, f"only {window.requests} requests in the window (< {self.s.min_requests})")
            self.state.reason = reasons.thin(window.requests)
            self._record(knobs, window, WindowKind.THIN)
            return Outcome.THIN
        self.study.tell(trial, window)
        self._since_incumbent += 1
        self._record(knobs, window, WindowKind.COMPLETE)
        self.state.reason = reasons.trial(self.study.explored(), self.s.max_trials, self.study.epoch)
        return Outcome.TRIAL

    def _measure_baseline(self) -> Outcome:
        """Guided, with nothing to fit yet (the tuner started with the load): one window at the knobs that run, so
        that the first trial is the predicted best rather than a guess. Recorded, not told as a trial."""
        knobs = self.actuator.current()
        self.measurer.wait(self.s.window)
        window = self.measurer.measure(self.s.window)
        self._baseline = True  # after the measurement: an outage does not use it up
        self._record(knobs, window, WindowKind.BASELINE)
        self.state.reason = reasons.baseline()
        return Outcome.BASELINE

    def _ask(self, context: guide.Context | None):
        """The next trial: choice.choose decides (Optuna's ask, screened by the step-time model when guided);
        this carries it out."""
        made = choice.choose(self._choice_memory(), choice.Observation(context))
        if made.load_moved is not None:
            self.study.new_epoch([])
            self.state.reason = reasons.load_moved(made.load_moved, self.study.epoch)
            log.info("%s", self.state.reason)
        self._colocated_first()
        if made.judgement is None:
            self.state.feasible, self.state.replicas_needed = None, None
        else:
            j = made.judgement
            self.state.predicted_safe = j.allowed
            self.state.feasible, self.state.replicas_needed, self.state.feasible_reason = \
                j.feasible, j.replicas_needed, j.reason
        for note in made.notes:
            log.info("%s", note)
        if made.queue is not None:
            self.study.enqueue(self._at_threshold(made.queue), made.kind)
        if made.screen is None:
            return self.study.ask()
        for _ in range(MAX_REJECTED_ASKS):
            trial, knobs = self.study.ask()
            if made.screen.takes(knobs, kind_of(trial)):
                return trial, knobs
            self.study.reject(trial, *made.screen.rejection(knobs))
        # the sampler keeps asking outside the safe set: the least-pressure allowed knobs not measured yet, else
        # the least-pressure allowed ones
        self.study.enqueue(self._at_threshold(made.screen.fallback), TrialKind.PREDICTED)
        return self.study.ask()

    # -- the disaggregation threshold (searched only in disaggregation mode auto: space.thresholds) -------------
    def _colocated_first(self) -> None:
        """Every epoch measures the colocated point before anything else: the running (or best) budget and chunk
        with no prompt sent to a prefill pod. That is the reference a split must beat under the same SLO rules
        (study.best keeps a split only where it measured better), and the point the tuner falls back to where no
        split pays. Queued as the incumbent is; nothing happens where the threshold is not searched."""
        if not self.space.thresholds:
            return
        if any(r.knobs is not None and r.knobs.colocated for r in self.study.records()):
            return  # measured in this epoch
        if self.study.queued(TrialKind.COLOCATED):
            return  # queued already
        best = self.study.best()
        reference = best.knobs if best is not None else self.space.clamp(self.actuator.current())
        self.study.enqueue(self.space.colocated(reference), TrialKind.COLOCATED)

    def _at_threshold(self, knobs: Knobs) -> Knobs:
        """The choice's picks are (budget, chunk) pairs (choice.py: the model knows no remote prefill): they run
        at the threshold of the best knobs measured, which is never (colocated) until a split measured better."""
        if not self.space.thresholds or knobs.disagg_threshold is not None:
            return knobs
        best = self.study.best()
        return self.space.colocated(knobs) if best is None or best.knobs.colocated else \
            Knobs(knobs.token_budget, knobs.max_chunk, best.knobs.disagg_threshold, best.knobs.prefill_pods,
                  best.knobs.prefill_budget)

    def _choice_memory(self) -> choice.Memory:
        """What choice.choose depends on, read from the study and the recorded windows now. With a searched
        threshold the model judges (budget, chunk) pairs as for colocated pods (choice.py says why): the pairs
        are the grid, and only the colocated trials count as its measurements."""
        measured = self.study.measured()
        if self.space.thresholds:
            measured = [replace(m, knobs=m.knobs.budget_and_chunk) for m in measured if self._colocated(m.knobs)]
        return choice.Memory(guided=self._guided, epoch=self.study.epoch, grid=tuple(self.space.pairs()),
                             slo=self.slo, drift_load_shift=self.s.drift_load_shift, max_trials=self.s.max_trials,
                             splits=bool(self.space.thresholds),
                             trial_windows=tuple(self.study.trial_windows()), measured=tuple(measured),
                             explored=self.study.explored(), waiting=self.study.waiting(),
                             completed_kinds=tuple(r.kind for r in self.study.records()),
                             calibration=tuple(self._observations()))

    def _context(self, seconds: float, quiet: bool = True) -> guide.Context | None:
        context = getattr(self.measurer, "context", None)
        if context is None:
            return None
        try:
            return context(seconds)
        except MeasurementUnavailable:
            if not quiet:
                raise
            return None
        except (ArithmeticError, ValueError) as e:  # a model that cannot be had must never cost a window
            log.warning("no step-time model for this window: %s", e)
            return None

    def _observations(self) -> list[guide.Observation]:
        """This epoch's windows, measured next to predicted (what calibrates the predictions). A window with
        prompts sent to prefill pods is left out: the model predicts a colocated pod, and a split's lighter decode
        steps and remote TTFT would bend its calibration for the colocated knobs it judges."""
        return [guide.Observation(h.knobs.budget_and_chunk, h.forecast.itl, h.window.itl, h.forecast.ttft,
                                  h.window.ttft, h.forecast.capacity, h.window.prefill_capacity)
                for h in self.state.history if h.epoch == self.study.epoch and h.forecast is not None
                and self._colocated(h.knobs)]

    def _colocated(self, knobs: Knobs) -> bool:
        """Measured with every prompt prefilled on the decode pods, as the model predicts. Where the threshold is
        searched, knobs without one are the start-up knobs (the baseline window), which ran at the spec's
        threshold: a split, not colocated. Elsewhere the tuner moves no threshold and every window counts."""
        return knobs.disagg_threshold == DISAGG_NEVER if self.space.thresholds else True

    def _exploit(self) -> Outcome:
        self.state.phase = "Exploiting"
        best = self.study.best()
        reopen = policy.before_exploit(best is not None, self._guided, best is not None and best.feasible,
                                       self.s.max_trials)
        if reopen is not None:
            self.study.new_epoch([])
            self.state.reason = reopen.why
            return Outcome.REOPEN
        if self._guided:  # holding measured-feasible knobs: nothing says NoFeasibleKnobs any more
            self.state.feasible, self.state.replicas_needed, self.state.feasible_reason = True, None, ""
        if self.actuator.current() != best.knobs:
            try:
                self._apply(best.knobs)
            except TimeoutError as e:
                self.state.reason = str(e)
                return Outcome.TIMEOUT
            self.measurer.wait(self.s.warmup)
        self.measurer.wait(self.s.window)
        window = self.measurer.measure(self.s.window)
        self._record(best.knobs, window, WindowKind.EXPLOIT)
        if window.requests < self.s.min_requests:
            self.state.reason = reasons.holding_thin()
            return Outcome.EXPLOIT
        verdict = policy.after_exploit(best.window, window, self.slo, self._breaches,
                                       breach_windows=self.s.drift_breach_windows, shift_limit=self.s.drift_load_shift)
        if isinstance(verdict, policy.Reopen):
            # guided, the new epoch starts from the predicted best at the new load; black-box, from the incumbent
            self.study.new_epoch([] if self._guided else [best.knobs])
            self._breaches = 0
            self.state.reason = reasons.reopened(verdict.why, self.study.epoch)
            return Outcome.REOPEN
        self._breaches = verdict.breaches
        self.state.reason = reasons.holding(best.knobs)
        return Outcome.EXPLOIT

    def _advise(self) -> Outcome:
        self.state.phase = "Advisory"
        self.state.feasible, self.state.replicas_needed = None, None  # advisory changes nothing, screens nothing
        knobs = self.actuator.current()
        self.study.enqueue(knobs, TrialKind.OBSERVED)
        trial, _ = self.study.ask()
        self.study.ran(trial, knobs)  # what really ran (the user's knobs need not lie on the grid)
        self.measurer.wait(self.s.window)
        window = self.measurer.measure(self.s.window)
        if window.requests < self.s.min_requests:
            self.study.fail(trial, "thin window")
            return Outcome.THIN
        self.study.tell(trial, window)
        self._record(knobs, window, WindowKind.OBSERVED)
        best = self.study.best()
        self.state.recommendation = best.knobs if best else None
        self.state.reason = reasons.advisory()
        return Outcome.ADVISE

    def _hold(self, why: str) -> Outcome:
        self.state.phase = "Holding"
        self.state.healthy = False
        pause = self.backoff.failed()
        self.state.reason = reasons.holding_blind(why, pause)
        log.warning("%s", self.state.reason)
        try:
            self.measurer.wait(pause)
        except MeasurementUnavailable:
            pass
        return Outcome.HOLD

    # -- replicas (chunkpilot.tuner.autoscale.ReplicaCoordinator) --------------------------------------------
    def _settle(self) -> Outcome:
        self.state.phase = "Scaling"
        self.state.reason = self.replicas.settling()
        self.measurer.wait(self.s.window)
        return Outcome.SCALING

    def _autoscale(self, settling: bool = False) -> None:
        """After a measured window: the replicas the load needs at the best knobs. Knobs first: while exploring,
        the knobs predicted best at the load now decide, so pods are added only when no knobs in bounds fit the
        pods that run; scaling down waits for the best knobs measured (exploiting)."""
        sc = self.state.scaling
        # the step-time model from the lookback (more steps at more knobs fit better), the load from the window
        # just measured: replicas answer the load now, and three windows of a ramp lag it by a step
        fitted, now = self._context(self.s.window * self.s.lookback_windows), self._context(self.s.window)
        if fitted is None or now is None or sc.replicas is None:
            return
        context = guide.Context(fitted.model, now.load, now.pods)
        best = self.study.best()
        exploring = self.state.phase == "Exploring"
        observations = self._observations()
        if exploring:  # more pods only if no knobs fit the pods that run: the knobs (of the least-pressure few)
            # that need the fewest pods at the load now
            few = [c.knobs for c in guide.screen(context, self.space.pairs(), self.slo, observations)[:8]]
            knobs = min(few, key=lambda k: autoscale.pods_needed(context, k, self.slo,
                                                                 self.replicas.policy.target_utilization,
                                                                 observations) or guide.REPLICAS_CAP + 1)
        else:
            knobs = best.knobs if best is not None and best.feasible else self.actuator.current()
        window = self.state.current_window  # the window just measured, at the knobs that ran
        breached = (self.state.phase == "Exploiting" and window is not None and window.requests >= self.s.min_requests
                    and not slo_met(window, self.slo))
        self.replicas.apply(context, knobs, self.slo, observations, breached=breached, exploring=exploring,
                            settling=settling)

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
                raise TimeoutError(reasons.not_acknowledged(generation, self.s.apply_timeout))
            self.measurer.wait(self.s.poll)
            waited += self.s.poll

    def _record(self, knobs: Knobs, window: Window, kind: WindowKind) -> None:
        screening = None if self.state.predicted_safe is None else Screening(self.state.predicted_safe,
                                                                             self.state.feasible)
        # judged as best() judges (against the epoch's load); a window told as a trial is in that load already
        extra = [] if kind.told else [window.to_dict()]
        ok = feasible(window, self.slo, self.study.reference_demand(extra))
        self.state.current = knobs
        self.state.current_window = window
        self.state.current_feasible = ok
        self.state.recorded += 1
        del self.state.history[:-999]  # the local report needs the recent past, not an unbounded list
        self._remember(HistoryEntry(self.study.epoch, kind, knobs, ok, window, self._forecast(knobs, window.seconds),
                                    screening))

    def _remember(self, entry: HistoryEntry) -> None:
        self.state.history.append(entry)
        self.study.remember(entry)

    def _forecast(self, knobs: Knobs, seconds: float) -> Forecast | None:
        """Predicted next to measured, for every window: how far to trust the step-time model, and what the
        guided tuner calibrates its predictions with. Nothing when the measurer cannot forecast or the window says
        too little."""
        context = self._context(seconds)
        if context is None:
            return None
        try:
            prediction = predict(context.model, knobs, context.load)
        except (ArithmeticError, ValueError) as e:  # a diagnostic must never cost a tuning window
            log.warning("no prediction for %s/%s: %s", knobs.token_budget, knobs.max_chunk, e)
            return None
        ttft = prediction.ttft_p99 if math.isfinite(prediction.ttft_p99) else None  # None: past capacity
        return Forecast(prediction.itl_p99, ttft, prediction.utilization, prediction.prefill_capacity * context.pods,
                        context.model.relative_error)


GUIDANCE = ("model", "blackbox")
MAX_REJECTED_ASKS = 30  # asks screened out per trial before the loop picks the least-pressure untried knobs itself

