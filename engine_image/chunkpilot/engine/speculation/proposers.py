"""Draft-token proposers for speculative decoding: something cheaper than the model guesses the next few tokens of a
sequence, and the model checks them all in one step (the step loop: core/scheduler.py, execution/model_runner.py,
execution/sampler.py). One small interface, so that the n-gram lookup here and a draft model (draft_model.py) stand
side by side: a batch of (tokens so far, how many drafts at most) in, one list of drafts per entry out. It is a
batch because a draft model drafts for every decode of the step at once.

Drafting happens between steps (`propose_drafts`): after a step's tokens are appended, the proposer guesses for
every decode the scheduler will let draft, and the scheduler is handed the guesses to budget in the next step.

`NgramProposer` is prompt-lookup decoding (vLLM's `ngram` method): find an earlier place where the sequence's last
n tokens occurred (the longest n from `max_n` down to `min_n`) and propose the tokens that followed it there. It
costs no model and pays off where outputs repeat their input: summaries, edits, code that quotes its context.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

TYPE_CHECKING = False
if TYPE_CHECKING:
    from chunkpilot.engine.core.scheduler import Scheduler


class Proposer(Protocol):
    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        """For each (token_ids, k): up to k draft tokens to follow `token_ids` (prompt and output so far); [] when
        there is no guess. Drafts are one guess each (no distribution): verification treats them as certain."""
        ...


def propose_drafts(scheduler: "Scheduler", proposer: Proposer) -> None:
    """After a step (its tokens appended, stop strings applied): ask `proposer` for the drafts of every decode that
    `scheduler` lets draft next step, and hand them to it with the time they took, a part of what drafting costs
    (a draft model's forwards)."""
    wanted = scheduler.draft_requests()
    if not wanted:
        scheduler.update_draft_token_ids({})
        return
    t0 = time.perf_counter()
    proposed = proposer.propose_batch([(seq.token_ids, k) for seq, k in wanted])
    # a proposer that returns more than asked must not overrun the budget
    drafts = {seq.request_id: list(ids[:k]) for (seq, k), ids in zip(wanted, proposed)}
    scheduler.update_draft_token_ids(drafts, time.perf_counter() - t0)


@dataclass(frozen=True)
class NgramProposer:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"the n-gram lookup needs 1 <= min_n <= max_n, got min_n={self.min_n}, "
                             f"max_n={self.max_n}")

    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        return [self.propose(ids, k) for ids, k in requests]

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        if k <= 0 or len(ids) < self.min_n + 1:
            return []
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            # windows over all but the last token: the tail itself is never its own match, and every match has
            # at least one token after it
            windows = sliding_window_view(ids[:-1], n)
            starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(starts):
                # the most recent occurrence: in edits and multi-turn chats the latest copy is the one continued
                at = int(starts[-1]) + n
                return ids[at : at + k].tolist()
        return []
