"""The decode engine's side of disaggregation, decided per request (llm-d's pattern: the decode pod orchestrates,
inside its own server, no sidecar and no proxy):

1. `route`: a prompt with more uncached tokens than the threshold (after this engine's own prefix cache) goes to
   a prefill pod that is not saturated (power of two choices, peers.py); shorter ones are prefilled here, chunked
   under this engine's knobs.
2. `prefill`: POST /kv/prefill; the prefill pod computes the prompt, samples the first token (which the caller
   streams at once) and holds the prompt's blocks under a one-time transfer id.
3. `pull`: reserve blocks here, read only those this engine's prefix cache lacks, in slices paced to a share of a
   core (pacing.py), check each block's checksum as it lands, release the lease. The release answers whether the
   lease still held when the read was done: a lease that expired meanwhile may have had its blocks overwritten, so
   what was read is thrown away.

Any failure (prefill pod unreachable or killed mid-transfer, another KV layout, a checksum that does not match, a
lease that expired, no room here) frees what was reserved. A failure that was the prefill pod's may go to another
prefill pod (`retry_peer`, under retry.py's rule); otherwise the request is prefilled here with the first token it
already has: the client sees a correct answer, and a metric counts the reason. Blocks enter this engine's prefix
cache only after they were verified (Scheduler.add_prefilled)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx

from chunkpilot.contract.engine_settings import default as setting_default
from chunkpilot.contract.metric_names import KV_FALLBACK_REASONS
from chunkpilot.engine.core.sequence import Sequence
from chunkpilot.engine.kv_transfer.pacing import ChecksumMismatch, paced_read
from chunkpilot.engine.kv_transfer.peers import Peer, PrefillPeers
from chunkpilot.engine.kv_transfer.retry import LocalPrefillCost, should_retry
from chunkpilot.engine.kv_transfer.transport import KVTransport, TransferError
from chunkpilot.engine.kv_transfer.wire import KVOffer, PrefillRequest, Release, ReleaseReply

log = logging.getLogger(__name__)

# Fallback reasons, the `reason` label of remote_prefill_fallbacks_total (the contract lists them):
# the prefill pod did not answer or failed the request; another model, dtype, block size or layout; no blocks or
# running slot here for the prompt; the read failed (the prefill pod died mid-transfer, the connection broke); a
# block read differs from what the prefill pod computed; the lease had expired (or the id was stale) when the read
# was done; a retry's prefill pod sampled another first token than the one the client already has
UNREACHABLE, FINGERPRINT, NO_ROOM, TRANSFER, CHECKSUM, LEASE, FIRST_TOKEN = KV_FALLBACK_REASONS


class PullFailed(Exception):
    def __init__(self, reason: str, detail: str, *, unsafe: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.unsafe = reason, unsafe


class RemotePrefill:
    def __init__(self, engine, transport: KVTransport, peers: PrefillPeers, client: httpx.AsyncClient, *,
                 threshold: int, fingerprint: str, timeout: float = 30.0, headers: dict[str, str] | None = None,
                 retries: int = setting_default("prefill_retries"), first_token_with_kv: bool = False,
                 pull_share: float = setting_default("pull_share")) -> None:
        """`engine`: the LLMEngine (its disaggregation methods); `headers`: this pod's own credentials for the
        prefill pods' /kv/release and /kv/agent (the prefill call itself carries the client's); `retries`: other
        prefill pods a failed prompt may go to (retry.py); `first_token_with_kv`: the first token waits until the
        blocks joined the batch here (--first-token); `pull_share`: the pull's pacing on the CPU (pacing.py)."""
        self.engine = engine
        self.transport = transport
        self.peers = peers
        self.client = client
        self.threshold = threshold
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.headers = headers or {}
        self.first_token_with_kv = first_token_with_kv
        self.pull_share = pull_share
        self.block_size = transport.block_size
        self.retries = retries
        self.local_cost = LocalPrefillCost()  # fed by the step loop (AsyncEngine): the retry rule's yardstick
        # a pull holds a thread for its reads, checksums and pacing pauses (pacing.py); two at a time keeps all pulls
        # together to twice --pull-share of a core: more threads would give more of the decode steps' core to pulls
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kv-pull")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.transport.close()

    # ---- 1. where the prompt is prefilled ---------------------------------------------------------------
    def route(self, seq: Sequence) -> Peer | None:
        """The prefill pod for `seq`, or None: prefill here. The threshold is the knobs' (pushed or from the knobs
        file, as the tuner moves it) where they carry one, else the start-up setting. A live-roles engine in the prefill
        role prefills every prompt itself (its own address may still be among the peers for a DNS refresh)."""
        knobs = self.engine.knobs.get()
        if knobs.role == "prefill":  # a live-roles engine switched to prefill: what clients still send it stays here
            return None
        threshold = self.threshold if knobs.disagg_threshold is None else knobs.disagg_threshold
        if self.uncached_tokens(seq) <= threshold:
            return None
        return self.peers.pick()

    def uncached_tokens(self, seq: Sequence) -> int:
        """The prompt's tokens this engine's prefix cache does not hold now: what a local prefill would compute."""
        return len(seq.prompt_token_ids) - self.engine.cached_prefix_tokens(seq)

    # ---- 2. the prefill call ----------------------------------------------------------------------------
    async def prefill(self, peer: Peer, seq: Sequence, *, auth: str | None, cache_salt: str | None) -> KVOffer:
        """Raises PullFailed (unreachable, fingerprint; first_token when `seq` already has its first token, from an
        earlier attempt, and this pod sampled another: the client cannot be given two)."""
        body = PrefillRequest(token_ids=seq.prompt_token_ids, params=seq.params, cache_salt=cache_salt,
                              fingerprint=self.fingerprint)
        headers = {"Authorization": auth} if auth else dict(self.headers)
        headers["Content-Type"] = "application/json"
        try:
            r = await self.client.post(peer.url + "/kv/prefill", content=body.model_dump_json(), headers=headers,
                                       timeout=self.timeout)
        except httpx.HTTPError as e:
            self.peers.mark_down(peer.url)
            raise PullFailed(UNREACHABLE, f"{peer.url}: {type(e).__name__}: {e}") from None
        except Exception as e:  # noqa: BLE001 - whatever the call raised, the request is prefilled here
            log.exception("the prefill call to %s failed", peer.url)
            raise PullFailed(UNREACHABLE, f"{peer.url}: {type(e).__name__}: {e}") from None
        if r.status_code == 409:
            raise PullFailed(FINGERPRINT, f"{peer.url}: {r.text[:200]}")
        if r.status_code != 200:
            raise PullFailed(UNREACHABLE, f"{peer.url} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            offer = KVOffer.model_validate_json(r.content)
        except ValueError as e:
            raise PullFailed(UNREACHABLE, f"{peer.url} sent a malformed offer: {e}") from None
        n = -(-len(seq.prompt_token_ids) // self.block_size)
        if len(offer.blocks) != n or len(offer.checksums) != n:
            await self.release(peer, offer)
            raise PullFailed(UNREACHABLE, f"{peer.url} offered {len(offer.blocks)} blocks and {len(offer.checksums)} "
                                          f"checksums for a prompt of {n} blocks")
        if offer.fingerprint != self.fingerprint or offer.block_size != self.block_size:
            await self.release(peer, offer)
            raise PullFailed(FINGERPRINT, f"{peer.url}'s KV layout is {offer.fingerprint}, ours {self.fingerprint}")
        # a seeded draw depends on (seed, output position) only, a greedy one on the logits: any pod with our KV
        # layout samples the same first token, unless its numerics differ (another device or kernel)
        if seq.output_token_ids and offer.first_token != seq.output_token_ids[0]:
            await self.release(peer, offer)
            raise PullFailed(FIRST_TOKEN, f"{peer.url} sampled token {offer.first_token} first, the client already "
                                          f"has {seq.output_token_ids[0]}")
        return offer

    # ---- 3. the pull ------------------------------------------------------------------------------------
    async def pull(self, peer: Peer, seq: Sequence, offer: KVOffer, wake=lambda: None) -> int:
        """Fill blocks reserved for `seq` with the offer's K/V, verified, and release the lease. Returns the bytes
        moved; raises PullFailed after giving back whatever it reserved (but blocks a read may still write).
        `wake`: wakes the step loop, which applies the reservation (an idle loop would otherwise find it only at
        its next 0.5 s poll, and that wait would land in the request's first inter-token gap)."""
        try:
            reservation = self.engine.reserve_prefilled(seq)
            wake()
            reserved = await asyncio.wrap_future(reservation)
        except BaseException:
            await self.release(peer, offer)
            raise
        if not reserved:
            await self.release(peer, offer)
            raise PullFailed(NO_ROOM, "no free blocks or running slot for the prompt here")
        bs, n = self.block_size, -(-len(seq.prompt_token_ids) // self.block_size)
        first = seq.num_cached_tokens // bs  # this engine's own prefix cache covered these
        local, remote, sums = seq.block_table[first:n], offer.blocks[first:n], offer.checksums[first:n]
        loop = asyncio.get_running_loop()
        failure: PullFailed | None = None
        nbytes = 0
        try:  # never cancelled (AsyncEngine marks a request abandoned instead): the read must end before any free
            nbytes = await loop.run_in_executor(self._pool, self._read, peer, offer, remote, local, sums)
        except PullFailed as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - the read returned or raised, so its blocks are safe to free
            log.exception("pulling KV blocks from %s failed", peer.url)
            failure = PullFailed(TRANSFER, f"{type(e).__name__}: {e}")
        held = await self.release(peer, offer)
        if failure is None and not held:
            failure = PullFailed(LEASE, f"{peer.url} no longer held transfer {offer.transfer_id[:8]} when the read "
                                        "ended (lease expired or id stale)")
        if failure is not None:
            if failure.unsafe:
                # a read we could not stop may still write into these blocks: keep them out of the pool for good
                log.error("leaking %d KV blocks a failed read may still write", len(seq.block_table))
                seq.block_table = []
            else:
                self.engine.cancel_reserved(seq)
            raise failure
        return nbytes

    def _read(self, peer: Peer, offer: KVOffer, remote: list[int], local: list[int], sums: list[int]) -> int:
        def fetch() -> bytes:
            with httpx.Client(timeout=5.0) as c:
                r = c.get(peer.url + "/kv/agent", headers=self.headers)
                r.raise_for_status()
                return r.content

        try:
            return paced_read(self.transport, offer.agent, fetch, offer.layout, remote, local, sums, self.timeout,
                              share=self.pull_share)
        except TransferError as e:
            raise PullFailed(TRANSFER, str(e), unsafe=e.unsafe) from None
        except ChecksumMismatch as e:
            raise PullFailed(CHECKSUM, f"{e} ({peer.url})") from None

    async def release(self, peer: Peer, offer: KVOffer) -> bool:
        """Whether the lease still held. A prefill pod that cannot be reached releases by expiry."""
        try:
            r = await self.client.post(peer.url + "/kv/release", timeout=5.0,
                                       headers={**self.headers, "Content-Type": "application/json"},
                                       content=Release(transfer_id=offer.transfer_id).model_dump_json())
            return r.status_code == 200 and ReleaseReply.model_validate_json(r.content).held
        except (httpx.HTTPError, ValueError):
            return False

    # ---- 4. another prefill pod, after one failed -------------------------------------------------------
    def retry_peer(self, seq: Sequence, failure: PullFailed, tried: list[str], spent: float) -> Peer | None:
        """The prefill pod to try next for `seq` after `failure`, `spent` seconds into the attempt that failed, or
        None: prefill here. `tried`: the urls of the pods that failed it already, never chosen again."""
        local = self.local_cost.seconds(self.uncached_tokens(seq))
        if not should_retry(failure.reason, len(tried) - 1, self.retries, spent, local):
            return None
        return self.peers.pick(exclude=tried)
