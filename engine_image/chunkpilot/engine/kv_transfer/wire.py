"""What a decode pod and a prefill pod say to each other (HTTP bodies, pydantic), and the fingerprint both compute
of their KV layout: a block is only usable where model, weights, dtype, block size and pool layout all match."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, Field

from chunkpilot.engine.core.sampling_params import SamplingParams


def fingerprint(parts: dict[str, object]) -> str:
    """A short digest of everything that decides a block's bytes and shape."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class PoolLayout(BaseModel):
    """Where a process's KV pool lies and how it is cut (execution/kv_blocks.py): the reader needs the other
    side's to name its regions."""

    address: int
    num_slots: int
    layers: int
    row_bytes: int  # one slot of one (layer, K or V)


class PrefillRequest(BaseModel):
    """POST /kv/prefill: compute this prompt, sample its first token, hold its blocks for me."""

    token_ids: list[int] = Field(min_length=1)
    params: SamplingParams
    cache_salt: str | None = None  # the request's own; the tenant's comes from the forwarded API key
    fingerprint: str  # the caller's: a prefill pod with another layout refuses at once (HTTP 409)


class KVOffer(BaseModel):
    """The answer: the first token, and the blocks holding the prompt's K/V under a one-time transfer id."""

    transfer_id: str
    agent: str  # the prefill process's transport name (its NIXL agent)
    fingerprint: str
    layout: PoolLayout
    block_size: int
    blocks: list[int]  # the prompt's blocks in the prefill pod's pool, in prompt order
    checksums: list[int]  # one per block (kv_blocks.block_checksums)
    first_token: int
    logprob: tuple[float, list[tuple[int, float]]] | None = None
    lease_seconds: float
    prefill_seconds: float  # on the prefill pod, its queue included


class Release(BaseModel):
    """POST /kv/release: the decode pod is done with a transfer (pulled it, or gave up)."""

    transfer_id: str


class ReleaseReply(BaseModel):
    # the blocks were still held when the release came: what was read before it is what was offered
    held: bool


class PeerLoad(BaseModel):
    """GET /kv/load: what a decode pod needs to choose a prefill pod."""

    num_waiting: int
    num_running: int
    agent: str
    fingerprint: str
