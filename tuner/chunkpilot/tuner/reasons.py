"""Every sentence the tuner says in `status.tuning.reason`, the Tuning condition's message and its Events, in one
place: the loop and the daemon decide (typed values: policy's actions and outcomes, Knobs, numbers), this module
words it. An SRE reads these while something is wrong, so each names what happened, what the tuner does about
it, and where it can say so, what to change."""

from __future__ import annotations

from chunkpilot.contract.knobs import threshold_text
from chunkpilot.tuner.space import Knobs


def knobs_words(knobs: Knobs) -> str:
    """Knobs as status, Events and logs show them: budget/chunk, and a searched threshold as its number or
    "never" (colocated)."""
    if knobs.disagg_threshold is None:  # every resource but disaggregation auto: the two numbers, as always
        return f"{knobs.token_budget}/{knobs.max_chunk}"
    split = "" if knobs.prefill_pods is None else f" on {knobs.prefill_pods} prefill pod{_s(knobs.prefill_pods)}"
    if knobs.prefill_budget is not None:
        split += f" at {knobs.prefill_budget}/{knobs.prefill_budget}"
    return (f"{knobs.token_budget}/{knobs.max_chunk} with disaggregation threshold "
            f"{threshold_text(knobs.disagg_threshold)}{split}")


_k = knobs_words


def _s(n: int) -> str:
    return "s" * (n != 1)


# -- exploring -----------------------------------------------------------------------------------------------

def trial(explored: int, max_trials: int, epoch: int) -> str:
    return f"trial {explored}/{max_trials} of epoch {epoch}"


def baseline() -> str:
    return "measuring the running knobs once: the step-time model needs steps to fit"


def cut(knobs: Knobs, factor: float) -> str:
    return f"trial {_k(knobs)} breached an SLO by more than {factor:g}x: cut short, best knobs restored"


def not_restored(error: Exception) -> str:
    """Appended to cut(): restoring the best knobs was not acknowledged in time."""
    return f"; restoring the best knobs: {error}"


def thin(requests: int) -> str:
    return f"window too thin ({requests} request{_s(requests)}): not a trial result"


def replicas_moved() -> str:
    return "the replicas changed during the window: not a trial result"


def not_acknowledged(generation: int, timeout: float) -> str:
    return f"pods did not report knob generation {generation} within {timeout:g}s"


def load_moved(shift: float, epoch: int) -> str:
    return f"load moved by {shift:.0%} while exploring: exploring again from the predicted best (epoch {epoch})"


def no_feasible_knobs(rate: float, pods: int, closest: Knobs, pressure: float, windows: int,
                      replicas_needed: int | None) -> str:
    return (f"no knobs in bounds are predicted to keep the SLOs at {rate:.2f} req/s per pod ({pods} pod{_s(pods)}); "
            f"applying the closest, {_k(closest)} ({pressure:.0%} of the tightest limit, calibrated by {windows} "
            f"measured window{_s(windows)}); "
            + (f"about {replicas_needed} replicas would be needed" if replicas_needed
               else "more replicas would not help (a single request is too slow for the SLO)"))


def exploring_splits(closest: Knobs) -> str:
    return (f"no colocated knobs are predicted to keep the SLOs (the closest: {_k(closest)}): exploring the "
            "prefill/decode splits, which the step-time model cannot predict, by measurement")


def exploring_infeasible(feasible_reason: str, reason: str) -> str:
    """The Tuning condition while exploring with no knobs predicted safe: the alertable reason first."""
    return f"NoFeasibleKnobs: {feasible_reason} ({reason})"


def closed_stale(count: int) -> str:
    return f"closed {count} trial{_s(count)} interrupted by a restart"


# -- exploiting ----------------------------------------------------------------------------------------------

def holding(best: Knobs) -> str:
    return f"holding the best knobs {_k(best)}"


def holding_thin() -> str:
    return "holding the best knobs (window too thin to judge)"


def nothing_completed() -> str:
    return "no trial completed within max trials: exploring a new epoch"


def nothing_feasible(max_trials: int) -> str:
    return f"no feasible knobs after {max_trials} trials: judging again at the load now"


