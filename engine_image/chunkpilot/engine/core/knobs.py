"""Scheduler knobs: the two numbers the tuner moves while the engine serves.

The knobs themselves are the contract's (chunkpilot.contract.knobs). The holder is read by the
step loop once per step and written from any thread, so a change lands exactly at a step boundary.
"""

from __future__ import annotations

import threading

from chunkpilot.contract.knobs import SchedulerKnobs


class KnobHolder:
    """Thread-safe cell for the current knobs; the scheduler snapshots it at the start of every step."""

    def __init__(self, knobs: SchedulerKnobs, *, min_token_budget: int = 1, max_token_budget: int | None = None) -> None:
        self._min_token_budget = min_token_budget
        self._max_token_budget = max_token_budget
        self._lock = threading.Lock()
        self._knobs = knobs.validated(min_token_budget=min_token_budget, max_token_budget=max_token_budget)

    def get(self) -> SchedulerKnobs:
        with self._lock:
            return self._knobs

    def set(self, knobs: SchedulerKnobs) -> SchedulerKnobs:
        """Validate and install new knobs; on a bad value raise and keep the last good ones."""
        knobs.validated(min_token_budget=self._min_token_budget, max_token_budget=self._max_token_budget)
        with self._lock:
            self._knobs = knobs
        return knobs

    def update(self, *, token_budget: int | None = None, max_chunk: int | None = None) -> SchedulerKnobs:
        with self._lock:
            cur = self._knobs
        new = SchedulerKnobs(
            token_budget=cur.token_budget if token_budget is None else token_budget,
            max_chunk=cur.max_chunk if max_chunk is None else max_chunk,
            generation=cur.generation + 1,
            disagg_threshold=cur.disagg_threshold,
        )
        return self.set(new)
