"""Turn the logits of the sampling positions into tokens: greedy, temperature, top-k, top-p, per-request seeds,
and top-n logprobs (of the model's raw distribution, as vLLM reports them)."""

from __future__ import annotations

import torch

from chunkpilot.engine.core.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator_for(self, request_id: str, params: SamplingParams, position: int) -> torch.Generator:
        """A seeded request's draws for its output token `position` come from (seed, position) alone, not from
        the draws before: the tokens are the same whichever engine drew the earlier ones (a prefill pod draws the
        first, a decode pod the rest) and whatever was batched with it."""
        if params.seed is None:
            return self.generator
        g = self._request_generators.get(request_id)
        if g is None:
            g = self._request_generators[request_id] = torch.Generator(device=self.device)
        g.manual_seed(_mix(params.seed, position))
        return g

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        positions: list[int] | None = None,
    ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
        """logits: [S, vocab] float32; positions: per row, the index of the output token being drawn (seeded
        requests draw from it). Returns tokens, and per row (chosen logprob, top-n) or None."""
        positions = positions or [0] * len(params)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = self._filtered_probs(logits[idx], [params[i] for i in random_rows])
            # One draw per row with its own generator: a seeded request gives the same tokens whatever it is
            # batched with.
            for j, i in enumerate(random_rows):
                g = self._generator_for(request_ids[i], params[i], positions[i])
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

    def verify(self, logits: torch.Tensor, drafts: list[int], request_id: str, params: SamplingParams,
               position: int = 0) -> list[int]:
        """logits: [1 + k, vocab], row i the model's distribution after the sequence and drafts[:i]. Returns the
        drafts kept and one token of the model's own: the next token where a draft was rejected, else after them.

        Greedy: a draft is kept while it is the model's argmax, so the output is token for token the output
        without drafts. Sampled: rejection sampling (Leviathan et al.) against a proposer that is certain of its
        draft d (q = 1 at d): keep d with probability p(d), else draw from p without d, renormalised, so every
        token is distributed exactly as p; after all k kept, one draw from the last row."""
        if params.greedy:
            best = logits.argmax(dim=-1).tolist()
            kept = 0
            while kept < len(drafts) and drafts[kept] == best[kept]:
                kept += 1
            return drafts[:kept] + [best[kept]]
        probs = self._filtered_probs(logits, [params] * len(logits))
        g = self._generator_for(request_id, params, position)
        draws = torch.rand(len(drafts), generator=g, device=logits.device).tolist()
        for i, d in enumerate(drafts):
            if draws[i] < float(probs[i, d]):
                continue
            rest = probs[i].clone()
            rest[d] = 0.0
            if float(rest.sum()) <= 0.0:  # p(d) is 1 but for rounding: nothing else can be drawn
                continue
            return drafts[:i] + [int(torch.multinomial(rest / rest.sum(), 1, generator=g)[0])]
        return drafts + [int(torch.multinomial(probs[len(drafts)], 1, generator=g)[0])]

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


_MASK = 0xFFFF_FFFF_FFFF_FFFF


def _mix(seed: int, position: int) -> int:
    """One 64-bit seed per (request seed, output position): splitmix64's finalizer over the pair, so neighbouring
    seeds and positions give unrelated streams. Negative seeds too (manual_seed wants uint64)."""
    z = (seed + 0x9E37_79B9_7F4A_7C15 * (position + 1)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK
    return z ^ (z >> 31)
