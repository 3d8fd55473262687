"""Whether this replica of a peered controller may act now, read off the peering object kopf keeps.

kopf pauses its own watch handling when a live peer has a higher priority, or another has the same one, but work a
controller does outside kopf's handlers (the operator's resync and retries, the tuner's tuning threads) does not
stop with it: two replicas then both act. This gate applies kopf's rule (kopf 1.45, peering.process_peering_event)
to the same object, so that work pauses with kopf. Our own record is not told apart by identity (kopf makes one up
when POD_ID is unset): with random 31-bit priorities, two live records at our priority mean another replica has it.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

from kubernetes.client import ApiException

log = logging.getLogger(__name__)


def live_priorities(status: dict, now: datetime.datetime) -> list[int]:
    """Priorities of the records in a peering object's status whose lastseen + lifetime has not passed."""
    out = []
    for record in (status or {}).values():
        if not isinstance(record, dict):
            continue
        try:
            seen = datetime.datetime.fromisoformat(str(record["lastseen"]))
            if seen.tzinfo is None:
                seen = seen.replace(tzinfo=datetime.UTC)
            if seen + datetime.timedelta(seconds=float(record.get("lifetime", 60))) >= now:
                out.append(int(record.get("priority", 0)))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def may_act(priorities: list[int], mine: int) -> bool:
    """kopf's rule: no live peer above us, and no other at our priority."""
    return not any(p > mine for p in priorities) and sum(1 for p in priorities if p == mine) <= 1


class PeeringGate:
    """Callable: True when this replica may act. Standalone (no peering name): always. The object is read at most
    every `cache_seconds`; one that cannot be read keeps the last answer (kopf, too, keeps its state then), whatever
    the failure: an API error, or a refused or reset connection (urllib3 raises those, not ApiException), which
    must never reach the thread that asked."""

    def __init__(self, read: Callable[[], list[dict]] | None, priority: int, cache_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read, self.priority, self.cache_seconds, self.clock = read, priority, cache_seconds, clock
        self._checked: float | None = None
        self._answer = read is None  # peered: paused until the object says otherwise, as kopf starts paused
        # Opening takes two reads at least cache_seconds apart that both say so: replicas started together record
        # themselves within moments of each other, and the first to read the object would otherwise act before
        # the others appear in it (seen on the real cluster: a standby acted for one read, then stood by).
        self._opening = False

    def __call__(self) -> bool:
        if self.read is None:
            return True
        now = self.clock()
        if self._checked is None or now - self._checked >= self.cache_seconds:
            self._checked = now
            try:
                objects = self.read()
            except ApiException as e:
                log.warning("cannot read the peering object (%s %s); keeping the last answer", e.status, e.reason)
                return self._answer
            except Exception as e:  # noqa: BLE001 - connection refused/reset, timeouts: the API server is away
                log.warning("cannot reach the API server for the peering object (%s); keeping the last answer",
                            type(e).__name__)
                return self._answer
            utc = datetime.datetime.now(datetime.UTC)
            answer = bool(objects) and all(may_act(live_priorities(o.get("status") or {}, utc), self.priority)
                                           for o in objects)
            if answer and not self._answer and not self._opening:
                self._opening = True  # confirm at the next read
                return self._answer
            self._opening = False
            if answer != self._answer:
                log.info("peering: this replica (priority %d) %s", self.priority, "acts" if answer else "stands by")
            self._answer = answer
        return self._answer
