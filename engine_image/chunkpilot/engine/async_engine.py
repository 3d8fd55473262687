"""The engine behind the HTTP server: the step loop on its own thread, per-request asyncio queues, a bounded
waiting queue, request-level metrics, and draining on shutdown."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from chunkpilot.contract.slo import IMPLICIT_CLASS, SLOClass, kept
from chunkpilot.engine.core.knobs import KnobHolder
from chunkpilot.engine.core.outputs import RequestOutput
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.sequence import Sequence
from chunkpilot.engine.core.stats import SchedulerStats, StepStats
from chunkpilot.engine.kv_transfer.decode_side import PullFailed, RemotePrefill
from chunkpilot.engine.llm_engine import LLMEngine
from chunkpilot.engine.metrics import EngineMetrics
from chunkpilot.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting`: the client should retry later (HTTP 429)."""


class EngineUnavailableError(RuntimeError):
    """The engine is draining for shutdown, or its step loop died (HTTP 503)."""


@dataclass
class _Live:
    seq: Sequence
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    first_token: float | None = None
    last_token: float | None = None
    # disaggregation: the task that has a prefill pod compute the prompt; the caller left (nothing may enter the
    # engine for it any more); when its pulled blocks joined the batch (the first decode's phase starts); the
    # detokenizer of the first token a prefill pod sampled, once the client has it (a retry or a local prefill
    # goes on from it instead of streaming the token again)
    remote: asyncio.Task | None = None
    abandoned: bool = False
    admitted: float | None = None
    detok: IncrementalDetokenizer | None = None
    # --first-token with-kv: when the first token was sampled, and its output, held back until the blocks are here
    prefilled: float | None = None
    held: RequestOutput | None = None
    gaps: list[float] = field(default_factory=list)  # with SLO classes: its inter-token gaps (the SLO-met counter)


# Tokenizing and chat templating run here, off the event loop, so a large prompt never stalls /health or other
# clients' streams; two workers bound the CPU they take from the step loop.
PREPARE_WORKERS = 2


