"""The search space: (token_budget, max_chunk) inside the spec's bounds, on a log scale, in multiples of a step.

Optuna cannot sample an integer on a log scale *and* in steps, and max_chunk <= token_budget would make the range
of one parameter depend on another (which TPE models badly). So both are ordinal indices into fixed log-spaced
grids of step multiples, and max_chunk is clipped to the budget afterwards."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunkpilot.contract.knobs import Knobs  # the one knobs type; the tuner's points are these


def log_grid(lo: int, hi: int, step: int, points_per_octave: int = 4) -> list[int]:
    """Multiples of `step` from lo to hi (both kept, rounded into the bounds), about log-evenly spaced."""
    if lo < 1 or hi < lo:
        raise ValueError(f"bounds must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    n = max(2, int(round(np.log2(hi / lo) * points_per_octave)) + 1)
    out = set()
    for v in np.geomspace(lo, hi, n):
        m = int(round(v / step)) * step
        out.add(min(hi, max(lo, m if m > 0 else lo)))
    out.update({lo, hi})
    return sorted(out)


@dataclass(frozen=True)
class SearchSpace:
    budgets: tuple[int, ...]
    chunks: tuple[int, ...]

    @classmethod
    def from_bounds(cls, budget: tuple[int, int], chunk: tuple[int, int], step: int = 16,
                    points_per_octave: int = 4) -> SearchSpace:
        return cls(tuple(log_grid(*budget, step, points_per_octave)), tuple(log_grid(*chunk, step, points_per_octave)))

    def knobs(self, budget_index: int, chunk_index: int) -> Knobs:
        b = self.budgets[budget_index]
        return Knobs(b, min(b, self.chunks[chunk_index]))

    def indices(self, k: Knobs) -> tuple[int, int]:
        """The grid point nearest to k (used to enqueue known knobs, e.g. the incumbent or the start-up ones)."""
        bi = int(np.argmin([abs(np.log(b / k.token_budget)) for b in self.budgets]))
        ci = int(np.argmin([abs(np.log(c / k.max_chunk)) for c in self.chunks]))
        return bi, ci

    def clamp(self, k: Knobs) -> Knobs:
        b = min(max(k.token_budget, self.budgets[0]), self.budgets[-1])
        c = min(max(k.max_chunk, self.chunks[0]), self.chunks[-1], b)
        return Knobs(b, c)

    def all_knobs(self) -> list[Knobs]:
        """Every distinct point (the exhaustive grid the benchmark compares against)."""
        return sorted({self.knobs(i, j) for i in range(len(self.budgets)) for j in range(len(self.chunks))},
                      key=lambda k: (k.token_budget, k.max_chunk))
