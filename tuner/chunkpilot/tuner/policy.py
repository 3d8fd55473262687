"""The tuner's decisions between windows, as pure functions: what it remembers (`Memory`, rebuilt from the study
after a restart) and what it just measured in, a typed action out. No I/O, no Optuna, no clock: TunerLoop
(loop.py) is their driver against the cluster, a knobs file or the simulator, and carries the actions out.

Which knobs a trial tries (Optuna's ask screened by the step-time model) is chunkpilot.tuner.choice's pure
`choose`: a function of the study's trials and recorded windows, which the study stores, and the sampler is seeded
from them (study.TunerStudy._ask_seed), so it too is the same after a restart."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chunkpilot.contract.slo import SLOTargets
from chunkpilot.tuner import reasons
from chunkpilot.tuner.history import HistoryEntry, WindowKind
from chunkpilot.tuner.measurement import Window, load_of, load_shift, slo_met


class Outcome(StrEnum):
    """What one iteration did (TunerLoop.iterate's answer; logs and tests read it)."""

    TRIAL = "trial"  # a trial measured over a whole window and told
    CUT = "cut"  # a trial's probe breached an SLO widely: told as cut short, the best knobs restored
    THIN = "thin"  # too few requests in the window to be a result
    TIMEOUT = "timeout"  # the pods did not acknowledge the knobs in time
    BASELINE = "baseline"  # the running knobs measured once, before any model could be fitted
    EXPLOIT = "exploit"  # the best knobs held and measured
    REOPEN = "reopen"  # a new epoch: exploring again
    ADVISE = "advise"  # advisory: measured and recommended, nothing changed
    HOLD = "hold"  # measurements unavailable: nothing moved, retried with backoff
    SCALING = "scaling"  # the replicas change or not every pod is ready: no trial

    @property
    def measured(self) -> bool:
        """A window was measured at the knobs that ran: the autoscaler may decide from it."""
        return self in (Outcome.TRIAL, Outcome.CUT, Outcome.EXPLOIT, Outcome.REOPEN, Outcome.ADVISE)


@dataclass(frozen=True)
class Memory:
    """What the next decision depends on besides the measurements; every field is kept in, or recomputed from,
    the study (trials, their kinds, the remembered windows), so a restarted tuner has the same memory."""

    mode: str  # auto | advisory
    settled: bool  # replicas steady and every pod ready (always True without autoscaling)
    explored: int  # trials of this epoch that explored
    max_trials: int
    since_incumbent: int  # whole trials since the incumbent was last measured again
    incumbent_every: int
    has_best: bool  # some trial completed


# -- actions -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settle:
    """Wait a window for the replicas to settle; no trial."""


@dataclass(frozen=True)
class Advise:
    """Measure the running knobs and recommend the best feasible; change nothing."""


@dataclass(frozen=True)
class Explore:
    """Run a trial; first queue the incumbent to be measured again when it is due (load-aware comparison)."""

    remeasure_incumbent: bool = False


@dataclass(frozen=True)
class Exploit:
    """Hold the best knobs and measure them."""


Action = Settle | Advise | Explore | Exploit


def next_action(m: Memory) -> Action:
    if not m.settled:
        return Settle()
    if m.mode == "advisory":
        return Advise()
    if m.explored < m.max_trials:
        return Explore(remeasure_incumbent=m.has_best and m.since_incumbent >= m.incumbent_every)
    return Exploit()


def needs_baseline(guided: bool, fitted: bool, completed: int, baseline_measured: bool) -> bool:
    """Guided with nothing to fit yet (the tuner started with the load): one window at the running knobs first,
    so that the first trial is the predicted best rather than a guess."""
    return guided and not fitted and completed == 0 and not baseline_measured


# -- while exploiting --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Keep:
    """Go on holding the best knobs."""

    breaches: int  # consecutive windows of the best knobs over a latency SLO


@dataclass(frozen=True)
class Reopen:
    """Start a new epoch (exploring again), for `why`."""

    why: str


def before_exploit(has_best: bool, guided: bool, best_feasible: bool, max_trials: int) -> Reopen | None:
    """Whether there is anything to hold: every window thin, or (guided) nothing kept the SLOs, where the least
    violating knobs were measured at some load of the epoch and must be judged again at the load now."""
    if not has_best:
        return Reopen(reasons.nothing_completed())
    if guided and not best_feasible:
        return Reopen(reasons.nothing_feasible(max_trials))
    return None


def after_exploit(best_window: dict, window: Window, slo: SLOTargets, breaches: int, *, breach_windows: int,
                  shift_limit: float) -> Keep | Reopen:
    """After a window of the best knobs (thin windows are not judged): a sustained SLO breach or a load shift
    beyond the limit (rate, prompt or output length) re-opens exploration."""
    breaches = 0 if slo_met(window, slo) else breaches + 1
    shift = load_shift(load_of(best_window), load_of(window))
    if breaches >= breach_windows:
        return Reopen(reasons.sustained_breach(breaches))
    if shift > shift_limit:
        return Reopen(reasons.load_shifted(shift))
    return Keep(breaches)


def trailing_breaches(history: list[HistoryEntry], epoch: int, slo: SLOTargets, min_requests: int) -> int:
    """The consecutive breaching windows of the best knobs at the end of the recorded windows (the memory the
    study keeps): what after_exploit counts on from, after a restart as in the running loop. Thin windows are
    not judged there, so they neither count nor break the run."""
    count = 0
    for h in reversed(history):
        if h.epoch != epoch or h.kind != WindowKind.EXPLOIT:
            break
        if h.window.requests < min_requests:
            continue
        if slo_met(h.window, slo):
            break
        count += 1
    return count
