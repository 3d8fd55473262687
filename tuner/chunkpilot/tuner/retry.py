"""The tuner's one retry layer: after a failure (measurements unavailable, the Kubernetes API or the study storage
failing), pause, doubling while failures repeat, back to the start after one good iteration.

One `Backoff` per resource, held by its driver (daemon.tune_one, local mode, the simulator) and handed to its
TunerLoop, so a Prometheus outage followed by an API error goes on doubling instead of starting over in a second
counter, and the first good iteration resets both. Nothing else retries a failure: the supervisor runs a
resource's thread once (tune_one never lets a failure out), and the StatusWriter's re-read on a 409 is the API's
optimistic concurrency (client-go's RetryOnConflict), not a failure retried.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INITIAL = 2.0
MAXIMUM = 60.0


@dataclass
class Backoff:
    initial: float = INITIAL
    maximum: float = MAXIMUM
    _next: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {self.initial} and {self.maximum}")
        self._next = self.initial

    @property
    def upcoming(self) -> float:
        """The pause the next failure will take (what status says it retries in)."""
        return self._next

    def failed(self) -> float:
        """A failure: the pause to take now; the next one doubles, up to the maximum."""
        pause, self._next = self._next, min(self._next * 2, self.maximum)
        return pause

    def succeeded(self) -> None:
        self._next = self.initial
