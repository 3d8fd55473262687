"""Every metric name chunkpilot exports, in one place.

Names and bucket layouts follow vLLM's (`vllm:time_to_first_token_seconds` → `chunkpilot:time_to_first_token_seconds`)
so dashboards written for vLLM work after a prefix change. The tuner, the Grafana dashboard and the alert rules
import the names from here (or from files generated from here); nothing else spells them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily

from chunkpilot.engine.step_cost import StepMoments

# `*_created` series double the exposition and no dashboard or rule here uses them (vLLM drops them too).
disable_created_metrics()

PREFIX = "chunkpilot:"

# ---- names (as they appear in the exposition; counters carry their _total suffix) ----------------------
TTFT = PREFIX + "time_to_first_token_seconds"
ITL = PREFIX + "inter_token_latency_seconds"
TPOT = PREFIX + "request_time_per_output_token_seconds"
E2E = PREFIX + "e2e_request_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
PREFILL_TIME = PREFIX + "request_prefill_time_seconds"
DECODE_TIME = PREFIX + "request_decode_time_seconds"
REQUEST_PROMPT_TOKENS = PREFIX + "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = PREFIX + "request_generation_tokens"
ITERATION_TOKENS = PREFIX + "iteration_tokens_total"
NUM_RUNNING = PREFIX + "num_requests_running"
NUM_WAITING = PREFIX + "num_requests_waiting"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
PREEMPTIONS = PREFIX + "num_preemptions_total"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"
REQUEST_SUCCESS = PREFIX + "request_success_total"
REQUESTS_REJECTED = PREFIX + "requests_rejected_total"
PREFILL_BUSY_SECONDS = PREFIX + "prefill_busy_seconds_total"
PREFILL_COMPUTED_TOKENS = PREFIX + "prefill_computed_tokens_total"
SCHEDULER_TOKEN_BUDGET = PREFIX + "scheduler_token_budget"
SCHEDULER_MAX_CHUNK = PREFIX + "scheduler_max_chunk"
SCHEDULER_GENERATION = PREFIX + "scheduler_generation"
SCHEDULER_KNOB_ERRORS = PREFIX + "scheduler_knob_errors_total"
# Sums of products of each step's cost features and its seconds (chunkpilot.engine.step_cost), label `term`.
STEP_COST_MOMENTS = PREFIX + "step_cost_moments_total"
STEP_COST_TERM_LABEL = "term"
# Tensor parallelism: the ranks of one engine, and what each holds (label `rank`).
TENSOR_PARALLEL_SIZE = PREFIX + "tensor_parallel_size"
RANK_WEIGHT_BYTES = PREFIX + "rank_weight_bytes"
RANK_KV_CACHE_BYTES = PREFIX + "rank_kv_cache_bytes"
RANK_LABEL = "rank"

MODEL_LABEL = "model_name"

ALL_NAMES = (
    TTFT, ITL, TPOT, E2E, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS,
    ITERATION_TOKENS, NUM_RUNNING, NUM_WAITING, KV_CACHE_USAGE, PROMPT_TOKENS, GENERATION_TOKENS, PREEMPTIONS,
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, REQUEST_SUCCESS, REQUESTS_REJECTED, PREFILL_BUSY_SECONDS,
    PREFILL_COMPUTED_TOKENS, SCHEDULER_TOKEN_BUDGET,
    SCHEDULER_MAX_CHUNK, SCHEDULER_GENERATION, SCHEDULER_KNOB_ERRORS, STEP_COST_MOMENTS, TENSOR_PARALLEL_SIZE,
    RANK_WEIGHT_BYTES, RANK_KV_CACHE_BYTES,
)
HISTOGRAMS = (TTFT, ITL, TPOT, E2E, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, REQUEST_PROMPT_TOKENS,
              REQUEST_GENERATION_TOKENS, ITERATION_TOKENS)

# ---- vLLM's bucket layouts -----------------------------------------------------------------------------
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count histograms)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > limit:
                return out
            out.append(v)
        exp += 1


def _base(name: str) -> str:
    """prometheus_client adds `_total` to counters itself."""
    return name.removesuffix("_total")


class EngineMetrics:
    """The engine's collectors, registered in their own registry (one engine per process, tests make many)."""

    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, [MODEL_LABEL]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(_base(name), doc, labels, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist(TTFT, "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist(ITL, "Time between consecutive output tokens in seconds.", ITL_BUCKETS)
        self.tpot = hist(TPOT, "Mean time per output token of each finished request.", ITL_BUCKETS)
        self.e2e = hist(E2E, "End-to-end request latency in seconds.", REQUEST_LATENCY_BUCKETS)
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
        self.request_success = Counter(
            _base(REQUEST_SUCCESS), "Finished requests by finish reason.", [MODEL_LABEL, "finished_reason"], registry=r
        )
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
