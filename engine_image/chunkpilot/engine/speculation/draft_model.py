"""A draft model as speculative decoding's proposer (vLLM's `draft_model` method): a smaller model with the
target's tokenizer writes the next k tokens of every drafting sequence greedily, and the target verifies them.

The draft model runs in an engine of its own (an LLMEngine, built by the target engine's `new_engine`: its paged KV
cache, its scheduler, its prefix cache), in this process and on this process's device. Each step the drafting
sequences go in as prompts (their tokens so far) with max_tokens k: the prefix cache holds every full block of a
sequence's context from the step before, so only the last partial block and the tokens accepted since are
computed again, then k - 1 decode steps, batched over the sequences. Its pool has as many blocks as the target's,
so it can keep every running sequence's context (the blocks are smaller: the draft has fewer layers or narrower
ones).

Drafts are the draft model's greedy choices, one guess each: verification treats them as certain (as for the
n-gram lookup), which keeps the target's own distribution for sampled requests too (execution/sampler.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class DraftEngine(Protocol):
    """What the proposer uses of the engine that runs the draft model (an LLMEngine)."""

    max_model_len: int
    model_config: Any  # its vocab_size

    def make_sequence(self, request_id: str, prompt: list[int], params: SamplingParams) -> Any: ...
    def submit(self, seq: Any) -> None: ...
    def step(self) -> list[Any]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...


class DraftModelProposer:
    def __init__(self, model: str, target: EngineConfig, *, max_model_len: int, num_blocks: int, vocab_size: int,
                 tokenizer: Tokenizer, new_engine: Callable[[EngineConfig], DraftEngine]) -> None:
        # the tokenizers are compared before the draft's weights load: a wrong draft is refused in a moment
        draft_tokenizer = Tokenizer(model)
        if draft_tokenizer.vocab() != tokenizer.vocab():
            raise ValueError(f"the draft model {model} has another tokenizer than the model it drafts for (their "
                             "vocabularies differ): a draft model must share its target's tokenizer")
        config = replace(
            target, model=model, speculative_config=None, tensor_parallel_size=1, max_model_len=max_model_len,
            num_kv_blocks=num_blocks, enable_prefix_caching=True, threads=None,
            # the target's start-up budget: a budget that fits the target's activations fits the smaller draft's
            max_token_budget=None,
        )
        self.engine = new_engine(config)
        # Two models may share a tokenizer and not their embedding sizes (padding rows): a draft id beyond the
        # target's could not be verified, and a prompt id beyond the draft's cannot be drafted for.
        self.vocab_size = vocab_size
        self.draft_vocab_size = self.engine.model_config.vocab_size
        self._ids = itertools.count()
        self.failed = False

    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        engine = self.engine
        if self.failed:
            return [[] for _ in requests]
        drafts: dict[str, list[int]] = {}
        order: list[str | None] = []
        try:
            for token_ids, k in requests:
                if (k <= 0 or len(token_ids) + k > engine.max_model_len
                        or max(token_ids, default=0) >= self.draft_vocab_size):
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
        except Exception:
            # Drafts are only guesses: a draft engine that fails costs this step its drafts, never the target's
            # requests. Its unfinished requests are aborted so the next step starts clean; if even that fails,
            # drafting stops for good (the engine serves on without it).
            log.exception("the draft model failed; this step runs without drafts")
            try:
                for rid in drafts:
                    engine.abort(rid)
                while engine.has_unfinished():
                    engine.step()
            except Exception:
                log.exception("the draft model cannot recover; speculative decoding is off from now on")
                self.failed = True
            return [[] for _ in requests]
        return [self._in_vocab(drafts[rid]) if rid else [] for rid in order]

    def _in_vocab(self, tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t >= self.vocab_size:
                return tokens[:i]
        return tokens
