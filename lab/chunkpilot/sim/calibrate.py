"""The fitted step cost rescaled to an engine measured alone: two lone-request figures (a long prompt's TTFT, a
lone decode's inter-token gap) set two factors, one on the cost's per-prompt-token terms (prefill tokens, KV
reads) and one on its per-step terms (overhead, decodes).

Why: the shipped cost (cost_smollm2_cpu.json) was fitted on an engine using both cores, and bench/disaggregation.py
pins each engine to one core with one thread, where a prompt token costs about 2.8 times as much and a step's
overhead about 1.2 times (its own calibration says so). The scheduler's decisions do not depend on the cost, so
each figure is linear in the two factors, and two simulated runs of the lone request (each part of the cost
alone) give the 2x2 system."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.sim.costmodel import CostModel
from chunkpilot.sim.simulator import Simulator
from chunkpilot.tuner.space import Knobs


def lone_figures(cost: CostModel, prompt_tokens: int, max_tokens: int, knobs: Knobs) -> tuple[float, float]:
    """(TTFT, median inter-token gap) of one request alone on one simulated engine."""
    spec = RequestSpec("calibrate", [7] * prompt_tokens, max_tokens, 0.0, prompt_tokens)
    rec = Simulator(cost, [spec], knobs).run()[0]
    return rec.ttft, float(np.median(rec.itls))


def rescaled(cost: CostModel, ttft: float, itl: float, *, prompt_tokens: int = 1024, max_tokens: int = 32,
             knobs: Knobs = Knobs(272, 256)) -> CostModel:
    """`cost` with its prompt-token terms times a and its per-step terms times b, such that a lone request of
    `prompt_tokens` (and `max_tokens` out) under `knobs` has TTFT `ttft` and median gap `itl`. Raises ValueError
    when no positive pair of factors does."""
    prompt = replace(cost, overhead=0.0, decode_seqs=0.0)
    step = replace(cost, prefill_tokens=0.0, kv_reads=0.0)
    (p_ttft, p_itl), (s_ttft, s_itl) = (lone_figures(c, prompt_tokens, max_tokens, knobs) for c in (prompt, step))
    a, b = np.linalg.solve(np.array([[p_ttft, s_ttft], [p_itl, s_itl]]), np.array([ttft, itl]))
    if not (a > 0 and b > 0):
        raise ValueError(f"no positive rescaling of the cost gives TTFT {ttft:.3f} s and ITL {itl:.3f} s "
                         f"(factors {a:.3g}, {b:.3g})")
    return CostModel(overhead=cost.overhead * b, prefill_tokens=cost.prefill_tokens * a,
                     decode_seqs=cost.decode_seqs * b, kv_reads=cost.kv_reads * a,
                     note=f"{cost.note}; rescaled to a lone engine's TTFT {ttft:.3f} s for {prompt_tokens} prompt "
                          f"tokens and {itl * 1000:.1f} ms per decode: prompt-token terms x{a:.2f}, per-step x{b:.2f}")
