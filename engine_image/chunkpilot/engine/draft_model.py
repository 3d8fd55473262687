"""A draft model as speculative decoding's proposer (vLLM's `draft_model` method): a smaller model with the
target's tokenizer writes the next k tokens of every drafting sequence greedily, and the target verifies them.

The draft model runs in an engine of its own (LLMEngine: its paged KV cache, its scheduler, its prefix cache), in
this process and on this process's device. Each step the drafting sequences go in as prompts (their tokens so far)
with max_tokens k: the prefix cache holds every full block of a sequence's context from the step before, so only
the last partial block and the tokens accepted since are computed again, then k - 1 decode steps, batched over
the sequences. Its pool has as many blocks as the target's, so it can keep every running sequence's context (the
blocks are smaller: the draft has fewer layers or narrower ones).

Drafts are the draft model's greedy choices, one guess each: verification treats them as certain (as for the
n-gram lookup), which keeps the target's own distribution for sampled requests too (sampler.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.sampling_params import SamplingParams
from chunkpilot.engine.tokenizer import Tokenizer


class DraftModelProposer:
    def __init__(self, model: str, target: EngineConfig, *, max_model_len: int, num_blocks: int, vocab_size: int,
                 tokenizer: Tokenizer) -> None:
        from chunkpilot.engine.llm_engine import LLMEngine  # the engine builds its proposer: import at call time

        draft_tokenizer = Tokenizer(model)
        if draft_tokenizer.vocab() != tokenizer.vocab():
            raise ValueError(f"the draft model {model} has another tokenizer than the model it drafts for (their "
                             "vocabularies differ): a draft model must share its target's tokenizer")
        config = replace(
            target, model=model, speculative_config=None, tensor_parallel_size=1, max_model_len=max_model_len,
            num_kv_blocks=num_blocks, enable_prefix_caching=True, threads=None,
            # the first drafts for a long prompt prefill it whole: in few steps, it holds the target's step loop
            token_budget=max(target.token_budget, 2048), max_chunk=max(target.max_chunk, 2048),
            max_token_budget=None,
        )
        self.engine = LLMEngine(config, exit_on_rank_failure=False)
        self.vocab_size = vocab_size  # of the target's embedding: a draft id beyond it could not be verified
        self._ids = itertools.count()

    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        engine = self.engine
        drafts: dict[str, list[int]] = {}
        order: list[str | None] = []
        for token_ids, k in requests:
            if k <= 0 or len(token_ids) + k > engine.max_model_len:
                order.append(None)
                continue
            rid = f"draft-{next(self._ids)}"
            engine.submit(engine.make_sequence(rid, list(token_ids),
                                               SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)))
            drafts[rid] = []
            order.append(rid)
        remaining = len(drafts)
        while remaining:
            for out in engine.step():
                drafts[out.request_id].extend(out.new_token_ids)
                remaining -= out.finished
        return [self._in_vocab(drafts[rid]) if rid else [] for rid in order]

    def _in_vocab(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t >= self.vocab_size:
                return tokens[:i]
        return tokens
