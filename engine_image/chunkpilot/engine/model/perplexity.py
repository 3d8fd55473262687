"""What a change to the weights (a quantization) costs in quality, measured on the engine as it serves: the
perplexity of a text under its own model (its attention, KV cache, chunked prefill and quantized layers), and how
far its greedy outputs agree with another's.

The text is sent as one prompt (max_tokens 1); a forward hook on the model's final norm keeps the hidden state of
every prompt position as the chunks run, and the model's own head turns them into next-token log-probabilities.
One rank only (under tensor parallelism the head's slices live on every rank)."""

from __future__ import annotations

import math

import torch

from chunkpilot.engine.core.sampling_params import SamplingParams


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of token i+1 given tokens 0..i) over `token_ids`, on `llm` (an
    chunkpilot.engine.LLM with one rank and prefix caching that cannot serve this text from earlier prompts)."""
    engine = llm.engine
    if engine.worker.group.distributed:
        raise ValueError("perplexity() runs on one rank (tensor_parallel_size 1)")
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    model = engine.model
    hidden: list[torch.Tensor] = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: hidden.append(out.detach()))
    try:
        llm.generate(list(token_ids), SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        handle.remove()
    h = torch.cat(hidden)[: len(token_ids) - 1]  # the prompt's chunks in order; the one decode step (if any) after
    if h.shape[0] != len(token_ids) - 1:
        raise RuntimeError(f"the prompt's forward covered {h.shape[0]} positions, expected {len(token_ids) - 1} "
                           "(a prefix-cache hit skips positions: use a fresh engine or enable_prefix_caching=False)")
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, h.shape[0], 256):  # the head over 256 rows at a time: [256, vocab] floats
            logits = model.logits(h[start:start + 256]).float()
            targets = torch.tensor(token_ids[start + 1:start + 1 + logits.shape[0]], device=logits.device)
            nll -= float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum())
    return math.exp(nll / h.shape[0])


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of `a`'s greedy tokens equal to `b`'s, each output counted up to its first difference (after it
    the texts part, and comparing them says nothing more about the weights)."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(1, sum(len(x) for x in a))
