"""Per-request latency records and the statistics over them: pure functions, tested on hand-built traces."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from chunkpilot.contract.slo import SLOTargets, kept

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds on one monotonic clock."""

    kind: str  # workload class, e.g. "chat" or "rag"
    prompt_tokens: int
    start: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of every streamed chunk with text
    # the server's count of output tokens at each of those chunks (continuous usage); empty where it sends none
    token_counts: list[int] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.first_token is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        """The gap before each token after the first (timed_itls)."""
        return [g for _, g in self.timed_itls()]

    def timed_itls(self) -> list[tuple[float, float]]:
        """(when, gap) for each token after the first chunk. A token without text of its own (one of the byte
        tokens of a character) reaches the client with the next chunk that has text, so a chunk may stand for k
        tokens, k steps of the engine: its gap is split evenly over them, from the server's running usage (as
        the Kubernetes inference-perf benchmark derives gaps from tokens, and open vLLM pull requests propose for
        `vllm bench serve`, which times chunks). Timing chunks made a request whose answer was 19 CJK characters
        of 3 tokens each look like 1-s gaps where the engine's steps took 0.35 s. Without the counts, one token a
        chunk."""
        counted = len(self.token_counts) == len(self.token_times)
        out = []
        for i in range(1, len(self.token_times)):
            k = max(1, self.token_counts[i] - self.token_counts[i - 1]) if counted else 1
            out += [(self.token_times[i], (self.token_times[i] - self.token_times[i - 1]) / k)] * k
        return out

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)


def meets(r: RequestRecord, slo: SLOTargets) -> bool:
    """Whether one request counts towards goodput: finished, its TTFT within the TTFT threshold, and its own
    inter-token gaps at the ITL quantile within the ITL threshold (a request's tail of stalls, not the
    population's quantile the tuner measures)."""
    return r.ok and kept(slo, r.ttft, r.itls)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    return out


def summarize(records: list[RequestRecord], slo: SLOTargets = SLOTargets(), *, duration: float | None = None) -> dict:
    """Throughput, goodput and latency percentiles over a run. `duration` defaults to first start → last end."""
    done = [r for r in records if r.ok]
    if duration is None:
        ends = [r.end for r in done]
        duration = (max(ends) - min(r.start for r in records)) if ends else 0.0
    out_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if meets(r, slo))
    per_kind = sorted({r.kind for r in records})
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "goodput": good / duration if duration else 0.0,
        "slo_attainment": good / len(records) if records else 0.0,
        "slo": asdict(slo),
        "ttft_s": percentiles([r.ttft for r in done]),
        "itl_s": percentiles([g for r in done for g in r.itls]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in done]),
        "by_kind": {
            k: {
                "completed": sum(1 for r in done if r.kind == k),
                "ttft_s": percentiles([r.ttft for r in done if r.kind == k]),
                "itl_s": percentiles([g for r in done if r.kind == k for g in r.itls]),
            }
            for k in per_kind
        },
    }
