"""Turn the logits of the sampling positions into tokens: greedy, temperature, top-k, top-p, per-request seeds,
and top-n logprobs (of the model's raw distribution, as vLLM reports them)."""

from __future__ import annotations

import torch

from chunkpilot.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        g = self._request_generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)  # negative seeds too (manual_seed wants uint64)
            self._request_generators[request_id] = g
        return g

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
        """logits: [S, vocab] float32. Returns tokens, and per row (chosen logprob, top-n) or None."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = self._filtered_probs(logits[idx], [params[i] for i in random_rows])
            # One draw per row with its own generator: a seeded request gives the same tokens whatever it is
            # batched with.
            for j, i in enumerate(random_rows):
                g = self._generator_for(request_ids[i], params[i])
                tokens[i] = torch.multinomial(probs[j], 1, generator=g)[0]
        token_list = tokens.tolist()
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, i in enumerate(want):
                chosen = float(lp[j, token_list[i]])
                n = params[i].logprobs or 0
                top: list[tuple[int, float]] = []
                if n:
                    vals, ids = lp[j].topk(n)
                    top = list(zip(ids.tolist(), vals.tolist()))
                logprobs[i] = (chosen, top)
        return token_list, logprobs

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[-1]
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        if bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token when the mass before it already reaches top_p (the top token always stays).
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p[:, None]
            drop_sorted[:, 0] = False  # however small top_p is (it may round to 0), the top token stays
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits.softmax(dim=-1)
