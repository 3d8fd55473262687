"""Speculative decoding's proposer, built from its settings (`SpeculativeConfig`, which lives with the other
settings in config.py and is importable from here too).

The step loop does the rest. After a step the engine has the proposer guess the drafts of every decode the scheduler
will let draft and hands them to the scheduler (`propose_drafts` in proposers.py); in the next step a decode with k
drafts is a chunk of 1 + k tokens that costs 1 + k tokens of the token budget (core/scheduler.py), the model
computes logits at every one of them (execution/model_runner.py), the sampler keeps the drafts the model agrees with
(exactly for greedy requests, by rejection sampling for sampled ones, so the output distribution is the model's own)
and adds one token of its own (execution/sampler.py), and the KV slots of rejected drafts are given back.
"""

from __future__ import annotations

from collections.abc import Callable

from chunkpilot.engine.config import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig
from chunkpilot.engine.model.tokenizer import Tokenizer
from chunkpilot.engine.speculation.draft_model import DraftEngine, DraftModelProposer
from chunkpilot.engine.speculation.proposers import NgramProposer, Proposer

METHODS = SPECULATIVE_METHODS
__all__ = ["MAX_SPECULATIVE_TOKENS", "METHODS", "SpeculativeConfig", "make_proposer"]


def make_proposer(spec: SpeculativeConfig, target: EngineConfig, *, max_model_len: int, num_blocks: int,
                  vocab_size: int, tokenizer: Tokenizer, new_engine: Callable[[EngineConfig], DraftEngine]) -> Proposer:
    """The proposer for the target engine `target`, given its context length, KV pool size, model vocabulary size
    and tokenizer (which a draft model must share). `new_engine` builds a draft model's engine from its settings:
    the engine passes its own class, so that this module, below the engine, never imports it."""
    if spec.method == "draft_model":
        return DraftModelProposer(spec.model, target, max_model_len=max_model_len, num_blocks=num_blocks,
                                  vocab_size=vocab_size, tokenizer=tokenizer, new_engine=new_engine)
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