class AsyncEngine:
    # an idle step loop comes round this often (its heartbeat); work queued for it must set _wake, or it waits
    idle_poll = 0.5

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, *, max_waiting: int = 256, retry_after: int = 1,
                 remote: RemotePrefill | None = None) -> None:
        """`remote`: a decode (or both) engine's way to prefill long prompts on prefill pods (kv_transfer/)."""
        self.engine = engine
        self.remote = remote
        self.retry_after = retry_after  # seconds, sent with HTTP 429
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._live: dict[str, _Live] = {}
        self._preparing = 0  # requests being tokenized (event-loop thread only)
        self._class_waiting: dict[str, int] = {}  # SLO class -> requests without a first output (event loop only)
        self._closing = False  # drain has aborted what was left: nothing more may be submitted
        self._prepare = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="tokenize")
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self.draining = False
        self.error: BaseException | None = None
        self.heartbeat = time.monotonic()
        self._seen = SchedulerStats(StepStats(), 0, 0, 0.0, 0, 0, 0)  # the totals the counters have counted
        self.publish_knobs()

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._prepare.shutdown(wait=False, cancel_futures=True)
        # tensor-parallel workers: a step loop still inside a step may be inside a collective, so kill them then
        self.engine.close(force=self._thread.is_alive())

    def stalled(self, timeout: float) -> bool:
        """The step loop has not come round for `timeout` seconds (it comes round every 0.5 s when idle): a step
        hangs, and only a restart helps."""
        return self._thread.is_alive() and time.monotonic() - self.heartbeat > timeout

    async def drain(self, grace: float) -> None:
        """Stop admitting; wait up to `grace` seconds for in-flight requests, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + grace
        # requests admitted before the signal and still being tokenized get their grace period too
        while (self.num_in_flight or self._preparing) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            self._closing = True
            left = list(self._live)
        for rid in left:
            self.engine.abort(rid)
        self._wake.set()
        if left:
            log.warning("aborted %d requests still running after the %.0fs grace period", len(left), grace)

    # ---- what the server may read of the engine (its facade: nothing else of LLMEngine) --------------------
    @property
    def knobs(self) -> KnobHolder:
        """The live scheduler knobs (the admin API and the knobs file write them here)."""
        return self.engine.knobs

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not running: being tokenized, queued for the next step, or waiting in the
        scheduler. Not `_live`: a finished request whose output a slow client has not read yet holds no engine
        resource and must not hold an admission slot (32 unread streams had made an idle engine answer 429)."""
        return self._preparing + self.engine.num_waiting

    # ---- requests ---------------------------------------------------------------------------------------
    @property
    def num_client_requests(self) -> int:
        """Requests in flight for clients, the prompts a prefill pod holds for decode pods left out (a live-roles
        engine's drain waits for these: kv_routes.DrainGate)."""
        with self._lock:
            return sum(1 for live in self._live.values() if not live.seq.hold_kv)

    async def generate(
        self, request_id: str, prompt=None, params: SamplingParams | None = None, *, messages=None,
        cache_salt: bytes = b"", hold_kv: bool = False, remote_auth: str | None = None,
        remote_salt: str | None = None, slo_class: SLOClass | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them. Raises ValueError (bad input), QueueFullError,
        EngineUnavailableError before the first output. Closing the iterator early aborts the request and frees
        its KV blocks at the next step boundary.

        Disaggregation: `hold_kv` (prefill role) keeps the finished prompt's blocks for a decode pod (the last
        output's `held_blocks`); `remote_auth`/`remote_salt`: the caller's Authorization header and own cache
        salt, which a prefill pod needs to salt the prompt as this engine does. `slo_class`: the request's SLO
        class (None without classes); a sheddable class past its queue limit raises QueueFullError."""
        if self.draining or not self.alive:
            raise EngineUnavailableError("the engine is shutting down" if self.draining else "the engine stopped")
        self._admit()
        self._admit_class(slo_class)
        # waiting in its class until its first output (counted on the event loop's thread only)
        queued = slo_class.name if slo_class is not None else None
        if queued is not None:
            self._class_waiting[queued] = self._class_waiting.get(queued, 0) + 1
        try:
            loop = asyncio.get_running_loop()
            self._preparing += 1
            try:
                seq = await loop.run_in_executor(
                    self._prepare, lambda: self.engine.make_sequence(request_id, prompt, params, messages=messages,
                                                                     cache_salt=cache_salt))
            finally:
                self._preparing -= 1
            seq.hold_kv = hold_kv
            seq.slo_class = slo_class
            live = _Live(seq, asyncio.Queue(), loop)
            with self._lock:
                if self.error is not None:  # the loop died after the check above: do not wait for it forever
                    raise EngineUnavailableError("the engine stopped")
                if self._closing:  # tokenized after the grace period ended: nobody would abort it any more
                    raise EngineUnavailableError("the engine is shutting down")
                if request_id in self._live:
                    raise ValueError(f"request id {request_id!r} is already in flight")
                self._live[request_id] = live
            peer = self.remote.route(seq) if self.remote is not None else None
            if peer is None:
                self.engine.submit(seq)
            else:
                live.remote = asyncio.ensure_future(self._remote_prefill(live, peer, remote_auth, remote_salt))
            self._wake.set()
            finished = False
            try:
                while True:
                    item = await live.queue.get()
                    if isinstance(item, BaseException):
                        raise EngineUnavailableError(f"the engine failed: {item}") from item
                    if queued is not None:  # its first output: no longer waiting in its class
                        self._class_waiting[queued] -= 1
                        queued = None
                    yield item
                    if item.finished:
                        finished = True
                        return
            finally:
                if not finished:  # client went away or the caller stopped reading
                    live.abandoned = True  # a remote prefill in flight puts nothing into the engine any more
                    self.engine.abort(request_id)
                    if hold_kv:  # it may have finished holding blocks that no lease will ever release
                        self.engine.drop_held(seq)
                    self._wake.set()
                with self._lock:
                    self._live.pop(request_id, None)
        finally:
            if queued is not None:
                self._class_waiting[queued] -= 1

    async def _remote_prefill(self, live: _Live, peer, auth: str | None, salt: str | None) -> None:
        """A prefill pod computes the prompt; its first token goes to the client at once; the blocks are pulled
        and the sequence decodes here. A failure that was the prefill pod's may go to another one (the rule:
        kv_transfer/retry.py); otherwise the prompt is prefilled here (with the first token, once the client has
        it). Never cancelled: a request the client left is marked abandoned."""
        try:
            await self._remote_prefill_steps(live, peer, auth, salt)
        except Exception as e:  # a bug, not a peer's failure (those fall back): fail the request, never hang it
            log.exception("remote prefill of %s failed", live.seq.request_id)
            live.queue.put_nowait(e)

    async def _remote_prefill_steps(self, live: _Live, peer, auth: str | None, salt: str | None) -> None:
        seq = live.seq
        t0 = time.monotonic()
        seq.first_scheduled_time = t0  # the queue metric ends here; the prefill's phase begins
        self.metrics.ttft_phase("queue").observe(t0 - seq.arrival_time)
        tried: list[str] = []
        while True:
            started = time.monotonic()
            try:
                return await self._remote_attempt(live, peer, auth, salt)
            except PullFailed as e:
                failure, spent = e, time.monotonic() - started
            tried.append(peer.url)
            # what the attempt reserved is given back already (pull), queued before anything the next reserves
            peer = None if live.abandoned or self._closing else self.remote.retry_peer(seq, failure, tried, spent)
            if peer is None:
                log.info("remote prefill of %s not used, prefilling here (%s)", seq.request_id, failure)
                return self._prefill_here(live, failure.reason)
            log.info("remote prefill of %s failed (%s), trying %s", seq.request_id, failure, peer.url)
            self.metrics.kv_retry(failure.reason).inc()

    async def _remote_attempt(self, live: _Live, peer, auth: str | None, salt: str | None) -> None:
        """One prefill pod computes the prompt and its blocks are pulled. The first attempt that gets a first
        token streams it (with-kv: as the blocks join the batch); a later attempt's must be the same
        (RemotePrefill.prefill checks). Raises PullFailed, having given back what it reserved."""
        seq, m, remote = live.seq, self.metrics, self.remote
        offer = await remote.prefill(peer, seq, auth=auth, cache_salt=salt)
        if live.detok is None:
            t1 = time.monotonic()
            m.ttft_phase("remote_prefill").observe(t1 - seq.first_scheduled_time)  # failed attempts included
            out, live.detok = self.engine.first_output(seq, offer.first_token, offer.logprob)
            live.prefilled = t1
            # early: the client has the first token now, and the gap to the second holds the pull; with-kv: it
            # waits for the blocks, so that gap is one decode step (a tight ITL SLO's choice). A request that
            # ends here, or whose client left or engine closes, gets it now: no pull follows.
            if remote.first_token_with_kv and not (out.finished or live.abandoned or self._closing):
                live.held = out
            else:
                self._deliver(out, t1)
            if out.finished:
                await remote.release(peer, offer)
                return
        if live.abandoned or self._closing:
            await remote.release(peer, offer)
            return self._end_unfinished(live)
        started = time.monotonic()
        try:
            nbytes = await remote.pull(peer, seq, offer, wake=self._wake.set)
        except PullFailed as e:
            log.warning("pulling the KV blocks of %s from %s failed (%s)", seq.request_id, peer.url, e)
            m.kv_failed.inc()
            raise
        t2 = time.monotonic()
        # from the first token sampled to the blocks here: a retry's prefill included
        m.ttft_phase("transfer").observe(t2 - live.prefilled)
        m.kv_xfer_time.observe(t2 - started)
        m.kv_xfer_bytes.observe(nbytes)
        m.kv_transfer_bytes.inc(nbytes)
        m.kv_transfer("ok").inc()
        if live.abandoned or self._closing:
            self.engine.cancel_reserved(seq)
            self._wake.set()
            return self._end_unfinished(live)
        live.admitted = t2
        # with-kv: the held first token goes as the blocks join the batch, on the step loop's thread, before the
        # step that makes the second token (not at the pull's end: the wait for the step in flight would land in
        # the first gap); after admission only that thread touches live.held
        self.engine.admit_prefilled(seq, live.detok,
                                    on_admitted=(lambda: self._send_held(live, time.monotonic()))
                                    if live.held is not None else None)
        self._wake.set()

    def _prefill_here(self, live: _Live, reason: str) -> None:
        self.metrics.kv_fallback(reason).inc()
        self.metrics.kv_transfer("fallback").inc()
        if live.abandoned or self._closing:
            return self._end_unfinished(live)
        self._send_held(live, time.monotonic())  # the local prefill goes on from the first token: it goes first
        self.engine.submit(live.seq, live.detok)
        self._wake.set()

    def _send_held(self, live: _Live, now: float) -> None:
        """with-kv: the first token, held back for the blocks, goes to the client now."""
        if live.held is not None:
            out, live.held = live.held, None
            self._deliver(out, now)

    def _end_unfinished(self, live: _Live) -> None:
        """The engine is closing (or the client left) before the request entered it: end its stream as drain
        ends the others'."""
        if not live.abandoned:
            self._send_held(live, time.monotonic())
            seq = live.seq
            live.queue.put_nowait(RequestOutput(seq.request_id, [], "", True, "abort",
                                                num_prompt_tokens=len(seq.prompt_token_ids),
                                                num_output_tokens=len(seq.output_token_ids)))

    def release_held(self, blocks: list[int]) -> None:
        """Prefill role: a lease ended; the blocks go back at the next step boundary."""
        self.engine.release_held(blocks)
        self._wake.set()

    @property
    def kv_pool(self):
        """The KV pool tensor (prefill role: checksums of the blocks it offers)."""
        return self.engine.kv_pool

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def _admit_class(self, slo_class: SLOClass | None) -> None:
        """A sheddable class has a queue of its own: past its limit a request of it is refused (HTTP 429)."""
        if slo_class is None or slo_class.queue_limit is None:
            return
        waiting = self._class_waiting.get(slo_class.name, 0)
        if waiting >= slo_class.queue_limit:
            self.metrics.rejected.labels(self.metrics.model_name, "class_queue_full").inc()
            raise QueueFullError(f"{waiting} requests of SLO class {slo_class.name!r} are already waiting (its "
                                 f"queueLimit is {slo_class.queue_limit})")

    def _admit(self) -> None:
        waiting = self.num_waiting
        if waiting >= self.max_waiting:
            self.metrics.rejected.labels(self.metrics.model_name, "queue_full").inc()
            raise QueueFullError(f"{waiting} requests are already waiting (max_waiting={self.max_waiting})")

    # ---- the step loop (its own thread) -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._wake.clear()
                if not self.engine.has_unfinished():
                    self._publish_state(self.engine.stats())
                    self._wake.wait(self.idle_poll)
                    continue
                started = time.monotonic()
                outputs = self.engine.step()
                now = time.monotonic()
                for out in outputs:
                    self._deliver(out, now)
                stats = self.engine.stats()
                self._publish_state(stats)
                # the whole iteration (delivery included): the time a waiting prompt really waits for a step
                self._record_step(time.monotonic() - started, stats)
        except BaseException as e:  # the step loop must never die silently: fail every request, go unready
            log.exception("engine step loop died")
            with self._lock:  # together with generate()'s check: every request is failed or refused
                self.error = e
                lives = list(self._live.values())
            for live in lives:
                live.loop.call_soon_threadsafe(live.queue.put_nowait, e)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            live = self._live.get(out.request_id)
        if live is None:
            return
        m = self.metrics
        slo_class = live.seq.slo_class
        c = m.classed(slo_class.name if slo_class is not None else IMPLICIT_CLASS)
        if out.new_token_ids:
            m.generation_tokens.inc(len(out.new_token_ids))
            if live.first_token is None:
                live.first_token = now
                seq = live.seq
                c.ttft.observe(now - seq.arrival_time)
                started = seq.first_scheduled_time or now
                m.queue_time.observe(started - seq.arrival_time)
                m.prefill_time.observe(now - started)
                m.prompt_tokens.inc(out.num_prompt_tokens)
            else:
                c.itl.observe(now - live.last_token)
                if slo_class is not None:
                    live.gaps.append(now - live.last_token)
                if live.admitted is not None:  # the first step after pulled blocks joined the batch
                    m.ttft_phase("first_decode").observe(now - live.admitted)
                    live.admitted = None
            live.last_token = now
        if out.finished and out.finish_reason != "abort":
            seq = live.seq
            c.e2e.observe(now - seq.arrival_time)
            c.finished(out.finish_reason).inc()
            if seq.relegated:
                c.relegated.inc()
            if slo_class is not None and live.first_token is not None and kept(slo_class.slo,
                                                                            live.first_token - seq.arrival_time,
                                                                            live.gaps):
                c.slo_met.inc()
            m.request_prompt_tokens.observe(out.num_prompt_tokens)
            m.request_generation_tokens.observe(out.num_output_tokens)
            if live.first_token is not None:
                m.decode_time.observe(now - live.first_token)
                if out.num_output_tokens > 1:
                    m.tpot.observe((now - live.first_token) / (out.num_output_tokens - 1))
        live.loop.call_soon_threadsafe(live.queue.put_nowait, out)

    def _record_step(self, seconds: float, stats: SchedulerStats) -> None:
        m, step = self.metrics, stats.step
        if step.num_tokens:
            m.iteration_tokens.observe(step.num_tokens)
            m.step_moments.add(step.features, seconds)
        if step.num_prefill_tokens:  # prefill is busy exactly while steps compute prompt tokens
            m.prefill_busy.inc(seconds)
            m.prefill_computed.inc(step.num_prefill_tokens)
            if self.remote is not None:  # what a prompt token costs here: the yardstick of the retry rule
                self.remote.local_cost.add(seconds, step.num_prefill_tokens)
        # the engine keeps totals; the counters move by what is new since the last step read
        m.prefix_queries.inc(stats.prefix_queries - self._seen.prefix_queries)
        m.prefix_hits.inc(stats.prefix_hits - self._seen.prefix_hits)
        m.preemptions.inc(stats.num_preemptions - self._seen.num_preemptions)
        self._seen = stats
        if step.num_drafts:
            m.spec_drafts.inc(step.num_drafts)
            m.spec_draft_tokens.inc(step.num_draft_tokens)
            m.spec_accepted.inc(step.num_accepted_tokens)
            for position, kept in enumerate(step.accepted_per_position):
                m.spec_accepted_at(position).inc(kept)

    def _publish_state(self, stats: SchedulerStats) -> None:
        m = self.metrics
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting)
        m.kv_usage.set(stats.kv_usage)
        m.spec_paused.set(stats.num_drafts_paused)
        m.spec_min_acceptance.set(stats.draft_min_acceptance)
        self.publish_knobs()

    def publish_knobs(self) -> None:
        knobs = self.engine.knobs.get()
        self.metrics.token_budget.set(knobs.token_budget)
        self.metrics.max_chunk.set(knobs.max_chunk)
        self.metrics.generation.set(knobs.generation)
        if knobs.role is not None:  # a live-roles engine's role (others publish their start-up role once)
            self.metrics.publish_role(knobs.role)
