"""The one adapter between the tuner and Optuna (pinned range in pyproject): storage, sampler, ask/tell with
constraints, epochs, resume.

* One study per deployment *and epoch*: an epoch starts when the load moved so far that older trials no longer
  describe the system (see loop.py); the new epoch's first trial is the incumbent. Study names are
  `<deployment>#e<epoch>`; the latest epoch is the one resumed.
* Constraints are stored per trial as the user attribute `constraints` (Optuna's convention: <= 0 is satisfied),
  so TPE's constrained mode works from the storage alone, also after a restart.
* A trial still RUNNING when the study is opened was interrupted (the tuner died mid-window): it is closed as
  FAIL, so it is neither lost silently nor counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import warnings
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from chunkpilot.contract.knobs import DISAGG_NEVER
from chunkpilot.contract.slo import SLOTargets
from chunkpilot.tuner.history import TrialKind
from chunkpilot.tuner.history import HistoryEntry
from chunkpilot.tuner.measurement import Window, constraints, objective_value, prompt_demand, window_of
from chunkpilot.tuner.space import Knobs, SearchSpace

log = logging.getLogger(__name__)
optuna.logging.set_verbosity(optuna.logging.WARNING)
# Constrained TPE is marked experimental in some releases; we pin the range and test it.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


# Optuna 5 stores constraints per trial (`Trial.set_constraint`) and deprecates the sampler's constraints_func;
# Optuna 4 has only constraints_func. Both read what `record_constraints` writes.
SHRINK = 1.0  # pseudo-windows of the median added to every setting's mean
# Violations (the largest constraint: a share of a limit over 1) this close to the least count as alike when no
# setting is feasible: a tenth of a limit, what one window's noise moves a p99 by.
VIOLATION_TOLERANCE = 0.1
_HAS_SET_CONSTRAINT = hasattr(optuna.trial.Trial, "set_constraint")

MEMORY_PREFIX = "memory:"  # study user attributes holding the loop's recorded windows

def kind_of(trial: optuna.Trial | FrozenTrial) -> TrialKind | None:
    """Why the trial was queued; None for Optuna's own asks (and for a kind this version does not know)."""
    kind = trial.user_attrs.get("kind")
    return TrialKind(kind) if kind in TrialKind._value2member_map_ else None


@dataclass(frozen=True)
class TrialRecord:
    """What the study stores about one trial, typed: the trial attributes are written and read here alone."""

    number: int
    state: TrialState
    knobs: Knobs | None  # None until asked (a queued trial)
    kind: TrialKind | None
    window: dict | None  # the measured window (told trials)
    cut_short: bool
    constraints: tuple[float, ...]  # Optuna's convention: <= 0 is satisfied (told and rejected trials)
    rejected: str | None  # why an ask was not tried

    @classmethod
    def of(cls, t: FrozenTrial) -> TrialRecord:
        a = t.user_attrs
        knobs = knobs_of(a) if "token_budget" in a else None
        return cls(t.number, t.state, knobs, kind_of(t), a.get("window"), bool(a.get("cut_short")),
                   tuple(a.get("constraints", ())), a.get("rejected"))


def knobs_of(attrs: dict) -> Knobs:
    """The knobs a trial measured, from its attributes (study.ran writes them): the threshold only where the
    space searches it, so every other study's trials are stored and read as before."""
    return Knobs(attrs["token_budget"], attrs["max_chunk"], attrs.get("disagg_threshold"), attrs.get("prefill_pods"),
                 attrs.get("prefill_budget"))


def _constraints_of(trial: FrozenTrial) -> list[float]:
    return list(trial.user_attrs.get("constraints", [1.0]))


def _constraints_now(trial: FrozenTrial, slo: SLOTargets, demand: float | None) -> list[float]:
    """A trial's constraints against today's reference load (the stored ones used the load known when it ended)."""
    window = trial.user_attrs.get("window")
    return constraints(window_of(window), slo, demand) if window else _constraints_of(trial)


