"""Waiting on state another thread or process changes: `eventually` for "this happens", `consistently` for
"this does not happen". Neither sleeps and then looks once.

A negative claim ("no second warning", "no pass ran while the gate was shut") means something only once the thing
that could have broken it had its chance: `consistently` checks the claim at every poll until an observed event says
enough happened (passes run, retries counted, audit-log entries written), as Gomega's `Consistently` is bounded
in kubebuilder's tests. If that event never comes the test fails: it would have proved nothing."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(cond: Callable[[], object], timeout: float = 30.0, poll: float = 0.2) -> bool:
    """True as soon as cond() is truthy, False after `timeout` seconds of it not being."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def consistently(holds: Callable[[], object], *, until: Callable[[], object], timeout: float = 30.0,
                 poll: float = 0.05, what: str = "the condition") -> None:
    """Assert `holds()` at every poll until `until()` is truthy (and once more after it); AssertionError the first
    time it does not hold, or when `until` has not come within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done = until()  # read before the check, so the last check sees everything that `until` counted
        assert holds(), f"{what} stopped holding"
        if done:
            return
        assert time.monotonic() < deadline, f"what should have tested {what} did not happen within {timeout:.0f} s"
        time.sleep(poll)
