"""Every metric name chunkpilot's engines export, and vLLM's bucket layouts, in one place (torch-free, no
prometheus_client): the engine's collectors (chunkpilot.engine.metrics), the tuner's queries, the demo, the Grafana
dashboard and the alert rules all read the names from here; nothing else spells them.

Names and bucket layouts follow vLLM's (`vllm:time_to_first_token_seconds` -> `chunkpilot:time_to_first_token_seconds`)
so dashboards written for vLLM work after a prefix change."""

from __future__ import annotations

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
# vLLM's info-style gauge (value 1, the facts in labels): the Gateway API Inference Extension's endpoint picker
# sizes its prefix index from block_size and num_gpu_blocks (docs/routing.md)
CACHE_CONFIG_INFO = PREFIX + "cache_config_info"
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "enable_prefix_caching")
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
PREEMPTIONS = PREFIX + "num_preemptions_total"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"
REQUEST_SUCCESS = PREFIX + "request_success_total"
REQUESTS_REJECTED = PREFIX + "requests_rejected_total"
PREFILL_BUSY_SECONDS = PREFIX + "prefill_busy_seconds_total"
PREFILL_COMPUTED_TOKENS = PREFIX + "prefill_computed_tokens_total"
# Speculative decoding (vLLM's spec_decode names): decodes that carried drafts, draft tokens, drafts kept, drafts
# kept by position (label `position`, 0 = the first draft); ours: running requests whose drafting is paused, and
# the share of drafts a request must keep to go on drafting at the current batch (its measured break-even).
SPEC_DECODE_DRAFTS = PREFIX + "spec_decode_num_drafts_total"
SPEC_DECODE_DRAFT_TOKENS = PREFIX + "spec_decode_num_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS = PREFIX + "spec_decode_num_accepted_tokens_total"
SPEC_DECODE_ACCEPTED_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
SPEC_DECODE_PAUSED = PREFIX + "spec_decode_paused_requests"
SPEC_DECODE_MIN_ACCEPTANCE = PREFIX + "spec_decode_min_acceptance"
POSITION_LABEL = "position"
SCHEDULER_TOKEN_BUDGET = PREFIX + "scheduler_token_budget"
SCHEDULER_MAX_CHUNK = PREFIX + "scheduler_max_chunk"
SCHEDULER_GENERATION = PREFIX + "scheduler_generation"
SCHEDULER_KNOB_ERRORS = PREFIX + "scheduler_knob_errors_total"
# Sums of products of each step's cost features and its seconds (chunkpilot.contract.step_cost), label `term`.
STEP_COST_MOMENTS = PREFIX + "step_cost_moments_total"
STEP_COST_TERM_LABEL = "term"
# Tensor parallelism: the ranks of one engine, and what each holds (label `rank`).
TENSOR_PARALLEL_SIZE = PREFIX + "tensor_parallel_size"
RANK_WEIGHT_BYTES = PREFIX + "rank_weight_bytes"
RANK_KV_CACHE_BYTES = PREFIX + "rank_kv_cache_bytes"
RANK_LABEL = "rank"
# Prefill/decode disaggregation (chunkpilot.engine.kv_transfer). The transfer's own series carry vLLM's NIXL
# connector names (vllm:nixl_xfer_time_seconds ...), with our prefix; the rest are chunkpilot's: transfers by
# outcome, failures and local fallbacks by reason, retries on another prefill pod by the reason the first one
# failed, remote prefills a prefill pod served and the leases it holds, and each remotely prefilled request's time
# to first token split into its phases (label `phase`: queue, remote prefill, transfer, first decode).
KV_XFER_TIME = PREFIX + "nixl_xfer_time_seconds"
KV_BYTES_TRANSFERRED = PREFIX + "nixl_bytes_transferred"
KV_FAILED_TRANSFERS = PREFIX + "nixl_num_failed_transfers_total"
KV_TRANSFERS = PREFIX + "kv_transfers_total"
KV_TRANSFER_BYTES = PREFIX + "kv_transfer_bytes_total"
KV_FALLBACKS = PREFIX + "remote_prefill_fallbacks_total"
KV_RETRIES = PREFIX + "remote_prefill_retries_total"
REMOTE_PREFILLS_SERVED = PREFIX + "remote_prefills_served_total"
KV_LEASES_HELD = PREFIX + "kv_leases_held"
PREFILL_PEERS_READY = PREFIX + "prefill_peers_ready"
# the role an engine serves in now (1 on its role's series, 0 on the others'): a live-roles engine's moves while it
# serves (docs/disaggregation.md), so dashboards and queries join on it rather than on pod names
DISAGG_ROLE = PREFIX + "disagg_role"
ROLE_LABEL = "role"
TTFT_PHASE = PREFIX + "ttft_phase_seconds"
REASON_LABEL = "reason"
OUTCOME_LABEL = "outcome"
PHASE_LABEL = "phase"
TTFT_PHASES = ("queue", "remote_prefill", "transfer", "first_decode")
KV_TRANSFER_OUTCOMES = ("ok", "fallback")
# why a decode pod prefilled a prompt itself after all (docs/disaggregation.md has the table); first_token: a second
# prefill pod sampled another first token than the one the client already had from the first
KV_FALLBACK_REASONS = ("unreachable", "fingerprint", "no_room", "transfer", "checksum", "lease", "first_token")
# the failures that are the prefill pod's, so another prefill pod may serve the request (a retry counts under the
# first pod's reason); no_room is this pod's own and first_token would differ again
KV_RETRY_REASONS = ("unreachable", "fingerprint", "transfer", "checksum", "lease")

