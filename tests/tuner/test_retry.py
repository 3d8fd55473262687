"""The tuner's one retry layer (chunkpilot.tuner.retry): a pause doubling up to a maximum, reset by a good
iteration, shared by the loop's holds and its driver's failures."""

from __future__ import annotations

import pytest

from chunkpilot.tuner.retry import Backoff

from .test_tuner_core import Fake, make


def test_backoff_doubles_to_its_maximum_and_resets():
    b = Backoff(2.0, 10.0)
    assert [b.failed() for _ in range(5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    b.succeeded()
    assert b.upcoming == 2.0 and b.failed() == 2.0


def test_a_backoff_that_cannot_pause_is_refused():
    with pytest.raises(ValueError, match="0 < initial <= maximum"):
        Backoff(0.0, 10.0)
    with pytest.raises(ValueError, match="0 < initial <= maximum"):
        Backoff(20.0, 10.0)


def test_the_loops_holds_and_its_drivers_failures_count_as_one():
    """A Prometheus outage (the loop holds) followed by an API error (the driver's failure) goes on doubling in
    one counter; one good iteration resets it for both."""
    fake = Fake(fail=True)
    shared = Backoff(2.0, 60.0)
    loop, _ = make(fake)
    loop.backoff = shared  # as daemon.tune_one hands its Backoff to build_loop
    assert loop.iterate() == "hold" and loop.iterate() == "hold"
    assert "retrying in 4s" in loop.state.reason
    assert shared.failed() == 8.0  # the driver's next failure pauses where the holds left off
    fake.fail = False
    loop.iterate()
    assert shared.upcoming == 2.0
