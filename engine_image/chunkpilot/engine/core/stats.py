"""What the engine tells its server after each step, as typed objects (vLLM's SchedulerStats): the server's
metrics read these, never the scheduler's queues or the block manager's counters, so the step loop can change
what it holds inside (speculative tokens, new caches) without the server following it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """What the last step did, for metrics and the simulator's cost model."""

    num_tokens: int = 0
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    seconds: float = 0.0
    preempted: list[str] = field(default_factory=list)
    features: tuple[float, ...] = ()  # chunkpilot.contract.step_cost.step_features of the step
    # speculative decoding (vLLM's spec_decode counters): decodes that carried drafts, their draft tokens, the
    # drafts the sampler kept, and per draft position (0 = first) how many were kept
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's state after a step: the step itself, the queues, the KV pool, and the running totals the
    server turns into Prometheus counters (totals, not increments: a reader that misses a step loses nothing)."""

    step: StepStats
    num_running: int
    num_waiting: int  # in the scheduler's waiting queue (admission adds the requests not yet submitted)
    kv_usage: float  # share of the KV pool's blocks in use, 0..1
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int  # of those, tokens found
    num_preemptions: int  # since start
    num_drafts_paused: int = 0  # running sequences whose drafts were kept too rarely to pay: drafting paused
    # the share of its drafts a sequence must keep to go on drafting, at the last step's batch
    # (speculation/draft_cost.py)
    draft_min_acceptance: float = 0.0
