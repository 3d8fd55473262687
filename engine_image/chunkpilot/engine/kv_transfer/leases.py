"""The prefill side's leases: blocks held for a decode pod under a one-time transfer id, until it releases them or
the lease expires (a decode pod that died releases nothing). Event-loop only; the clock is injected for tests."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    blocks: list[int]
    expires: float


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lapsed: list[list[int]] = []  # expired leases found by settle(), given back by the next expire()

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, blocks: list[int], seconds: float) -> str:
        """Hold `blocks` for `seconds`; the id is unguessable, so only the decode pod that asked can settle it."""
        transfer_id = secrets.token_hex(16)
        self._leases[transfer_id] = Lease(list(blocks), self._clock() + seconds)
        return transfer_id

    def settle(self, transfer_id: str) -> list[int] | None:
        """End a lease on release: its blocks, or None when the id is unknown, already settled or expired (a stale
        id: what the caller read may have been overwritten since)."""
        lease = self._leases.pop(transfer_id, None)
        if lease is None:
            return None
        if lease.expires <= self._clock():  # expired, not yet swept: too late all the same
            self._lapsed.append(lease.blocks)
            return None
        return lease.blocks

    def expire(self) -> list[list[int]]:
        """Pop every lease past its time: the blocks to give back."""
        now = self._clock()
        gone, self._lapsed = self._lapsed, []
        for tid in [t for t, lease in self._leases.items() if lease.expires <= now]:
            gone.append(self._leases.pop(tid).blocks)
        return gone

    def drain(self) -> list[list[int]]:
        """Every lease, at shutdown."""
        gone = [lease.blocks for lease in self._leases.values()] + self._lapsed
        self._leases.clear()
        self._lapsed = []
        return gone