MODEL_LABEL = "model_name"
# Per-request SLO classes (docs/slo-classes.md): the latency histograms and the finished-request counter carry the
# request's class ("default" without classes), so summing over it gives vLLM's series; the SLO-met counter counts
# the finished requests that kept their class's TTFT and ITL thresholds (the ITL at its quantile over the
# request's own gaps, as the load generator judges)
SLO_CLASS_LABEL = "slo_class"
SLO_MET = PREFIX + "slo_met_requests_total"
# finished requests the scheduler relegated: sure to miss their TTFT deadline, served after every request that could
# still make its own (SLO_MET counts what each actually got)
RELEGATED = PREFIX + "requests_relegated_total"

ALL_NAMES = (
    TTFT, ITL, TPOT, E2E, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS,
    ITERATION_TOKENS, NUM_RUNNING, NUM_WAITING, KV_CACHE_USAGE, CACHE_CONFIG_INFO, PROMPT_TOKENS, GENERATION_TOKENS, PREEMPTIONS,
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, REQUEST_SUCCESS, REQUESTS_REJECTED, PREFILL_BUSY_SECONDS,
    PREFILL_COMPUTED_TOKENS, SPEC_DECODE_DRAFTS, SPEC_DECODE_DRAFT_TOKENS, SPEC_DECODE_ACCEPTED_TOKENS,
    SPEC_DECODE_ACCEPTED_PER_POS, SPEC_DECODE_PAUSED, SPEC_DECODE_MIN_ACCEPTANCE, SCHEDULER_TOKEN_BUDGET,
    SCHEDULER_MAX_CHUNK, SCHEDULER_GENERATION, SCHEDULER_KNOB_ERRORS, STEP_COST_MOMENTS, TENSOR_PARALLEL_SIZE,
    RANK_WEIGHT_BYTES, RANK_KV_CACHE_BYTES, KV_XFER_TIME, KV_BYTES_TRANSFERRED, KV_FAILED_TRANSFERS, KV_TRANSFERS,
    KV_TRANSFER_BYTES, KV_FALLBACKS, KV_RETRIES, REMOTE_PREFILLS_SERVED, KV_LEASES_HELD, PREFILL_PEERS_READY,
    DISAGG_ROLE, TTFT_PHASE, SLO_MET, RELEGATED,
)
HISTOGRAMS = (TTFT, ITL, TPOT, E2E, QUEUE_TIME, PREFILL_TIME, DECODE_TIME, REQUEST_PROMPT_TOKENS,
              REQUEST_GENERATION_TOKENS, ITERATION_TOKENS, KV_XFER_TIME, KV_BYTES_TRANSFERRED, TTFT_PHASE)

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
