"""Scheduler knobs: the two numbers the tuner moves while the engine serves (and, disaggregated, the threshold and
a live-roles engine's role).

The knobs themselves are the contract's (chunkpilot.contract.knobs). The holder is read by the
step loop once per step and written from any thread, so a change lands exactly at a step boundary.
"""

from __future__ import annotations

import threading

from chunkpilot.contract.engine_settings import LIVE_ROLES
from chunkpilot.contract.knobs import SchedulerKnobs

NO_LIVE_ROLES = ("this engine switches no roles (it was started without --live-roles): drop role from the knobs, "
                 "or start the engine with --live-roles (spec.disaggregation.mode auto does)")


class KnobHolder:
    """Thread-safe cell for the current knobs; the scheduler snapshots it at the start of every step."""

    def __init__(self, knobs: SchedulerKnobs, *, min_token_budget: int = 1, max_token_budget: int | None = None) -> None:
        self._min_token_budget = min_token_budget
        self._max_token_budget = max_token_budget
        self._lock = threading.Lock()
        self._knobs = knobs.validated(min_token_budget=min_token_budget, max_token_budget=max_token_budget)

    def enable_roles(self, start: str) -> None:
        """A live-roles engine (--live-roles): the knobs carry its role from now on, `start` until one is set."""
        if start not in LIVE_ROLES:
            raise ValueError(f"a live-roles engine starts as one of {', '.join(LIVE_ROLES)}, got {start!r}")
        with self._lock:
            self._knobs = self._knobs.with_role(start)

    @property
    def role(self) -> str | None:
        """A live-roles engine's role now; None on any other engine (its role is its start-up --role)."""
        return self.get().role

    def get(self) -> SchedulerKnobs:
        with self._lock:
            return self._knobs

    def set(self, knobs: SchedulerKnobs) -> SchedulerKnobs:
        """Validate and install new knobs; on a bad value raise and keep the last good ones. Knobs without a role
        keep a live-roles engine's role (a knobs file, which every pod of a split shares, names none)."""
        knobs.validated(min_token_budget=self._min_token_budget, max_token_budget=self._max_token_budget)
        with self._lock:
            live = self._knobs.role is not None
            if knobs.role is not None and not live:
                raise ValueError(NO_LIVE_ROLES)
            if knobs.role is None and live:
                knobs = knobs.with_role(self._knobs.role)
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
            role=cur.role,
        )
        return self.set(new)