def sustained_breach(windows: int) -> str:
    return f"SLO breached in {windows} consecutive windows"


def load_shifted(shift: float) -> str:
    return f"load moved by {shift:.0%} since the best knobs were measured"


def reopened(why: str, epoch: int) -> str:
    """policy.Reopen's why, after a window of the best knobs: the new epoch."""
    return f"{why}: exploring again (epoch {epoch})"


# -- advisory ------------------------------------------------------------------------------------------------

def advisory() -> str:
    return "advisory: recommending the best feasible knobs measured so far; nothing is changed"


# -- failures (the retry layer, chunkpilot.tuner.retry) -----------------------------------------------------

def holding_blind(why: str, retry_in: float) -> str:
    """Measurements unavailable (Prometheus down, no data)."""
    return f"{why}; keeping the current knobs, retrying in {retry_in:.0f}s"


def api_failed(status: int | None, reason: str | None, retry_in: float) -> str:
    return f"the Kubernetes API answered {status} {reason}; retrying in {retry_in:g} s"


def storage_failed(error_type: str, said: str, retry_in: float) -> str:
    return (f"the study storage failed ({error_type}: {said}); the knobs stay, no trial is recorded, retrying in "
            f"{retry_in:g} s: check the tuner's volume (full, read-only) or database (tuner.storage)")


def iteration_failed(error: Exception, retry_in: float) -> str:
    return f"{type(error).__name__}: {str(error)[:400]}; the knobs stay, retrying in {retry_in:g} s"


# -- replicas (autoscale.py) ---------------------------------------------------------------------------------

def replicas_would_not_help(cap: int, at: Knobs, held: int) -> str:
    return (f"more replicas would not help: no count up to {cap} is predicted to keep the SLOs at {_k(at)} (a single "
            f"request is too slow for them); holding {held}")


def replicas_needed(needed: int, at: Knobs, utilization: float, max_replicas: int) -> str:
    why = f"{needed} replicas predicted needed at {_k(at)} (prefill within {utilization:.0%}, SLOs kept)"
    return why + (f"; maxReplicas {max_replicas} is too low for the load" if needed > max_replicas else "")


def replicas_fewer(count: int, at: Knobs, utilization: float) -> str:
    return f"{count} replicas predicted to keep the SLOs at {_k(at)} with prefill within {utilization:.0%}"


def replicas_keep(count: int, at: Knobs) -> str:
    return f"{count} replicas keep the SLOs at {_k(at)}"


def replicas_breached(at: Knobs, current: int, predicted: int | None) -> str:
    return (f"the last window at {_k(at)} on {current} replicas broke an SLO (the model said {predicted}): "
            f"one more")


def replicas_stabilized(desired: int, down: bool) -> str:
    return f"; held at {desired} by the {'scale-down' if down else 'scale-up'} stabilization window"


def replicas_outside_bounds(spec: int, lo: int, hi: int, bounded: int) -> str:
    return f"spec.replicas {spec} is outside [{lo}, {hi}]: scaled to {bounded}"


def replicas_ready_long(ready: int, replicas: int, timeout: float) -> str:
    return (f"{ready} of {replicas} replicas ready for over {timeout:.0f} s: tuning on the ready pods, after one "
            f"window of warm-up")


def replicas_not_ready(ready: int, replicas: int, timeout: float) -> str:
    return (f"{ready} of {replicas} replicas ready: no trial until every pod serves (or {timeout:.0f} s pass: then "
            f"on the ready pods)")


def replicas_changed(replicas: int | None) -> str:
    return f"replicas changed to {replicas}: one window of warm-up before the next trial"


def scale_down_waits() -> str:
    return "; scaling down waits for the best knobs (exploring)"


def more_pods_wait(unready: int, timeout: float) -> str:
    return f"; more pods wait while {unready} are not ready (up to {timeout:.0f} s)"


def scaled_by_someone(replicas: int) -> str:
    return (f"; not applied: spec.replicas changed to {replicas} during the window (someone else scaled), judged "
            f"again from there")


def scale_conflict() -> str:
    return "; not applied: the resource changed while writing, judged again next window"
