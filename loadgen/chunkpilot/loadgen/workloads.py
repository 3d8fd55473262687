"""Workloads: what to send (prompt lengths, output lengths, the mix of kinds) and when (arrivals).

Prompts are token-id lists of exact lengths, sent through the completions API (as `vllm bench serve --dataset
random` does), so a benchmark controls prefill work precisely; outputs run to `max_tokens` (`ignore_eos`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """Prompt and output length ranges (inclusive) of one kind of request."""

    prompt: tuple[int, int]
    output: tuple[int, int]


# `rag` prompts of 2k–8k tokens are the case chunked prefill exists for; `chat` is short.
SHAPES = {
    "chat": Shape(prompt=(16, 128), output=(16, 64)),
    "rag": Shape(prompt=(2048, 8192), output=(16, 64)),
}
MIXES = {"chat": {"chat": 1.0}, "rag": {"rag": 1.0}, "mixed": {"chat": 0.8, "rag": 0.2}}


@dataclass(frozen=True)
class Phase:
    """A stretch of the run with its own arrival rate (requests/s) and mix; a list of phases makes a workload
    that shifts during the run (for the tuner)."""

    duration: float
    rate: float
    mix: dict[str, float] = field(default_factory=lambda: dict(MIXES["mixed"]))


@dataclass
class RequestSpec:
    kind: str
    prompt: list[int] | str
    max_tokens: int
    arrival: float  # seconds after the run starts (0 for fixed-concurrency runs)
    prompt_tokens: int = 0
    slo_class: str | None = None  # sent as x-chunkpilot-slo-class (docs/slo-classes.md); None: the default class


def scaled(shape: Shape, scale: float, max_prompt: int | None) -> Shape:
    """Shrink prompt lengths (a CPU demo cannot prefill 8k tokens per request) and cap them at the model's limit."""
    lo, hi = (max(1, int(v * scale)) for v in shape.prompt)
    if max_prompt is not None:
        lo, hi = min(lo, max_prompt), min(hi, max_prompt)
    return Shape((lo, hi), shape.output)


def arrivals(phases: list[Phase], rng: np.random.Generator, *, burstiness: float = 1.0) -> list[tuple[float, Phase]]:
    """Arrival times phase by phase. burstiness 1 = Poisson; < 1 burstier, > 1 more regular (gamma-distributed
    gaps with shape = burstiness and the phase's mean rate, as vLLM's benchmark does)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    out, t0 = [], 0.0
    for phase in phases:
        if phase.rate <= 0:
            raise ValueError(f"phase rate must be > 0 requests/s, got {phase.rate}")
        t = t0
        while True:
            t += rng.gamma(shape=burstiness, scale=1.0 / (phase.rate * burstiness))
            if t >= t0 + phase.duration:
                break
            out.append((t, phase))
        t0 += phase.duration
    return out


def build_workload(
    phases: list[Phase],
    *,
    vocab_size: int,
    seed: int = 0,
    burstiness: float = 1.0,
    shapes: dict[str, Shape] | None = None,
    num_requests: int | None = None,
) -> list[RequestSpec]:
    """Requests for a rate-driven run (or, with num_requests and a single phase, the first N of it)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or SHAPES
    specs = []
    for t, phase in arrivals(phases, rng, burstiness=burstiness):
        specs.append(_request(phase.mix, shapes, vocab_size, rng, t))
        if num_requests is not None and len(specs) >= num_requests:
            break
    return specs


def build_requests(n: int, mix: dict[str, float], *, vocab_size: int, seed: int = 0,
                   shapes: dict[str, Shape] | None = None) -> list[RequestSpec]:
    """n requests with no arrival times, for fixed-concurrency runs."""
    rng = np.random.default_rng(seed)
    return [_request(mix, shapes or SHAPES, vocab_size, rng, 0.0) for _ in range(n)]


def _request(mix, shapes, vocab_size, rng, t) -> RequestSpec:
    kinds = sorted(mix)
    weights = np.array([mix[k] for k in kinds], dtype=float)
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    if kind not in shapes:
        raise ValueError(f"unknown request kind {kind!r}; known: {', '.join(sorted(shapes))}")
    shape = shapes[kind]
    n_prompt = int(rng.integers(shape.prompt[0], shape.prompt[1] + 1))
    n_out = int(rng.integers(shape.output[0], shape.output[1] + 1))
    # Stay clear of the lowest ids, where tokenizers keep special tokens.
    prompt = rng.integers(min(1000, vocab_size // 4), vocab_size, size=n_prompt).tolist()
    return RequestSpec(kind, prompt, n_out, float(t), n_prompt)


def load_jsonl(path: str | Path, *, rate: float | None, seed: int = 0, burstiness: float = 1.0) -> list[RequestSpec]:
    """One request per line: {"prompt": str | [ids], "max_tokens": int, "kind": str (optional)}."""
    specs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt, max_tokens = obj["prompt"], int(obj.get("max_tokens", 64))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: each line must be a JSON object with prompt and max_tokens ({e})") from None
        n = len(prompt) if isinstance(prompt, list) else 0
        specs.append(RequestSpec(str(obj.get("kind", "jsonl")), prompt, max_tokens, 0.0, n))
    if rate:
        rng = np.random.default_rng(seed)
        t = 0.0
        for s in specs:
            t += rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))
            s.arrival = t
    return specs
