"""One request's state as the scheduler and block manager see it: token ids and how many are in the KV cache."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from chunkpilot.contract.slo import SLOClass
from chunkpilot.engine.core.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's max length
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Monotonic arrival order: FCFS admission and "newest first" preemption compare this, not wall time.
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Tokens whose K/V are in the cache. Everything from here on is computed by the next scheduled chunks.
    num_computed_tokens: int = 0
    # Of the computed tokens, how many came from the prefix cache (for the hit-rate metric).
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # time.monotonic() when the request arrived and when a step first computed any of its tokens (queue time)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    # Seeds the prefix-cache hash chain: the server sets it per API key and from the request's `cache_salt`, so
    # one tenant cannot learn from `cached_tokens` what another tenant's prompts begin with.
    cache_salt: bytes = b""
    # Tokens the last step appended: 1, or up to 1 + its drafts for a decode that verified drafts
    num_new_tokens: int = 0
    # Speculative decoding: the share of this sequence's recent drafts the model kept (a moving average), and the
    # decode steps left during which it drafts nothing because that share was too low to pay for verification
    draft_acceptance: float = 1.0
    drafts_paused: int = 0
    draft_pause: int = 0  # the next pause's length (0: the first)
    # Disaggregation, prefill role (kv_transfer/): when the sequence finishes, its blocks are not freed but
    # handed to `held_blocks`, still referenced, until the decode pod that asked has pulled them (a lease).
    hold_kv: bool = False
    held_blocks: list[int] = field(default_factory=list)
    # Per-request SLO classes (docs/slo-classes.md): the class the server chose; None where the deployment has
    # none (one implicit class, first come first served)
    slo_class: SLOClass | None = None
    # when its newest token was appended (the scheduler's clock): with classes, how long a decode has waited
    last_token_time: float | None = None
    # with classes: predicted to miss its TTFT deadline, so its prompt goes after every prompt that can still make
    # its own (a late request must not make the ones behind it late too); it counts as a miss
    relegated: bool = False

    @property
    def priority(self) -> int:
        return self.slo_class.priority if self.slo_class is not None else 0

    @property
    def ttft_deadline(self) -> float:
        """When the first token is due (the arrival clock's seconds): the class's TTFT threshold after arrival."""
        ttft = self.slo_class.slo.ttft if self.slo_class is not None else None
        return self.arrival_time + ttft.threshold if ttft is not None else float("inf")

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the newest token is missing from the cache: the next step is a one-token decode."""
        return self.num_uncomputed == 1 and len(self.output_token_ids) > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
