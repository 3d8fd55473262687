"""The engine's Prometheus collectors. Their names and bucket layouts are the contract's
(chunkpilot.contract.metric_names), re-exported here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily

# the names, re-exported: the engine's code and tests read them here, everyone else from the contract
from chunkpilot.contract.metric_names import *  # noqa: F401,F403
from chunkpilot.contract.metric_names import (CACHE_CONFIG_INFO, CACHE_CONFIG_LABELS, ITERATION_TOKEN_BUCKETS,
                                              ITL_BUCKETS, MODEL_LABEL,
                                              REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, one_two_five_buckets)
from chunkpilot.contract.engine_settings import ROLES
from chunkpilot.contract.slo import IMPLICIT_CLASS
from chunkpilot.contract.step_cost import StepMoments
from chunkpilot.engine.core.block_manager import CacheShape
from chunkpilot.engine.core.sequence import FinishReason

# `*_created` series double the exposition and no dashboard or rule here uses them (vLLM drops them too).
disable_created_metrics()


def _base(name: str) -> str:
    """prometheus_client adds `_total` to counters itself."""
    return name.removesuffix("_total")


@dataclass(frozen=True)
class ClassMetrics:
    """One SLO class's series (the `slo_class` label bound)."""

    ttft: Any
    itl: Any
    e2e: Any
    slo_met: Any
    finished: Callable[[str], Any]  # by finish reason
    relegated: Any


