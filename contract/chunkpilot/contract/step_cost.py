"""The step-cost contract between the engine and the tuner: what a step computes (its features) and the running
sums of products the engine exports, so that the tuner can fit step seconds against those features by least
squares over any Prometheus window and across pods. Sums of products are counters: their increase over a window,
summed over pods, is exactly that window's normal equations (XᵀX, Xᵀy), at no cost to the engine but a few
multiply-adds per step.

The features are chosen so that one linear model with non-negative coefficients fits both cost shapes:
* overhead (1 per step): Python, kernel launches, sampling;
* prefill_tokens: weight matmuls; on a CPU a step grows with every prompt token from the first (a decode's draft
  tokens under speculative decoding count here too: rows beyond the decode's own);
* decode_seqs: per-sequence bookkeeping and the decode rows;
* kv_kilotokens: attention reads; a chunk of n tokens at position s reads n·s + n(n+1)/2 keys (in thousands, so
  the products stay well inside a double's precision over months of counting);
* tokens_over_512, tokens_over_2048: max(0, tokens - knee). On a GPU a step costs about the same until it turns
  compute-bound, then grows linearly; these hinges fit that knee, while a CPU fit leaves them near 0.
Torch-free: the tuner and its tests import it without the engine's dependencies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

KNEES = (512, 2048)
FEATURES = ("overhead", "prefill_tokens", "decode_seqs", "kv_kilotokens",
            *(f"tokens_over_{k}" for k in KNEES))
TARGET = "seconds"
_COLUMNS = (*FEATURES, TARGET)
# The upper triangle of the (features + target) product matrix: term "a*b" is the sum over steps of a·b.
TERMS = tuple(f"{a}*{b}" for i, a in enumerate(_COLUMNS) for b in _COLUMNS[i:])


def kv_kilotokens(start: float, n: float) -> float:
    """Keys read by a chunk of n tokens at position `start` (each query reads the keys before it), in thousands."""
    return (n * start + n * (n + 1) / 2) / 1000.0


def features_of(prefill: float, decodes: float, kv_kilo: float) -> tuple[float, ...]:
    """The feature vector of a step from its totals (the hinges see prefill and decode tokens together)."""
    tokens = prefill + decodes
    return (1.0, float(prefill), float(decodes), float(kv_kilo), *(max(0.0, tokens - k) for k in KNEES))


def step_features(chunks: Iterable[tuple[int, int, bool]]) -> tuple[float, ...]:
    """chunks: (start position, number of tokens, is a decode) for every sequence in the step. A decode with k
    draft tokens (n = 1 + k) is one decode sequence (its bookkeeping, sampling and verification) and k more
    token rows, counted with the prompt tokens."""
    prefill = decodes = kv = 0.0
    for start, n, is_decode in chunks:
        if is_decode:
            decodes += 1
            prefill += n - 1  # a decode's draft tokens (speculative decoding): more rows, as a prompt's are
        else:
            prefill += n
        kv += kv_kilotokens(start, n)
    return features_of(prefill, decodes, kv)


def moments_matrix(terms: dict[str, float]) -> np.ndarray:
    """The symmetric (features + target) product matrix from term sums (missing terms count as 0)."""
    size = len(_COLUMNS)
    out = np.zeros((size, size))
    for i, a in enumerate(_COLUMNS):
        for j in range(i, size):
            out[i, j] = out[j, i] = terms.get(f"{a}*{_COLUMNS[j]}", 0.0)
    return out


def terms_of(products: np.ndarray) -> dict[str, float]:
    """Term sums from a (features + target) product matrix, e.g. rowsᵀ·rows of (features..., seconds) rows."""
    return dict(zip(TERMS, products[np.triu_indices(len(_COLUMNS))].tolist()))


class StepMoments:
    """The engine's running sums, added to by the step loop and read by the metrics scrape (another thread)."""

    def __init__(self) -> None:
        self._sums = np.zeros((len(_COLUMNS), len(_COLUMNS)))
        self._lock = threading.Lock()

    def add(self, features: tuple[float, ...], seconds: float) -> None:
        row = np.array((*features, seconds))
        with self._lock:
            self._sums += np.outer(row, row)

    def terms(self) -> dict[str, float]:
        with self._lock:
            return terms_of(self._sums)