def record_constraints(trial: optuna.Trial, values: list[float]) -> None:
    trial.set_user_attr("constraints", values)
    if _HAS_SET_CONSTRAINT:
        for i, v in enumerate(values):
            trial.set_constraint(f"slo{i}", v)


def make_sampler(seed: int | None, startup_trials: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials, multivariate=True,
                                      constraints_func=None if _HAS_SET_CONSTRAINT else _constraints_of)


_STORAGES: dict[str, optuna.storages.BaseStorage] = {}
_STORAGES_LOCK = threading.Lock()


def make_storage(url: str) -> optuna.storages.BaseStorage:
    """One storage object per URL and process: the cluster tuner opens studies for many deployments from
    parallel daemons, and two RDBStorage objects creating the tables of a fresh SQLite file at once collide."""
    if url == ":memory:":
        return optuna.storages.InMemoryStorage()
    # The driver the tuner ships is psycopg 3; SQLAlchemy's default for a bare postgresql:// is psycopg2 before
    # 2.1 and psycopg 3 from 2.1, so say which one.
    if url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    with _STORAGES_LOCK:
        if url not in _STORAGES:
            _STORAGES[url] = optuna.storages.RDBStorage(url)
        return _STORAGES[url]


@dataclass(frozen=True)
class Measured:
    knobs: Knobs
    objective: float
    feasible: bool
    window: dict
    count: int = 1  # measurements averaged (the incumbent is re-measured)
    violation: float = 0.0  # largest mean constraint (<= 0: every SLO met)
    slo_violation: float = 0.0  # the same without the prefill headroom: the user's SLOs and keeping up


