"""Offline API: `LLM(model_dir, ...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from typing import Any

from tqdm import tqdm

from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.core.outputs import CompletionOutput
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.llm_engine import LLMEngine

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_settings: Any) -> None:
        # A failed tensor-parallel rank raises from generate() here; it does not end the caller's process.
        self.engine = LLMEngine(EngineConfig(model=model, **engine_settings), exit_on_rank_failure=False)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        requests = [{"prompt": p} for p in prompts]
        return self._run(requests, params, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([{"messages": m} for m in conversations], params, use_tqdm)

    def _run(self, requests: list[dict], params, use_tqdm: bool) -> list[CompletionOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(requests)
        if len(params) != len(requests):
            raise ValueError(f"got {len(params)} SamplingParams for {len(requests)} prompts")
        # Validate every request before any runs: a bad one fails the call, not a half-finished batch.
        seqs = [
            self.engine.make_sequence(f"offline-{next(self._ids)}", r.get("prompt"), p, messages=r.get("messages"))
            for r, p in zip(requests, params)
        ]
        results: dict[str, CompletionOutput] = {}
        for seq in seqs:
            self.engine.submit(seq)
            results[seq.request_id] = CompletionOutput(seq.prompt_token_ids, [], "", None, [] if seq.params.logprobs is not None else None)
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        remaining = len(seqs)
        while remaining:
            for out in self.engine.step():
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if res.logprobs is not None:
                    res.logprobs.extend(out.new_logprobs)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    remaining -= 1
                    bar.update(1)
        bar.close()
        return [results[s.request_id] for s in seqs]
