"""Whether a decode engine tries another prefill pod after one failed a prompt, decided from what it measures
itself (docs/disaggregation.md, "Failures lose nothing").

The rule, `should_retry`: the failure was the prefill pod's, not this engine's; fewer retries were made than
allowed; and the failed attempt took less time than prefilling the prompt's uncached tokens here would take. The
time already spent is lost whichever way the request goes next, so only what comes after it is compared: another
attempt is expected to cost about what the failed one did (the same prompt, on a peer no more loaded, as power of
two choices picks it), a local prefill what this engine's own prefill steps cost per prompt token
(`LocalPrefillCost`). The engine knows no TTFT target (the tuner holds the SLO), so "the slack allows" is read as
"the retry is not expected to make the first token later than falling back would"."""

from __future__ import annotations

from chunkpilot.contract.metric_names import KV_RETRY_REASONS

# How much the steps measured before weigh against each new step that computed prompt tokens: the last ~20 such
# steps (1 / (1 - 0.95)) dominate, a few prompts' worth of chunks, so the estimate follows the load of the last
# seconds rather than the pod's whole life.
DECAY = 0.95


def should_retry(reason: str, retries_done: int, max_retries: int, spent: float,
                 local_seconds: float | None) -> bool:
    """After a prefill pod failed a prompt for `reason`, `spent` seconds into that attempt: try another one?
    `local_seconds`: what prefilling the prompt's uncached tokens here is estimated to take; None before this
    engine has computed any prompt token, when there is nothing to compare with and the prefill pods, where the
    deployment wants long prompts computed, get the try."""
    if reason not in KV_RETRY_REASONS or retries_done >= max_retries:
        return False
    return local_seconds is None or spent < local_seconds


class LocalPrefillCost:
    """Seconds per prompt token of this engine's own steps that computed prompt tokens, as the
    prefill_busy_seconds and prefill_computed_tokens counters count them, recent steps weighing most. The decodes
    that shared those steps are in the seconds on purpose: they delay a local prefill just as much. Written by the
    step loop, read on the event loop: the two sums are one tuple, replaced whole, so a reader never sees half."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._sums = (0.0, 0.0)  # (seconds, prompt tokens), decayed

    def add(self, seconds: float, tokens: int) -> None:
        s, t = self._sums
        self._sums = (s * self.decay + seconds, t * self.decay + tokens)

    def seconds(self, tokens: int) -> float | None:
        """Estimated seconds to compute `tokens` prompt tokens here; None before any step computed one."""
        s, t = self._sums
        return tokens * s / t if t > 0 else None
