"""What candidate knobs would do at the measured load, from the step-time model (chunkpilot.tuner.step_model):
the inter-token latency p99, the prefill capacity and its utilization, and a TTFT estimate. Pure functions, so the
tuner can screen every candidate before trying one (groundwork for issue 15: nothing calls it yet).

The scheduler's semantics (DESIGN.md) make the worst decode gap easy to name: a step first gives one token to every
running decode, then spends the rest of the token budget on prompt chunks of at most `max_chunk` tokens. While
prompts wait, a step carries the running decodes plus a full prefill share; that step's time is the gap every
decode sees. How often such steps happen is the prefill utilization: prompt-token demand over what the knobs let
through."""

from __future__ import annotations

import math
from dataclasses import dataclass

from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.step_model import StepModel


@dataclass(frozen=True)
class Load:
    """One pod's load, as Prometheus measures it over a window."""

    request_rate: float  # requests arriving per second
    prompts: tuple[tuple[float, float], ...]  # (prompt tokens, share of requests): the mix, e.g. from histogram buckets
    running: float  # decodes in flight on average
    mean_context: float = 512.0  # positions a decode attends over, on average

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(n * w for n, w in self.prompts) / max(1e-12, sum(w for _, w in self.prompts))

    def prompt_quantile(self, q: float) -> float:
        total, seen = sum(w for _, w in self.prompts), 0.0
        for n, w in sorted(self.prompts):
            seen += w
            if seen >= q * total:
                return n
        return max((n for n, _ in self.prompts), default=0.0)


@dataclass(frozen=True)
class Prediction:
    decode_step: float  # seconds of a step with only the running decodes
    prefill_step: float  # seconds of the step that sets the ITL tail (decodes plus prompt chunks)
    prefill_capacity: float  # prompt tokens per second the knobs let through (steps full of prefill)
    utilization: float  # prompt-token demand / capacity; >= 1 means the queue grows without bound
    itl_p99: float
    ttft_p99: float  # math.inf when utilization >= 1


MIN_STEP_SECONDS = 1e-4


def prompts_from_buckets(buckets: dict[float, float]) -> tuple[tuple[float, float], ...]:
    """A prompt mix from a cumulative histogram {upper bound: count} (what Prometheus returns): each bucket's
    requests at its upper bound, the safe side; the +Inf bucket at twice the last finite bound."""
    out, prev_le, prev = [], 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le] - prev
        if count > 0:
            out.append((2 * prev_le if math.isinf(le) else le, count))
        prev_le, prev = (prev_le if math.isinf(le) else le), buckets[le]
    return tuple(out)


def _chunks(tokens: int, max_chunk: int, start: float) -> list[tuple[int, int, bool]]:
    out = []
    while tokens > 0:
        n = min(tokens, max_chunk)
        out.append((int(start), n, False))
        tokens -= n
        start += n
    return out


def predict(model: StepModel, knobs: Knobs, load: Load, quantile: float = 0.99) -> Prediction:
    decodes = max(0, round(load.running))
    share = max(1, knobs.token_budget - decodes)  # what a step has left for prompts
    per_prompt = min(knobs.max_chunk, share)  # one prompt gets at most this many tokens a step
    decode_chunks = [(int(load.mean_context), 1, True)] * decodes
    mean_prompt = load.mean_prompt_tokens

    def step(chunks: list[tuple[int, int, bool]]) -> float:
        # A fit from a thin window can leave every coefficient a step uses at 0; no step takes no time.
        seconds = model.predict(decode_chunks + chunks) if decode_chunks or chunks else model.coefficients["overhead"]
        return max(MIN_STEP_SECONDS, seconds)

    decode_step = step([])
    full_step = step(_chunks(share, knobs.max_chunk, mean_prompt / 2))
    capacity = share / full_step  # prompt tokens/s when every step is full of prompt work
    utilization = load.request_rate * mean_prompt / capacity if capacity > 0 else math.inf
    u = min(utilization, 1.0)

    # Every prompt of L tokens is computed in ceil(L / per_prompt) steps, chunk after chunk (each chunk reads the
    # keys before it); as the queue grows, waiting prompts fill the rest of the share too (u of it, on average).
    # Each of those steps is one gap for every running decode; the others are decode-only steps.
    gaps: list[tuple[float, float]] = []  # (seconds, steps per second)
    busy = 0.0
    total_weight = sum(w for _, w in load.prompts) or 1.0
    for tokens, weight in load.prompts:
        rate = load.request_rate * weight / total_weight
        start, left = 0, int(round(tokens))
        while left > 0:
            n = min(left, per_prompt)
            others = int(u * (share - n))
            seconds = step([(start, n, False)] + _chunks(others, knobs.max_chunk, mean_prompt / 2))
            gaps.append((seconds, rate))
            busy += rate * seconds
            start, left = start + n, left - n
    gaps.append((decode_step, max(0.0, 1 - busy) / decode_step))
    total = sum(r for _, r in gaps)
    above, itl, prefill_step = 0.0, decode_step, decode_step
    for seconds, r in sorted(gaps, reverse=True):
        above += r
        if above >= (1 - quantile) * total:
            itl = seconds
            break
    prefill_step = max((s for s, _ in gaps[:-1]), default=decode_step)

    if utilization >= 1:
        ttft = math.inf
    else:
        # The long prompt's own steps, then the wait behind others: an M/G/1 queue's tail in the exponential
        # approximation, P(wait > t) = u·exp(-t(1-u)/mean service).
        long = load.prompt_quantile(quantile)
        per_step = step(_chunks(per_prompt, knobs.max_chunk, long / 2) if long > per_prompt else
                        [(0, int(long), False)])
        service = math.ceil(long / per_prompt) * per_step
        mean_service = busy / load.request_rate if load.request_rate > 0 else 0.0
        tail = 1 - quantile
        wait = mean_service / (1 - u) * math.log(u / tail) if u > tail else 0.0
        ttft = service + wait + decode_step
    return Prediction(decode_step=decode_step, prefill_step=prefill_step, prefill_capacity=capacity,
                      utilization=utilization, itl_p99=itl, ttft_p99=ttft)
