"""How long a step takes, fitted online from the engine's own recent steps: what turns a latency deadline into
the prompt tokens a step may carry (per-request SLO classes: the scheduler sizes a step so the tightest running
decode keeps its ITL).

seconds ~ overhead + per_token x prompt tokens + per_decode x decodes + per_kkey x thousands of keys read (the
step-cost contract's attention term, chunkpilot.contract.step_cost.kv_kilotokens: a chunk deep in a long prompt
reads every key before it, so 256 tokens at position 2,000 cost nearly twice what they cost at 0 on the CPU).
Least squares over the steps with exponentially fading weights (a step's weight halves every HALF_LIFE steps), so
a changed load or a warmed-up device is followed within a few hundred steps. Torch-free; the scheduler owns one
and the step loop (or the simulator) feeds it every step."""

from __future__ import annotations

import math

import numpy as np

from chunkpilot.contract.step_cost import kv_kilotokens

HALF_LIFE = 200  # steps
MIN_STEPS = 16  # before this many steps the clock answers nothing: no cap rather than a guess
MIN_PROMPT_STEPS = 4  # steps with prompt tokens: the per-token cost needs them (decode-only steps fix the rest)


class StepClock:
    def __init__(self, half_life: int = HALF_LIFE) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self._yy = 0.0  # the faded sum of squared step times, and of weights: the fit's residual from the sums
        self._weight = 0.0
        self.steps = 0
        self.prompt_steps = 0
        self._coef: np.ndarray | None = None

    def add(self, prompt_tokens: int, decodes: int, kv_kilo: float, seconds: float) -> None:
        x = np.array((1.0, float(prompt_tokens), float(decodes), float(kv_kilo)))
        self._xtx = self._xtx * self._decay + np.outer(x, x)
        self._xty = self._xty * self._decay + x * seconds
        self._yy = self._yy * self._decay + seconds * seconds
        self._weight = self._weight * self._decay + 1.0
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

    def noise(self) -> float:
        """The standard deviation of recent steps' times about the fit, in seconds (0 while it is unknown): what a
        step's prediction may be off by on a busy machine (tens of milliseconds on a shared CPU)."""
        c = self.coefficients()
        if c is None or self._weight <= 4:
            return 0.0
        rss = self._yy - 2 * c @ self._xty + c @ self._xtx @ c  # yᵀy − 2cᵀXᵀy + cᵀXᵀXc
        return math.sqrt(max(0.0, rss) / (self._weight - 4))

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
