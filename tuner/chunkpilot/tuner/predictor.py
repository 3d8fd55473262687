"""What candidate knobs would do at the measured load, from the step-time model (chunkpilot.tuner.step_model):
the inter-token latency p99, the prefill capacity and its utilization, and a TTFT estimate. Pure functions, so the
tuner can screen every candidate before trying one (chunkpilot.tuner.guide).

The scheduler's semantics (docs/architecture.md) make the worst decode gap easy to name: a step first gives one token to every
running decode, then spends the rest of the token budget on prompt chunks of at most `max_chunk` tokens. While
prompts wait, a step carries the running decodes plus a full prefill share; that step's time is the gap every
decode sees. How often such steps happen is the prefill utilization: prompt-token demand over what the knobs let
through."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from chunkpilot.contract.step_cost import features_of, kv_kilotokens
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.step_model import StepModel, UpperBound


@dataclass(frozen=True)
class Load:
    """One pod's load, as Prometheus measures it over a window."""

    request_rate: float  # requests arriving per second
    prompts: tuple[tuple[float, float], ...]  # (prompt tokens, share of requests): the mix, e.g. from histogram buckets
    running: float  # decodes in flight on average
    mean_context: float = 512.0  # positions a decode attends over, on average
    # Speculative decoding, per step on average: the decodes that carried drafts and their draft tokens. A decode
    # with k drafts is a decode and k token rows, costed as the engine counts it (step_cost), and its drafts come
    # out of the budget before any prompt chunk. 0: off, or nothing drafted.
    drafting: float = 0.0
    draft_tokens: float = 0.0
    # The busiest pod's arrivals over the mean pod's (imbalance_of): a prefix-aware picker keeps a tenant on the pod
    # that caches its prefix, and the SLO is lost on that pod first. Assumed to hold when the pods change (a new pod
    # takes a mean share of the arrivals, so the busiest pod's share shrinks with the mean).
    imbalance: float = 1.0

    def busiest(self) -> "Load":
        """The busiest pod's load: what knobs are predicted on."""
        if self.imbalance <= 1.0:
            return self
        return replace(self, request_rate=self.request_rate * self.imbalance, running=self.running * self.imbalance,
                       imbalance=1.0)

    def scaled(self, factor: float) -> "Load":
        """`factor` times the arrivals and decodes in flight, the rest (mix, drafts, imbalance) kept."""
        return replace(self, request_rate=self.request_rate * factor, running=self.running * factor)

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
# The ITL p99 is read at a tail this many times thinner (p99 -> p99.75). A window's p99 is a p99 of a few hundred
# gaps, and the prefill steps sit right at that edge: at 0.15 req/s with one-step prompts they were 0.8 % of the
# gaps, so the p99 read the decode step (0.06 s) while the demo's windows measured the prefill stall (0.4 s).
# Bursts put several prompts into one window; the thinner tail counts a step kind that is rare on average.
WINDOW_TAIL = 4.0


def prompts_from_buckets(buckets: dict[float, float], mean: float | None = None) -> tuple[tuple[float, float], ...]:
    """A prompt mix from a cumulative histogram {upper bound: count} (what Prometheus returns): each bucket's
    requests at its upper bound, the +Inf bucket at twice the last finite bound; then, when the true `mean` is
    known (the histogram's _sum / _count), every length scaled so the mix has that mean. Upper bounds alone
    overstate prompts by up to the buckets' ratio (2x doubling, 2.5x for the engine's 1-2-5 layout), and with
    them the prompt demand."""
    out, prev_le, prev = [], 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le] - prev
        if count > 0:
            out.append((2 * prev_le if math.isinf(le) else le, count))
        prev_le, prev = (prev_le if math.isinf(le) else le), buckets[le]
    total = sum(w for _, w in out)
    if mean and total > 0:
        scale = mean / (sum(n * w for n, w in out) / total)
        out = [(max(1.0, n * scale), w) for n, w in out]
    return tuple(out)


def _chunks(tokens: int, max_chunk: int, start: float) -> list[tuple[float, int]]:
    """(start, tokens) of the prompt chunks that fill `tokens` of a step, at most max_chunk each."""
    out = []
    while tokens > 0:
        n = min(tokens, max_chunk)
        out.append((start, n))
        tokens -= n
        start += n
    return out