class EngineMetrics:
    """The engine's collectors, registered in their own registry (one engine per process, tests make many)."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None,
                 slo_classes: tuple[str, ...] = (IMPLICIT_CLASS,)) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._by_class: dict[str, ClassMetrics] = {}
        r, labels = self.registry, [MODEL_LABEL]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(_base(name), doc, labels, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        classed = [MODEL_LABEL, SLO_CLASS_LABEL]
        self._ttft = Histogram(TTFT, "Time to first token in seconds, by the request's SLO class.", classed,
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram(ITL, "Time between consecutive output tokens in seconds, by the request's SLO class.",
                              classed, buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram(E2E, "End-to-end request latency in seconds, by the request's SLO class.", classed,
                              buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self._slo_met = Counter(_base(SLO_MET), "Finished requests that kept their SLO class's TTFT and ITL "
                                "thresholds (the ITL at its quantile over the request's own gaps).", classed,
                                registry=r)
        self._relegated = Counter(_base(RELEGATED), "Finished requests the scheduler relegated: sure to miss their "
                                  "class's TTFT deadline, so served after every request that could still make its "
                                  "own.", classed, registry=r)
        self.tpot = hist(TPOT, "Mean time per output token of each finished request.", ITL_BUCKETS)
        self.queue_time = hist(QUEUE_TIME, "Time a request waited before its first scheduled step.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist(PREFILL_TIME, "Time from first scheduled step to first token.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist(DECODE_TIME, "Time from first token to last token.", REQUEST_LATENCY_BUCKETS)
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = hist(REQUEST_PROMPT_TOKENS, "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = hist(REQUEST_GENERATION_TOKENS, "Generated tokens per finished request.", token_buckets)
        self.iteration_tokens = hist(ITERATION_TOKENS, "Tokens scheduled per engine step.", ITERATION_TOKEN_BUCKETS)
        self.running = gauge(NUM_RUNNING, "Requests running (holding KV blocks).")
        self.waiting = gauge(NUM_WAITING, "Requests waiting to be scheduled.")
        self.kv_usage = gauge(KV_CACHE_USAGE, "Fraction of KV-cache blocks in use (1 = full).")
        self._cache_config = Gauge(CACHE_CONFIG_INFO, "The KV cache's configuration in labels (value 1): tokens per "
                                   "block, blocks (on whichever device holds them), prefix caching.",
                                   [MODEL_LABEL, *CACHE_CONFIG_LABELS], registry=r)
        self.prompt_tokens = counter(PROMPT_TOKENS, "Prompt tokens processed.")
        self.generation_tokens = counter(GENERATION_TOKENS, "Tokens generated.")
        self.preemptions = counter(PREEMPTIONS, "Sequences preempted (to be recomputed).")
        self.prefix_queries = counter(PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.")
        # The tuner's prefill headroom: (computed tokens + prefix-cache hits) / busy seconds is the prompt tokens/s
        # the knobs let through.
        self.prefill_busy = counter(PREFILL_BUSY_SECONDS, "Engine loop time in steps that computed prompt tokens.")
        self.prefill_computed = counter(PREFILL_COMPUTED_TOKENS, "Prompt tokens computed by the model (prefix-cache "
                                        "hits excluded, recomputation after preemption included).")
        self.spec_drafts = counter(SPEC_DECODE_DRAFTS, "Decodes that verified draft tokens (speculative decoding).")
        self.spec_draft_tokens = counter(SPEC_DECODE_DRAFT_TOKENS, "Draft tokens proposed and verified.")
        self.spec_accepted = counter(SPEC_DECODE_ACCEPTED_TOKENS, "Draft tokens the model kept.")
        self._spec_per_pos = Counter(_base(SPEC_DECODE_ACCEPTED_PER_POS), "Draft tokens kept, by draft position "
                                     "(0 = the first).", [MODEL_LABEL, POSITION_LABEL], registry=r)
        self.spec_paused = gauge(SPEC_DECODE_PAUSED, "Running requests whose drafts were kept too rarely to pay "
                                 "for verification: drafting paused (speculation switched itself off for them).")
        self.spec_min_acceptance = gauge(SPEC_DECODE_MIN_ACCEPTANCE, "Share of its drafts a request must keep to go "
                                         "on drafting: the floor or the measured break-even at the current batch.")
        self._request_success = Counter(
            _base(REQUEST_SUCCESS), "Finished requests by finish reason and SLO class.",
            [MODEL_LABEL, "finished_reason", SLO_CLASS_LABEL], registry=r
        )
        for name in slo_classes:  # every class's series from the start, so a rate over them is never absent
            self.classed(name)
        self.rejected = Counter(
            _base(REQUESTS_REJECTED), "Requests refused before running, by reason.", [MODEL_LABEL, "reason"], registry=r
        )
        self.model_name = model_name
        self.token_budget = gauge(SCHEDULER_TOKEN_BUDGET, "Token budget per step now applied by the scheduler.")
        self.max_chunk = gauge(SCHEDULER_MAX_CHUNK, "Largest prefill chunk now applied by the scheduler.")
        self.generation = gauge(SCHEDULER_GENERATION, "Generation of the scheduler knobs now applied.")
        # The step-time model's sufficient statistics: one accumulator, read by a collector at scrape time (the
        # step loop adds a small matrix per step instead of taking a counter lock per term).
        self.step_moments = StepMoments()
        r.register(_StepMomentsCollector(self.step_moments, model_name))
        self.knob_errors = counter(SCHEDULER_KNOB_ERRORS, "Knob updates refused (bad file, out of range); last good knobs kept.")
        self.tensor_parallel_size = gauge(TENSOR_PARALLEL_SIZE, "Ranks (GPUs) the engine splits the model across.")
        self._rank_weights = Gauge(RANK_WEIGHT_BYTES, "Bytes of model weights one tensor-parallel rank holds.",
                                   [MODEL_LABEL, RANK_LABEL], registry=r)
        self._rank_kv = Gauge(RANK_KV_CACHE_BYTES, "Bytes of KV cache one tensor-parallel rank holds (its KV heads).",
                              [MODEL_LABEL, RANK_LABEL], registry=r)

        # prefill/decode disaggregation (kv_transfer/); zero on engines that run both roles
        self.kv_xfer_time = hist(KV_XFER_TIME, "Seconds one KV-block transfer took (pull, checksums and "
                                 "acknowledgement).", REQUEST_LATENCY_BUCKETS)
        self.kv_xfer_bytes = hist(KV_BYTES_TRANSFERRED, "Bytes of KV blocks one transfer moved.",
                                  [b for b in one_two_five_buckets(10**10) if b >= 10**4])
        self.kv_failed = counter(KV_FAILED_TRANSFERS, "KV-block transfers that failed (any reason).")
        self.kv_transfer_bytes = counter(KV_TRANSFER_BYTES, "Bytes of KV blocks pulled from prefill pods.")
        self._kv_transfers = Counter(_base(KV_TRANSFERS), "Remote prefills by outcome: ok (blocks pulled and "
                                     "verified) or fallback (prefilled here instead).", [MODEL_LABEL, OUTCOME_LABEL],
                                     registry=r)
        self._kv_fallbacks = Counter(_base(KV_FALLBACKS), "Requests sent to a prefill pod but prefilled here, by "
                                     "reason.", [MODEL_LABEL, REASON_LABEL], registry=r)
        self._kv_retries = Counter(_base(KV_RETRIES), "Requests sent to another prefill pod after one failed them, by "
                                   "the failed pod's reason.", [MODEL_LABEL, REASON_LABEL], registry=r)
        self.remote_prefills_served = counter(REMOTE_PREFILLS_SERVED, "Prompts this prefill pod computed for decode "
                                              "pods.")
        self.prefill_peers_ready = gauge(PREFILL_PEERS_READY, "Prefill pods that answered this decode pod's last "
                                         "poll with the same KV layout (saturated ones included).")
        self.kv_leases_held = gauge(KV_LEASES_HELD, "Prompts whose KV blocks this prefill pod holds for a decode pod.")
        self._role = Gauge(DISAGG_ROLE, "1 on the role this engine serves in now (both, prefill or decode), 0 on the "
                           "others; a live-roles engine's changes while it serves.", [MODEL_LABEL, ROLE_LABEL],
                           registry=r)
        self._ttft_phase = Histogram(TTFT_PHASE, "A remotely prefilled request's time to first token by phase; "
                                     "first_decode: from the transfer to the second token.",
                                     [MODEL_LABEL, PHASE_LABEL], buckets=TTFT_BUCKETS, registry=r)

        # every label value from the start: a dashboard shows 0, not "no data", until the first fallback
        for outcome in KV_TRANSFER_OUTCOMES:
            self.kv_transfer(outcome)
        for reason in KV_FALLBACK_REASONS:
            self.kv_fallback(reason)
        for reason in KV_RETRY_REASONS:
            self.kv_retry(reason)
        for phase in TTFT_PHASES:
            self.ttft_phase(phase)

    def kv_transfer(self, outcome: str):
        return self._kv_transfers.labels(self.model_name, outcome)

    def kv_fallback(self, reason: str):
        return self._kv_fallbacks.labels(self.model_name, reason)

    def kv_retry(self, reason: str):
        return self._kv_retries.labels(self.model_name, reason)

    def publish_cache_shape(self, cache: CacheShape) -> None:
        self._cache_config.labels(self.model_name, str(cache.block_size), str(cache.num_blocks),
                                  str(cache.enable_prefix_caching)).set(1)

    def publish_role(self, role: str) -> None:
        for r in ROLES:
            self._role.labels(self.model_name, r).set(1 if r == role else 0)

    def classed(self, slo_class: str) -> "ClassMetrics":
        """The latency histograms and counters of one SLO class."""
        c = self._by_class.get(slo_class)
        if c is None:
            name = self.model_name
            c = self._by_class[slo_class] = ClassMetrics(
                self._ttft.labels(name, slo_class), self._itl.labels(name, slo_class),
                self._e2e.labels(name, slo_class), self._slo_met.labels(name, slo_class),
                lambda reason, _c=slo_class: self._request_success.labels(name, reason, _c),
                self._relegated.labels(name, slo_class))
            # every finish reason's series from the start too: a series born at its first request would hide that
            # request from increase() over the window it finished in (the tuner's finished count by class)
            for reason in FinishReason:
                c.finished(reason.value)
        return c

    def ttft_phase(self, phase: str):
        return self._ttft_phase.labels(self.model_name, phase)

    def spec_accepted_at(self, position: int):
        """The per-position counter of kept drafts (position 0 = the first draft of a decode)."""
        return self._spec_per_pos.labels(self.model_name, str(position))

    def publish_ranks(self, memories) -> None:
        """memories: the engine's RankMemory of every rank, read once at start-up."""
        self.tensor_parallel_size.set(len(memories))
        for m in memories:
            self._rank_weights.labels(self.model_name, str(m.rank)).set(m.weight_bytes)
            self._rank_kv.labels(self.model_name, str(m.rank)).set(m.kv_cache_bytes)


class _StepMomentsCollector:
    def __init__(self, moments: StepMoments, model_name: str) -> None:
        self.moments, self.model_name = moments, model_name

    def collect(self):
        family = CounterMetricFamily(_base(STEP_COST_MOMENTS), "Sum over engine steps of the product of two step-cost "
                                     "features (or a feature and the step's seconds), for fitting step time.",
                                     labels=[MODEL_LABEL, STEP_COST_TERM_LABEL])
        for term, value in self.moments.terms().items():
            family.add_metric([self.model_name, term], value)
        yield family
