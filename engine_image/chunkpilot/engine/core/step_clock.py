"""How long a step takes, fitted online from the engine's own recent steps: what turns a latency deadline into
the prompt tokens a step may carry (per-request SLO classes: the scheduler sizes a step so the tightest running
decode keeps its ITL).

seconds ~ overhead + per_token x prompt tokens + per_decode x decodes + per_kkey x thousands of keys read (the
step-cost contract's attention term, chunkpilot.contract.step_cost.kv_kilotokens: a chunk deep in a long prompt
reads every key before it, so 256 tokens at position 2,000 cost nearly twice what they cost at 0 on the CPU).
Least squares over the steps with exponentially fading weights (a step's weight halves every HALF_LIFE steps), so
a changed load or a warmed-up device is followed within a few hundred steps. Torch-free; the scheduler owns one
and, with classes (nothing reads it without), the step loop (or the simulator) feeds it every step.

What a step may be off by is relative: the clock keeps each recent prompt step's measured over predicted time, and
`overrun()` is an upper quantile of that ratio, the factor the scheduler divides its step target by. (An absolute
margin, twice the residual spread, was set by the many small decode steps while the overruns that missed grew with
the step: on the shared 2-core CPU the ratio's median was 1.0, its 90th percentile 1.26-1.38.)"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from chunkpilot.contract.step_cost import kv_kilotokens

HALF_LIFE = 200  # steps
MIN_STEPS = 16  # before this many steps the clock answers nothing: no cap rather than a guess
MIN_PROMPT_STEPS = 4  # steps with prompt tokens: the per-token cost needs them (decode-only steps fix the rest)
# The overrun: this quantile of the last RATIO_WINDOW prompt steps' measured / predicted time (the steps whose size
# the scheduler chooses: prompt chunks). Until MIN_RATIOS are in, PRIOR_OVERRUN: about the 90th percentile measured
# on the shared 2-core CPU (its 95th is a little higher), so a cold engine's steps are sized a little shorter than
# the CPU needs rather than much longer than a quiet device does; a GPU measures its own (within a few percent).
OVERRUN_QUANTILE = 0.95
RATIO_WINDOW = 256
MIN_RATIOS = 32
PRIOR_OVERRUN = 1.3


class StepClock:
    def __init__(self, half_life: int = HALF_LIFE) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self.steps = 0
        self.prompt_steps = 0
        self._coef: np.ndarray | None = None
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)
        self._overrun: float | None = None

    def add(self, prompt_tokens: int, decodes: int, kv_kilo: float, seconds: float, judged: bool = True) -> None:
        """A step's time; `judged`: a step the scheduler sized (prompt chunks, not only drafts), whose measured over
        predicted time counts in the overrun."""
        x = np.array((1.0, float(prompt_tokens), float(decodes), float(kv_kilo)))
        c = self.coefficients()
        if c is not None and judged and prompt_tokens > 0:  # by the fit it was sized with, before it joins it
            predicted = float(c @ x)
            if predicted > 0:
                self._ratios.append(seconds / predicted)
                self._overrun = None
        self._xtx = self._xtx * self._decay + np.outer(x, x)
        self._xty = self._xty * self._decay + x * seconds
        self.steps += 1
        self.prompt_steps += prompt_tokens > 0
        self._coef = None

    def coefficients(self) -> np.ndarray | None:
        """(overhead, per prompt token, per decode, per thousand keys) in seconds; None: too few steps yet."""
        if self.steps < MIN_STEPS or self.prompt_steps < MIN_PROMPT_STEPS:
            return None
        if self._coef is None:
            ridge = 1e-9 * np.trace(self._xtx) * np.eye(4)
            self._coef = np.maximum(np.linalg.solve(self._xtx + ridge, self._xty), 0.0)  # cost never falls with work
        return self._coef

    def overrun(self) -> float:
        """How much longer than predicted a prompt step may run: OVERRUN_QUANTILE of the recent steps' measured over
        predicted time, never below 1 (PRIOR_OVERRUN until MIN_RATIOS steps are in)."""
        if len(self._ratios) < MIN_RATIOS:
            return PRIOR_OVERRUN
        if self._overrun is None:
            self._overrun = max(1.0, float(np.quantile(np.fromiter(self._ratios, float), OVERRUN_QUANTILE)))
        return self._overrun

    def base_seconds(self, decodes: int, decode_kv_kilo: float) -> float | None:
        """A step's time before any prompt chunk: the overhead and its decodes."""
        c = self.coefficients()
        return None if c is None else float(c[0] + c[2] * decodes + c[3] * decode_kv_kilo)

    def chunk_seconds(self, start: int, n: int) -> float:
        c = self.coefficients()
        return 0.0 if c is None else float(c[1] * n + c[3] * kv_kilotokens(start, n))

    def chunk_tokens_within(self, seconds: float, start: int) -> int | None:
        """The longest chunk starting at position `start` that costs at most `seconds`; None: no limit known."""
        c = self.coefficients()
        if c is None or (c[1] <= 0 and c[3] <= 0):
            return None
        if seconds <= 0:
            return 0
        # c1 n + c3 (n start + n (n + 1) / 2) / 1000 <= seconds: a quadratic in n
        a, b = c[3] / 2000.0, c[1] + c[3] * (start + 0.5) / 1000.0
        n = seconds / b if a <= 0 else (-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)
        return max(0, math.floor(n + 1e-9))