@dataclass(frozen=True)
class _Decodes:
    """What the running decodes put into every step: one decode each, the draft tokens of those with drafts (token
    rows, counted with the prompt tokens as the engine counts them: step_cost), the keys they read and the
    budget they use."""

    decodes: int
    draft_tokens: float
    kv: float

    @classmethod
    def of(cls, load: Load) -> "_Decodes":
        decodes = max(0, round(load.running))
        drafting = min(float(decodes), max(0.0, load.drafting))
        k = load.draft_tokens / load.drafting if drafting > 0 else 0.0  # drafts per drafting decode
        kv = (decodes - drafting) * kv_kilotokens(load.mean_context, 1) + \
            drafting * kv_kilotokens(load.mean_context, 1 + k)
        return cls(decodes, drafting * k, kv)

    @property
    def budget(self) -> float:
        return self.decodes + self.draft_tokens


def full_step_features(knobs: Knobs, load: Load) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The feature vectors of the two steps these knobs are judged by at this load: decode-only (the running
    decodes, their drafts too) and full (the decodes plus a full prompt share in chunks of at most max_chunk)."""
    d = _Decodes.of(load)
    share = max(1, round(knobs.token_budget - d.budget))
    chunks = _chunks(share, knobs.max_chunk, load.mean_prompt_tokens / 2)
    return (features_of(d.draft_tokens, d.decodes, d.kv),
            features_of(share + d.draft_tokens, d.decodes, d.kv + sum(kv_kilotokens(s, n) for s, n in chunks)))


def imbalance_of(arrivals: list[float], pods: int) -> float:
    """The busiest pod's arrivals in a window over the mean pod's, less what Poisson counts vary by: the busiest
    count is discounted by two standard deviations of the mean count (sqrt of it), so an even pool reads 1 (three
    pods at 40 arrivals each: the busiest often counts 50) and a picker's concentration does not (0.6/0.2/0.2 of
    120: 72 against 40 reads 1.48)."""
    mean = sum(arrivals) / max(1, pods)
    if mean <= 0 or not arrivals:
        return 1.0
    return max(1.0, (max(arrivals) - 2.0 * math.sqrt(mean)) / mean)


def predict(model: StepModel | UpperBound, knobs: Knobs, load: Load, quantile: float = 0.99) -> Prediction:
    """What `knobs` do on the busiest pod at `load`."""
    load = load.busiest()
    d = _Decodes.of(load)
    share = max(1, round(knobs.token_budget - d.budget))  # what a step has left for prompts
    per_prompt = min(knobs.max_chunk, share)  # one prompt gets at most this many tokens a step
    mean_prompt = load.mean_prompt_tokens

    def step(chunks: list[tuple[float, int]]) -> float:
        """Seconds of a step with the running decodes and these prompt chunks (from the totals: the screen
        predicts every candidate, thousands of steps each)."""
        kv = d.kv + sum(kv_kilotokens(start, n) for start, n in chunks)
        seconds = model.step_seconds(features_of(sum(n for _, n in chunks) + d.draft_tokens, d.decodes, kv))
        return max(MIN_STEP_SECONDS, seconds)  # a thin window's fit can zero every coefficient a step uses

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
            # Alone in the step, or (while other prompts wait: about u of the time, as in an M/M/1 queue where
            # P(another waits | busy) = u) with the rest of the share full of other prompts' chunks.
            for others, share_of_steps in ((0, 1 - u), (share - n, u)):
                if share_of_steps <= 0:
                    continue
                seconds = step([(start, n)] + _chunks(others, knobs.max_chunk, mean_prompt / 2))
                gaps.append((seconds, rate * share_of_steps))
                busy += rate * share_of_steps * seconds
            start, left = start + n, left - n
    gaps.append((decode_step, max(0.0, 1 - busy) / decode_step))
    total = sum(r for _, r in gaps)
    above, itl, prefill_step = 0.0, decode_step, decode_step
    for seconds, r in sorted(gaps, reverse=True):
        above += r
        if above >= (1 - quantile) / WINDOW_TAIL * total:
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
                        [(0, int(long))])
        service = math.ceil(long / per_prompt) * per_step
        mean_service = busy / load.request_rate if load.request_rate > 0 else 0.0
        tail = 1 - quantile
        wait = mean_service / (1 - u) * math.log(u / tail) if u > tail else 0.0
        ttft = service + wait + decode_step
    return Prediction(decode_step=decode_step, prefill_step=prefill_step, prefill_capacity=capacity,
                      utilization=utilization, itl_p99=itl, ttft_p99=ttft)
