"""The search space: (token_budget, max_chunk) inside the spec's bounds, on a log scale, in multiples of a step;
with disaggregation in auto also the decode pods' threshold and the split (how many pods serve as prefill pods).

Optuna cannot sample an integer on a log scale *and* in steps, and max_chunk <= token_budget would make the range
of one parameter depend on another (which TPE models badly). So both are ordinal indices into fixed log-spaced
grids of step multiples, and max_chunk is clipped to the budget afterwards.

The threshold (spec.disaggregation.mode auto with tuning.mode auto) is a third ordinal index: powers of two from
the KV block size (a prompt of fewer uncached tokens than one block is never worth a transfer) up to the longest
prompt the model takes, then DISAGG_NEVER (colocated) as the last point, so "more local prefill" is one direction
of the index and colocated is its end. Without it (every other resource) the space has no third index at all:
the same Optuna parameters, the same draws, the same knobs as before.

The split is a fourth ordinal index, over 1 .. pods - 1 prefill pods (the operator switches pods' roles while they
serve, operator/role_split.py): a finite threshold runs on that many prefill pods, "never" on none (colocated: a
prefill pod with nothing to prefill would be a pod lost to the clients).

With the split comes a fifth ordinal index: the prefill pods' own token budget, which is their max chunk too, one
point per octave over the spec's budget bounds (the largest kept). A prefill pod carries no decode whose gaps a
small chunk would protect; its step's size trades the throughput of its prompts against how long a prompt waits
behind another's chunk, and the clients' TTFT, measured on the decode pods as for every trial, judges that. At
"never" it is unused (no prefill pod), as the split's index is."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunkpilot.contract.knobs import DISAGG_NEVER, Knobs  # the one knobs type; the tuner's points are these

# The longest prompt the threshold grid reaches when the spec does not say (spec.model.maxModelLen unset, the
# model's own limit unknown to the tuner): 32768 tokens, the context of most current small and mid-size models;
# a longer prompt is sent remotely at every finite threshold on the grid, which is what a long prompt wants.
DEFAULT_THRESHOLD_MAX = 32768


def threshold_grid(lo: int, hi: int) -> tuple[int, ...]:
    """The disaggregation thresholds the tuner tries: lo, 2 lo, 4 lo, ... up to hi (hi kept), then DISAGG_NEVER.
    One point per octave: the prompt lengths a threshold separates are log-spread, and a finer grid would spend
    trials on splits that route the same prompts."""
    if lo < 1 or hi < lo:
        raise ValueError(f"threshold bounds must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    return (*octaves(lo, min(hi, DISAGG_NEVER - 1)), DISAGG_NEVER)


def octaves(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below hi, then hi: the prefill pods' budgets (a step's size matters by its octave)."""
    if lo < 1 or hi < lo:
        raise ValueError(f"bounds must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return (*out, hi)


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
    thresholds: tuple[int, ...] = ()  # empty: the threshold is not searched (knobs carry None)
    splits: tuple[int, ...] = ()  # prefill pods a split may run on (1 .. pods - 1); empty: the split is not searched
    prefill_budgets: tuple[int, ...] = ()  # the prefill pods' budget (= chunk) on a split; searched with the split

    @classmethod
    def from_bounds(cls, budget: tuple[int, int], chunk: tuple[int, int], step: int = 16,
                    points_per_octave: int = 4, threshold: tuple[int, int] | None = None,
                    pods: int | None = None) -> SearchSpace:
        """`pods`: the resource's pod count, whose split between the roles is searched with the threshold."""
        splits = tuple(range(1, pods)) if threshold is not None and pods is not None and pods >= 2 else ()
        return cls(tuple(log_grid(*budget, step, points_per_octave)), tuple(log_grid(*chunk, step, points_per_octave)),
                   () if threshold is None else threshold_grid(*threshold), splits,
                   octaves(*budget) if splits else ())

    def knobs(self, budget_index: int, chunk_index: int, threshold_index: int | None = None,
              split_index: int | None = None, prefill_index: int | None = None) -> Knobs:
        b = self.budgets[budget_index]
        t = None if threshold_index is None or not self.thresholds else self.thresholds[threshold_index]
        p = pb = None
        if self.splits:
            p = 0 if t is None or t >= DISAGG_NEVER else self.splits[split_index or 0]
            # no index (a caller that does not search it): the largest, a prefill pod's throughput
            pb = None if p == 0 else self.prefill_budgets[-1 if prefill_index is None else prefill_index]
        return Knobs(b, min(b, self.chunks[chunk_index]), t, p, pb)

    def params(self, k: Knobs) -> dict[str, int]:
        """The Optuna parameters of the grid point nearest to k (used to enqueue known knobs, e.g. the incumbent or
        the colocated reference): the threshold's index only where the space searches it."""
        bi = int(np.argmin([abs(np.log(b / k.token_budget)) for b in self.budgets]))
        ci = int(np.argmin([abs(np.log(c / k.max_chunk)) for c in self.chunks]))
        out = {"budget_index": bi, "chunk_index": ci}
        if self.thresholds:  # knobs without one (the start-up knobs) are taken as colocated, the safe end
            t = DISAGG_NEVER if k.disagg_threshold is None else k.disagg_threshold
            out["threshold_index"] = int(np.argmin([abs(np.log(v / max(1, t))) for v in self.thresholds]))
        if self.splits:  # colocated (0) is the threshold's "never"; its split and prefill budget indices are any
            out["split_index"] = int(np.argmin([abs(p - (k.prefill_pods or 1)) for p in self.splits]))
            pb = k.prefill_budget or self.prefill_budgets[-1]
            out["prefill_index"] = int(np.argmin([abs(np.log(v / pb)) for v in self.prefill_budgets]))
        return out

    def colocated(self, k: Knobs) -> Knobs:
        """k's budget and chunk with no prompt sent to a prefill pod, and every pod serving clients: the reference
        a split must beat."""
        return Knobs(k.token_budget, k.max_chunk, DISAGG_NEVER if self.thresholds else None,
                     0 if self.splits else None)  # and no prefill pod, so no prefill budget

    def clamp(self, k: Knobs) -> Knobs:
        b = min(max(k.token_budget, self.budgets[0]), self.budgets[-1])
        c = min(max(k.max_chunk, self.chunks[0]), self.chunks[-1], b)
        t = k.disagg_threshold
        if self.thresholds and t is not None:
            t = min(max(t, self.thresholds[0]), DISAGG_NEVER)
        p = pb = None
        if self.splits:
            p = 0 if t is None or t >= DISAGG_NEVER else min(max(k.prefill_pods or 1, 1), self.splits[-1])
            if p:
                pb = min(max(k.prefill_budget or self.prefill_budgets[-1], self.prefill_budgets[0]),
                         self.prefill_budgets[-1])
        return Knobs(b, c, t if self.thresholds else None, p, pb)

    def pairs(self) -> list[Knobs]:
        """Every distinct (token budget, max chunk), threshold None: what the step-time model judges."""
        return sorted({self.knobs(i, j) for i in range(len(self.budgets)) for j in range(len(self.chunks))},
                      key=lambda k: (k.token_budget, k.max_chunk))

    def all_knobs(self) -> list[Knobs]:
        """Every distinct point (the exhaustive grid the benchmark compares against)."""
        if not self.thresholds:
            return self.pairs()
        return sorted({self.clamp(Knobs(p.token_budget, p.max_chunk, t, s, pb)) for p in self.pairs()
                       for t in self.thresholds for s in (self.splits or (None,))
                       for pb in (self.prefill_budgets or (None,))},
                      key=lambda k: (k.token_budget, k.max_chunk, k.disagg_threshold, k.prefill_pods or 0,
                                     k.prefill_budget or 0))