class TunerStudy:
    def __init__(self, storage_url: str, deployment: str, space: SearchSpace, slo: SLOTargets, objective: str,
                 *, seed: int | None = None, startup_trials: int = 5) -> None:
        self.storage = make_storage(storage_url)
        self.deployment = deployment
        self.space = space
        self.slo = slo
        self.objective = objective
        self.seed = seed
        self.startup_trials = startup_trials
        self.epoch = self._latest_epoch()
        self.study = self._open(self.epoch)
        self._remembered: int | None = None
        self.closed_stale = self._close_stale()
        # Completed trials of earlier epochs never change: count them once, not on every iteration (the loop
        # asks after each window, and scanning every study in a shared database grows with all deployments).
        self._earlier_completed = self._count_completed(range(self.epoch))

    # -- epochs ---------------------------------------------------------------------------------------------
    def _name(self, epoch: int) -> str:
        return f"{self.deployment}#e{epoch}"

    def _latest_epoch(self) -> int:
        prefix = f"{self.deployment}#e"
        epochs = [int(s.study_name[len(prefix):]) for s in optuna.get_all_study_summaries(self.storage)
                  if s.study_name.startswith(prefix) and s.study_name[len(prefix):].isdigit()]
        return max(epochs, default=0)

    def _open(self, epoch: int) -> optuna.Study:
        return optuna.create_study(study_name=self._name(epoch), storage=self.storage, direction="maximize",
                                   sampler=make_sampler(self._ask_seed(epoch, 0), self.startup_trials),
                                   load_if_exists=True)

    def _ask_seed(self, epoch: int, trials: int) -> int:
        """The sampler's seed for the ask after `trials` trials of `epoch`. A sampler's random state lives in the
        process: a tuner restarted mid-epoch would draw other asks than the one that kept running. Seeding every
        ask from what the storage holds makes the next ask a function of the study alone, so the restarted tuner
        decides as the uninterrupted one would have. Without a configured seed, the deployment's name seeds it
        (reproducible, and different deployments still explore differently)."""
        base = self.seed if self.seed is not None else self.deployment
        digest = hashlib.sha256(f"{base}#{epoch}#{trials}".encode()).digest()
        return int.from_bytes(digest[:4], "big")

    def new_epoch(self, seed_knobs: list[Knobs]) -> None:
        self._earlier_completed += len(self.completed())
        self.epoch += 1
        self.study = self._open(self.epoch)
        self._remembered = None
        for k in seed_knobs:
            self.enqueue(k, TrialKind.INCUMBENT)

    def _close_stale(self) -> int:
        """Trials an earlier tuner left running (it was killed mid-window) are failed, and their knobs queued again:
        the next ask returns them, so a restarted tuner measures what it was measuring instead of deciding anew."""
        stale = [t for t in self.study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
        if stale:  # noted, so that ask() does not count them: the uninterrupted tuner never had these failures
            self.study.set_user_attr("closed_stale", sorted(set(self.study.user_attrs.get("closed_stale", []))
                                                            | {t.number for t in stale}))
        for t in stale:
            self.study.tell(t.number, state=TrialState.FAIL)
            if t.params:  # its very parameters, not the knobs' indices: a clamped ask (chunk over budget) has
                # other indices than its knobs map back to, and the sampler learns from the parameters
                kind = t.user_attrs.get("kind", TrialKind.RESUMED.value)
                self.study.enqueue_trial(dict(t.params), user_attrs={"kind": kind}, skip_if_exists=False)
            log.warning("trial %d of %s was left running by an earlier tuner: closed, and its knobs measured again",
                        t.number, self.study.study_name)
        return len(stale)

    # -- memory: what the loop learned besides the trials, kept beside them ---------------------------------
    def remember(self, entry: HistoryEntry) -> None:
        """One window as the loop recorded it (measured next to predicted: what calibrates the predictions),
        stored in this epoch's study so that a restarted tuner has the same knowledge."""
        if self._remembered is None:  # counted once per epoch: later windows are numbered on
            self._remembered = len(self._memory_keys())
        clean = json.loads(json.dumps(entry.to_dict(), default=str))  # the storage keeps JSON
        self.study.set_user_attr(f"{MEMORY_PREFIX}{self._remembered:06d}", clean)
        self._remembered += 1

    def _memory_keys(self) -> list[str]:
        return sorted(k for k in self.study.user_attrs if k.startswith(MEMORY_PREFIX))

    def memory(self) -> list[HistoryEntry]:
        """This epoch's remembered windows, oldest first."""
        attrs = self.study.user_attrs
        return [HistoryEntry.from_dict(attrs[k]) for k in self._memory_keys()]

    # -- ask / tell -----------------------------------------------------------------------------------------
    def enqueue(self, knobs: Knobs, kind: TrialKind) -> None:
        self.study.enqueue_trial(self.space.params(knobs), user_attrs={"kind": TrialKind(kind).value},
                                 skip_if_exists=False)

    def ask(self) -> tuple[optuna.Trial, Knobs]:
        # a fresh sampler (TPE keeps nothing else between asks) seeded from the stored trials: see _ask_seed
        # (counted over finished trials, failed ones too, so that a thin window or a timeout is followed by another
        # draw; but not the trial a killed tuner left running, closed as failed on restart: it must not shift them)
        closed = set(self.study.user_attrs.get("closed_stale", []))
        told = sum(1 for t in self.study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)) if t.number not in closed)
        self.study.sampler = make_sampler(self._ask_seed(self.epoch, told), self.startup_trials)
        trial = self.study.ask()
        knobs = self.space.knobs(trial.suggest_int("budget_index", 0, len(self.space.budgets) - 1),
                                 trial.suggest_int("chunk_index", 0, len(self.space.chunks) - 1),
                                 # a third parameter only where the threshold is searched: every other study asks
                                 # exactly the two it always asked, so its seeded draws are unchanged
                                 trial.suggest_int("threshold_index", 0, len(self.space.thresholds) - 1)
                                 if self.space.thresholds else None,
                                 # and a fourth where the split is searched too (a finite threshold's prefill pods),
                                 # with a fifth, their budget (asked at "never" too, unused, as the split is: TPE
                                 # models a space that stays the same from trial to trial)
                                 trial.suggest_int("split_index", 0, len(self.space.splits) - 1)
                                 if self.space.splits else None,
                                 trial.suggest_int("prefill_index", 0, len(self.space.prefill_budgets) - 1)
                                 if self.space.prefill_budgets else None)
        self.ran(trial, knobs)
        return trial, knobs

    @staticmethod
    def ran(trial: optuna.Trial, knobs: Knobs) -> None:
        """The knobs the trial measures: the ask's, or what really ran where that is off the grid (advisory)."""
        trial.set_user_attr("token_budget", knobs.token_budget)
        trial.set_user_attr("max_chunk", knobs.max_chunk)
        if knobs.disagg_threshold is not None:
            trial.set_user_attr("disagg_threshold", knobs.disagg_threshold)
        if knobs.prefill_pods is not None:
            trial.set_user_attr("prefill_pods", knobs.prefill_pods)
        if knobs.prefill_budget is not None:
            trial.set_user_attr("prefill_budget", knobs.prefill_budget)

    def tell(self, trial: optuna.Trial, window: Window, *, cut_short: bool = False) -> float:
        value = objective_value(window, self.objective)
        demand = self.reference_demand([window.to_dict()])
        record_constraints(trial, constraints(window, self.slo, demand))
        trial.set_user_attr("window", window.to_dict())
        trial.set_user_attr("cut_short", cut_short)
        self.study.tell(trial, value)
        return value

    def reject(self, trial: optuna.Trial, predicted: list[float], reason: str) -> None:
        """An ask not tried because it is predicted (or was measured) to breach an SLO: pruned, with the predicted
        constraints, so that constrained TPE counts the region as infeasible. Never a measurement: measured(),
        best() and explored() see only completed trials."""
        record_constraints(trial, predicted)
        trial.set_user_attr("rejected", reason)
        self.study.tell(trial, state=TrialState.PRUNED)

    def waiting(self) -> int:
        """Enqueued trials not asked yet."""
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def queued(self, kind: TrialKind) -> bool:
        """A trial of this kind is enqueued and not asked yet."""
        return any(kind_of(t) == kind for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def fail(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr("failed", reason)
        self.study.tell(trial, state=TrialState.FAIL)

    # -- what is known --------------------------------------------------------------------------------------
    def completed(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def records(self, states: tuple[TrialState, ...] | None = (TrialState.COMPLETE,)) -> list[TrialRecord]:
        """This epoch's trials in `states` (None: all), typed, in the order they were asked."""
        return [TrialRecord.of(t) for t in self.study.get_trials(deepcopy=False, states=states)]

    def trial_windows(self) -> list[dict]:
        """The windows of this epoch's completed trials."""
        return [r.window for r in self.records() if r.window]

    def explored(self) -> int:
        """Completed trials of this epoch that explored (re-measurements of the incumbent do not count)."""
        return sum(1 for t in self.completed() if kind_of(t) != TrialKind.INCUMBENT)

    def _count_completed(self, epochs) -> int:
        names = {s.study_name for s in optuna.get_all_study_summaries(self.storage)}
        return sum(len(optuna.load_study(study_name=self._name(e), storage=self.storage).get_trials(
            deepcopy=False, states=(TrialState.COMPLETE,))) for e in epochs if self._name(e) in names)

    def total_completed(self) -> int:
        """Completed trials over all epochs of this deployment."""
        return self._earlier_completed + len(self.completed())

    def measured(self) -> list[Measured]:
        """Completed trials grouped by knobs: mean objective, feasible when the mean constraints are. Averaging
        the incumbent's repeated windows is what makes comparisons fair when the load drifts a little."""
        completed = self.completed()
        groups: dict[Knobs, list[FrozenTrial]] = {}
        for t in completed:
            groups.setdefault(knobs_of(t.user_attrs), []).append(t)
        # One lucky window must not make a winner: each setting's mean is shrunk towards the median of all
        # windows by one pseudo-window (empirical Bayes), so knobs measured again and again keep their mean and
        # knobs seen once count half.
        # Objectives and constraints are recomputed from the stored windows, so trials told by an older tuner
        # (other scoring) and by this one are judged alike after an upgrade resumes the study.
        value = {t.number: self._value_now(t) for t in completed}
        values = sorted(value.values())
        prior = values[len(values) // 2] if values else 0.0
        demand = self.reference_demand(trials=completed)
        # Feasibility is shrunk the same way, but only ever towards infeasible: where most windows breach some
        # limit (the median window's largest constraint is over 0), one window within the limits under noisy steps
        # does not make a feasible setting until another agrees; where most windows keep the SLOs, nothing changes.
        every = {t.number: _constraints_now(t, self.slo, demand) for t in completed}
        violations = sorted(max(c, default=0.0) for c in every.values())
        typical = violations[len(violations) // 2] if violations else 0.0
        out = []
        for k, ts in groups.items():
            n = len(ts)
            sums = [sum(c) for c in zip(*[every[t.number] for t in ts])]
            cons = [s_ / n if n > 1 else max(s_, (s_ + SHRINK * typical) / (1 + SHRINK)) for s_ in sums]
            score = (sum(value[t.number] for t in ts) + SHRINK * prior) / (n + SHRINK)
            out.append(Measured(k, score, all(c <= 0 for c in cons), ts[-1].user_attrs.get("window", {}), n,
                                max(cons, default=0.0), max(cons[:-1], default=0.0)))
        return out

    def _value_now(self, trial: FrozenTrial) -> float:
        window = trial.user_attrs.get("window")
        return objective_value(window_of(window), self.objective) if window else trial.value

    def reference_demand(self, extra: list[dict] = (), trials: list[FrozenTrial] | None = None) -> float | None:
        """The epoch's prompt tokens/s arriving, averaged over every window measured in it (plus `extra`
        windows): a setting's prefill capacity is judged against the load the deployment carries, not the load
        its own window happened to see (a quiet minute makes any budget look big enough)."""
        trials = self.completed() if trials is None else trials
        demands = [prompt_demand(window_of(w)) for w in [t.user_attrs.get("window") for t in trials]
                   + list(extra) if w]
        demands = [d for d in demands if d > 0]
        return sum(demands) / len(demands) if demands else None

    def best(self) -> Measured | None:
        """The best feasible knobs; when none met the SLOs yet, the least violating (the best we can do)."""
        measured = self.measured()
        feasible = [m for m in measured if m.feasible]
        if feasible:
            # Among equal objectives (goodput is a share, and every setting within the SLOs scores 1), the knobs
            # that send fewer prompts to prefill pods: a split is kept only where it measured better than
            # colocated, whose pods do no transfers. Without a searched threshold every point ties here, as before.
            return max(feasible, key=lambda m: (m.objective, _locality(m.knobs), -m.knobs.token_budget))
        if not measured:
            return None
        # None feasible: the least violating of the user's SLOs and keeping up (measurement.constraints without
        # the prefill headroom, its last entry: a proxy for what a longer run would show, which must not outrank
        # a measured SLO breach - under contention noise it made the tuner prefer 96/64, over its ITL SLO, to the
        # grid's best 64/32, within it at 0.9 prefill utilization), where settings within VIOLATION_TOLERANCE of
        # the least count as alike and the objective decides (noisy windows reorder violations that close, and
        # the objective is what the user asked for among the settings that miss alike); the headroom breaks ties.
        least = min(m.slo_violation for m in measured)
        near = [m for m in measured if m.slo_violation <= least + VIOLATION_TOLERANCE]
        return max(near, key=lambda m: (m.objective, -m.violation, _locality(m.knobs)))


def _locality(knobs: Knobs) -> tuple[int, int]:
    """How much prefill a point keeps on the decode pods: its threshold, colocated (None or never) the most; then
    the fewer prefill pods, the more pods serve clients."""
    return (DISAGG_NEVER if knobs.colocated else knobs.disagg_threshold, -(knobs.prefill_pods or 0))
