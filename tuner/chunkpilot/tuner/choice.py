"""Which knobs the next trial tries, as one pure function: `choose(memory, observation) -> Choice`. The memory is
what the epoch's study and recorded windows hold (TunerLoop rebuilds it before every ask, so it is the same after a
restart); the observation is the step-time model and the load just measured. No I/O, no Optuna: the loop carries
the choice out (a new epoch, a queued trial, Optuna's ask screened by the allowed set).

Guided (a model could be fitted): every knob is judged by the step-time model at the load with its headroom
(chunkpilot.tuner.guide); knobs measured at about this load count by their measurement. The first trial of an
epoch is the predicted best, unless the pick among the safe knobs turns on a term the steps do not identify
(then those knobs are measured first); when nothing is allowed, the knobs closest to keeping the SLOs. Without a
model, Optuna's ask as it comes.

The disaggregation threshold (searched in disaggregation mode auto) is Optuna's alone: the step-time model is
fitted on the decode pods' own steps and knows nothing of a remote prefill's time or its transfer, so it judges
(token budget, max chunk) as for a colocated pod, which the loop hands in as `grid` (`SearchSpace.pairs`) with only
the colocated windows measured and calibrating. A colocated ask is screened as any; an ask with a finite threshold
is taken as it comes, because the model can say nothing about its TTFT, which the remote prefill and the transfer
make; it is judged by its measurement under the same rules as every trial (the probe's cut, the constraints
Optuna is told, the margin). The choice's own picks are pairs: the loop runs them at the threshold it holds best
(colocated until a split measured better). Where no colocated knobs are predicted to keep the SLOs, the splits are
exactly what may still keep them (a tight ITL with TTFT to spare, TaiChi's case: prefill pods take the prompts'
chunks off the decode pods' steps), so then Optuna explores the splits, colocated asks refused with their predicted
constraints, rather than the closest colocated knobs being tried over and over."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.tuner import guide, reasons
from chunkpilot.tuner.history import TrialKind
from chunkpilot.tuner.measurement import load_of, load_shift
from chunkpilot.tuner.space import Knobs

if TYPE_CHECKING:
    from chunkpilot.tuner.study import Measured


@dataclass(frozen=True)
class Memory:
    """What the choice depends on besides the window just measured: the tuner's settings and what this epoch's
    study and recorded windows hold."""

    guided: bool  # model guidance asked for, with a measurer that can fit the model
    epoch: int
    grid: tuple[Knobs, ...]  # every point of the search space
    slo: SLOTargets
    drift_load_shift: float  # the load headroom of a prediction, and the shift that starts a new epoch
    max_trials: int
    splits: bool = False  # the disaggregation threshold (and split) is searched: there is more than colocated
    trial_windows: tuple[dict, ...] = ()  # the epoch's completed trials' windows (stored dicts)
    measured: tuple[Measured, ...] = ()  # the epoch's completed trials grouped by knobs (TunerStudy.measured)
    explored: int = 0  # trials of this epoch that explored
    waiting: int = 0  # trials queued and not asked yet
    completed_kinds: tuple[TrialKind | None, ...] = ()  # the kinds of the epoch's completed trials, in order
    calibration: tuple[guide.Observation, ...] = ()  # the epoch's windows, measured next to predicted

    def next_epoch(self) -> Memory:
        """The memory of the epoch that opens now: its study holds nothing yet."""
        return replace(self, epoch=self.epoch + 1, trial_windows=(), measured=(), explored=0, waiting=0,
                       completed_kinds=(), calibration=())


@dataclass(frozen=True)
class Observation:
    """What was just measured: the step-time model fitted over the lookback and the load per pod (None: too few
    steps or requests to fit)."""

    context: guide.Context | None


@dataclass(frozen=True)
class Judgement:
    """What the guide concluded about the knobs at this load (status.tuning's feasibility)."""

    allowed: int  # knobs predicted or measured safe
    feasible: bool
    replicas_needed: int | None = None  # when nothing is allowed: the pods the load needs at the closest knobs
    reason: str = ""  # when nothing is allowed: NoFeasibleKnobs' message


@dataclass(frozen=True)
class Screen:
    """Optuna's asks are taken when allowed (or queued by the tuner); the others are rejected with their predicted
    constraints, and after too many rejections the fallback is queued instead."""

    allowed: frozenset[Knobs]
    measured: frozenset[Knobs]  # measured at about this load
    judged: dict[Knobs, guide.Judged] = field(repr=False)
    slo: SLOTargets
    fallback: Knobs  # the least-pressure allowed knobs not measured yet, else the least-pressure allowed ones

    def takes(self, knobs: Knobs, kind: TrialKind | None) -> bool:
        if not knobs.colocated:  # a split: nothing to predict it with (the module's doc), judged when measured
            return True
        return knobs.budget_and_chunk in self.allowed or (kind is not None and kind.unscreened)

    def rejection(self, knobs: Knobs) -> tuple[list[float], str]:
        """The constraints and reason an ask not taken is told with."""
        pair = knobs.budget_and_chunk
        c = self.judged[pair]
        return c.candidate.constraints(self.slo), ("measured infeasible" if pair in self.measured else
                                                   f"predicted pressure {c.pressure:.2f} (> 1)")


@dataclass(frozen=True)
class Choice:
    """The next trial, in the order the loop carries it out: a new epoch (when the load moved), the trial queued
    to be tried next, then Optuna's ask, screened or not."""

    load_moved: float | None = None  # the load moved this far from the epoch's: a new epoch opens first
    queue: Knobs | None = None
    kind: TrialKind | None = None  # the queued trial's
    screen: Screen | None = None  # None: the ask is taken as it comes
    judgement: Judgement | None = None  # None: nothing judged (black-box)
    notes: tuple[str, ...] = ()  # why, for the log


def epoch_load_shift(trial_windows: tuple[dict, ...], context: guide.Context) -> float:
    """How far the load now (rate per pod and mean prompt) is from the mean of the epoch's trial windows; 0
    before any."""
    windows = [w for w in trial_windows if w]
    if not windows:
        return 0.0
    loads = [load_of(w) for w in windows]
    reference = (sum(r for r, _, _ in loads) / len(loads), sum(p for _, p, _ in loads) / len(loads), 0.0)
    now = (context.load.request_rate, context.load.mean_prompt_tokens, 0.0)  # per pod
    return load_shift(reference, now)


def choose(memory: Memory, observation: Observation) -> Choice:
    context = observation.context
    if not memory.guided or context is None:
        return Choice()  # nothing to predict from yet (too few steps or requests): black-box
    shift = epoch_load_shift(memory.trial_windows, context)
    moved = None
    if shift > memory.drift_load_shift:
        # what this epoch measured describes another load: it no longer decides, nor calibrates
        moved, memory = shift, memory.next_epoch()
    m, slo, grid = memory, memory.slo, list(memory.grid)
    calibration = list(m.calibration)
    screened = guide.screen(context, grid, slo, calibration, stress=m.drift_load_shift)
    # A measurement wins over a prediction, where it was taken at about this load (within the drift the
    # tuner tolerates: a calm minute's "feasible" says nothing about a busy one); elsewhere the prediction,
    # calibrated by that window, decides.
    now = (context.load.request_rate, context.load.mean_prompt_tokens, 0.0)  # per pod, as load_of
    on_grid = set(grid)  # advisory mode records the user's knobs, which need not be on it
    measured = {x.knobs: x for x in m.measured if x.knobs in on_grid
                and load_shift(load_of(x.window)[:2] + (0.0,), now) <= m.drift_load_shift}
    allowed = {c.knobs for c in screened if c.safe and c.knobs not in measured}
    allowed |= {k for k, x in measured.items() if x.feasible}
    waiting, queue, kind, notes = m.waiting, None, None, []
    if allowed and allowed <= set(measured) and m.explored < m.max_trials:
        # Measured knobs are judged at the load they met, unmeasured ones with the load headroom: with only
        # the headroom keeping the rest out, the first pick that kept the SLOs would be held for good. The
        # least-pressure knobs predicted safe at the load now may be tried (a breach is cut short as any).
        now_screen = guide.screen(context, grid, slo, calibration)
        more = [c.knobs for c in now_screen if c.safe and c.knobs not in measured]
        if more:
            allowed.add(more[0])
            if not waiting:  # tried next, not left to a draw that may land on the measured pick
                queue, kind, waiting = more[0], TrialKind.PREDICTED, waiting + 1
    if not allowed:
        # closest to keeping the SLOs at the load now (the headroom is for exploring, not for this)
        unstressed = guide.screen(context, grid, slo, calibration)
        closest = guide.closest(unstressed, slo)
        pressure = {c.knobs: c.pressure for c in unstressed}
        # as safe is judged: with the load headroom the tuner keeps
        needed = guide.replicas_needed(guide.stressed(context, m.drift_load_shift), closest, slo, calibration)
        why = reasons.no_feasible_knobs(context.load.request_rate, context.pods, closest, pressure[closest],
                                        len(calibration), needed)
        judgement = Judgement(0, False, needed, why)
        if m.splits and m.explored < m.max_trials:
            # nothing colocated is predicted to keep the SLOs: explore the splits (the module's doc), with the
            # closest colocated knobs as the fallback when Optuna keeps asking colocated ones
            screen = Screen(frozenset(), frozenset(measured), {c.knobs: c for c in unstressed}, slo, closest)
            return Choice(moved, None, None, screen, judgement, (reasons.exploring_splits(closest),))
        return Choice(moved, closest, TrialKind.CLOSEST, None, judgement)
    notes.append(f"{len(allowed)} of {len(screened)} knobs allowed at {context.load.request_rate:.2f} req/s per pod "
                 f"({len(measured)} measured); predicted best {screened[0].knobs.token_budget}/"
                 f"{screened[0].knobs.max_chunk} at {100 * screened[0].pressure:.0f}% of its tightest limit")
    # Active identification: when the pick among the safe knobs turns on a term this window's steps do not pin
    # down, measure the safe knobs that separate the candidates before trusting either.
    split = None if waiting else guide.separating(guide.stressed(context, m.drift_load_shift),
                                                  [c for c in screened if c.knobs in allowed], slo, calibration)
    if split is not None and split[0] not in measured:
        queue, kind = split[0], TrialKind.IDENTIFY
        notes.append(f"the pick among the safe knobs depends on {', '.join(split[1])}, which the steps do not "
                     f"identify: trying {split[0].token_budget}/{split[0].max_chunk}, whose steps those terms weigh "
                     f"on most")
    elif not waiting and all(k in (TrialKind.IDENTIFY, TrialKind.COLOCATED) for k in m.completed_kinds):
        # the epoch's first trial (after any that identified the model or measured the colocated reference of a
        # searched threshold): the predicted best
        queue, kind = next(c for c in screened if c.knobs in allowed).knobs, TrialKind.PREDICTED
    ranked = [c.knobs for c in screened if c.knobs in allowed]
    untried = [k for k in ranked if k not in measured]
    screen = Screen(frozenset(allowed), frozenset(measured), {c.knobs: c for c in screened}, slo,
                    (untried or ranked)[0])
    return Choice(moved, queue, kind, screen, Judgement(len(allowed), True), tuple(notes))
