"""When drafts pay, from the engine's own steps: the acceptance below which verifying drafts costs more than the
tokens it gains.

A step of b decodes takes T0 seconds without drafts; D draft tokens make it T0 + D·c, and gain the A of them the
model keeps. Throughput rises while (b + A) / (T0 + D·c) > b / T0, that is while A / D > b·c / T0: the
break-even acceptance.

Both are measured per batch size b on the engine's decode-only steps: T0 as the recent mean of the steps without
drafts, c as the recent mean of (T - T0) / D over the steps with them. Per batch size, because the cost of a row is
far from linear: on this CPU a batch-1 step costs the same with 1 to 3 rows (MKL's small-matrix path), while at
batch 8 a draft token measured about 6 ms on a 73 ms step (break-even about 63 %; two drafts of one decode alone
took it to 88-92 ms), and 16 drafts of eight decodes cost about 3 ms each (break-even about a third: text that
repeats its prompt keeps drafting there). T includes the proposer's own time (a draft model's forwards). A fixed threshold of 30 % let open questions, whose drafts are kept about a third of the time, lose 6-8 %
at batch 8 (bench/speculative.py). On a GPU a decode step is memory-bound and c is small: drafting pays more often.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT = 0.1  # of the newest step in each running mean: about the last 10-20 steps of a batch size count
MIN_SAMPLES = 3  # steps of each kind before a batch size's break-even is trusted; until then only the floor applies


@dataclass
class _Mean:
    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(WEIGHT, 1.0 / self.n) * (x - self.value)  # a plain mean until the weight takes over


@dataclass
class RowCost:
    """Per batch size: the decode-only step's seconds without drafts, and the seconds each draft token adds."""

    _base: dict[int, _Mean] = field(default_factory=dict)
    _per_draft: dict[int, _Mean] = field(default_factory=dict)

    def add(self, decodes: int, draft_tokens: int, seconds: float) -> None:
        """A decode-only step (no prompt tokens) of `decodes` decodes carrying `draft_tokens` drafts in all."""
        if decodes <= 0:
            return
        base = self._base.setdefault(decodes, _Mean())
        if draft_tokens == 0:
            base.add(seconds)
        elif base.n:
            self._per_draft.setdefault(decodes, _Mean()).add((seconds - base.value) / draft_tokens)

    def break_even(self, decodes: int) -> float:
        """The share of drafts that must be kept for drafting to pay in a step of `decodes` decodes. A batch size
        not yet seen often enough with and without drafts borrows the nearest one's costs (they change slowly
        with the batch: a batch shrinking as its requests finish must not draft freely at each new size); 0
        while no batch size has been."""
        known = [b for b, base in self._base.items() if base.n >= MIN_SAMPLES and base.value > 0
                 and b in self._per_draft and self._per_draft[b].n >= MIN_SAMPLES]
        if decodes <= 0 or not known:
            return 0.0
        b = min(known, key=lambda k: (abs(k - decodes), -k))  # the nearest; of two, the larger
        return min(1.0, max(0.0, decodes * self._per_draft[b].value / self._base[b].value))
