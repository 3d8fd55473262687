"""Speculative decoding's settings (vLLM's `--speculative-config`): which proposer drafts tokens and how many a
decode may verify in one step.

The step loop (scheduler.py, model_runner.py, sampler.py) does the rest: a decode with k drafts is a chunk of 1 + k
tokens that costs 1 + k tokens of the token budget, the model computes logits at every one of them, the sampler
keeps the drafts the model agrees with (exactly for greedy requests, by rejection sampling for sampled ones, so
the output distribution is the model's own) and adds one token of its own, and the KV slots of rejected drafts
are given back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from chunkpilot.contract import engine_settings as defaults
from chunkpilot.engine.proposers import NgramProposer, Proposer

TYPE_CHECKING = False
if TYPE_CHECKING:
    from chunkpilot.engine.config import EngineConfig
    from chunkpilot.engine.tokenizer import Tokenizer

METHODS = defaults.SPECULATIVE_METHODS
MAX_SPECULATIVE_TOKENS = defaults.MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # or "draft_model": a smaller model with the same tokenizer (draft_model.py)
    model: str | None = None  # the draft model's folder (vLLM's field; setting it alone means draft_model)
    num_speculative_tokens: int = defaults.NUM_SPECULATIVE_TOKENS
    prompt_lookup_min: int = defaults.PROMPT_LOOKUP[0]  # the n-gram lookup's shortest and longest context
    prompt_lookup_max: int = defaults.PROMPT_LOOKUP[1]
    # no drafts in a step with more decodes than this (vLLM's name): verification rows cost more in larger
    # batches, where a text that does not repeat itself can make drafting a loss; None: never
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method draft_model needs "model": the draft model\'s folder, a smaller '
                             "model with the same tokenizer")
        if self.method != "draft_model" and self.model:
            raise ValueError(f'speculative "model" is for method draft_model, not {self.method!r}: drop one of them')
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1 or null, got {self.disable_by_batch_size!r}")
        if not (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, got "
                             f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")

    @classmethod
    def parse(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """vLLM's JSON form, e.g. '{"method": "ngram", "num_speculative_tokens": 3}'; None, "" or "none": off."""
        if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none")):
            return None
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config must be JSON such as '{{\"method\": \"ngram\", "
                                 f"\"num_speculative_tokens\": 3}}': {e}") from None
        if not isinstance(text, dict):
            raise ValueError("speculative config must be a JSON object")
        unknown = set(text) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        if text.get("model") and "method" not in text:
            text = {**text, "method": "draft_model"}  # as vLLM: a draft model named is the method
        return cls(**text)

    def proposer(self, target: "EngineConfig", *, max_model_len: int, num_blocks: int, vocab_size: int,
                 tokenizer: "Tokenizer") -> Proposer:
        """The proposer for the target engine `target`, given its context length, KV pool size, model vocabulary
        size and tokenizer (which a draft model must share)."""
        if self.method == "draft_model":
            from chunkpilot.engine.draft_model import DraftModelProposer

            return DraftModelProposer(self.model, target, max_model_len=max_model_len, num_blocks=num_blocks,
                                      vocab_size=vocab_size, tokenizer=tokenizer)
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)
