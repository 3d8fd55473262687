"""The tuner's decisions between windows (chunkpilot.tuner.policy): pure functions of its memory and the window
just measured."""

from __future__ import annotations

from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.tuner import policy
from chunkpilot.tuner.history import HistoryEntry, WindowKind
from chunkpilot.tuner.measurement import Window
from chunkpilot.tuner.policy import Advise, Exploit, Explore, Keep, Memory, Outcome, Reopen, Settle
from chunkpilot.tuner.space import Knobs

SLO = SLOTargets(ttft=LatencyTarget(0.99, 2.0), itl=LatencyTarget(0.99, 0.1))
BASE = Memory(mode="auto", settled=True, explored=3, max_trials=10, since_incumbent=2, incumbent_every=5,
              has_best=True)


def win(itl=0.05, rate=2.0, requests=100, prompt=500.0) -> Window:
    return Window(seconds=60, requests=requests, request_rate=rate, output_tokens_per_s=80, goodput=rate, ttft=1.0,
                  itl=itl, mean_prompt_tokens=prompt, mean_output_tokens=40)


def test_the_next_action_follows_the_memory():
    assert policy.next_action(BASE) == Explore(remeasure_incumbent=False)
    assert policy.next_action(Memory(**{**BASE.__dict__, "since_incumbent": 5})) == Explore(remeasure_incumbent=True)
    # nothing to re-measure before any trial completed
    assert policy.next_action(Memory(**{**BASE.__dict__, "since_incumbent": 9, "has_best": False})) == Explore()
    assert policy.next_action(Memory(**{**BASE.__dict__, "explored": 10})) == Exploit()
    assert policy.next_action(Memory(**{**BASE.__dict__, "mode": "advisory"})) == Advise()
    # the replicas settle first, in any mode
    assert policy.next_action(Memory(**{**BASE.__dict__, "settled": False, "mode": "advisory"})) == Settle()


def test_the_baseline_is_measured_once_and_only_when_nothing_can_be_fitted():
    assert policy.needs_baseline(guided=True, fitted=False, completed=0, baseline_measured=False)
    assert not policy.needs_baseline(guided=True, fitted=False, completed=0, baseline_measured=True)
    assert not policy.needs_baseline(guided=True, fitted=True, completed=0, baseline_measured=False)
    assert not policy.needs_baseline(guided=True, fitted=False, completed=1, baseline_measured=False)
    assert not policy.needs_baseline(guided=False, fitted=False, completed=0, baseline_measured=False)


def test_exploiting_reopens_on_a_sustained_breach_or_a_load_shift():
    best = win().to_dict()
    kw = dict(breach_windows=3, shift_limit=0.5)
    assert policy.after_exploit(best, win(), SLO, 2, **kw) == Keep(0)  # a window within the SLOs resets the count
    assert policy.after_exploit(best, win(itl=0.3), SLO, 1, **kw) == Keep(2)
    assert policy.after_exploit(best, win(itl=0.3), SLO, 2, **kw) == Reopen("SLO breached in 3 consecutive windows")
    shifted = policy.after_exploit(best, win(rate=3.5), SLO, 0, **kw)
    assert isinstance(shifted, Reopen) and "load moved by 75%" in shifted.why
    assert policy.before_exploit(False, True, False, 10).why.startswith("no trial completed")
    assert policy.before_exploit(True, True, False, 10).why.startswith("no feasible knobs after 10 trials")
    assert policy.before_exploit(True, False, False, 10) is None  # black-box holds the least violating
    assert policy.before_exploit(True, True, True, 10) is None


def test_the_breach_count_comes_back_from_the_recorded_windows():
    def entry(kind, itl=0.3, requests=100, epoch=1):
        return HistoryEntry(epoch, WindowKind(kind), Knobs(128, 64), True, win(itl=itl, requests=requests))
    history = [entry("complete"), entry("exploit", itl=0.05), entry("exploit"), entry("exploit", requests=3),
               entry("exploit")]
    assert policy.trailing_breaches(history, 1, SLO, 20) == 2  # the thin window neither counts nor breaks the run
    assert policy.trailing_breaches(history, 2, SLO, 20) == 0  # another epoch's windows say nothing
    assert policy.trailing_breaches(history + [entry("complete")], 1, SLO, 20) == 0


def test_outcomes_say_whether_a_window_was_measured():
    assert {o for o in Outcome if o.measured} == {Outcome.TRIAL, Outcome.CUT, Outcome.EXPLOIT, Outcome.REOPEN,
                                                 Outcome.ADVISE}
    assert Outcome.TRIAL == "trial"  # logs and the local report print them as words
