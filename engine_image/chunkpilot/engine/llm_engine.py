"""The step-level engine: requests in, one scheduled forward per `step()`, incremental outputs out.

`add_request` and `abort` may be called from any thread; they are queued and applied at the next step boundary,
so the step loop (and the scheduler it owns) stays single-threaded.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import torch

from chunkpilot.contract.step_cost import step_features
from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.core.block_manager import BlockManager, CacheShape
from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.outputs import RequestOutput, TokenLogprob
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.scheduler import MIN_ACCEPTANCE, Scheduler, SchedulerConfig
from chunkpilot.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from chunkpilot.engine.execution.activation_memory import activation_bytes_per_token, device_free_memory
from chunkpilot.engine.execution.kv_blocks import CHECKSUM
from chunkpilot.engine.model.model_config import ModelConfig
from chunkpilot.engine.speculation.draft_cost import RowCost
from chunkpilot.engine.speculation.proposers import propose_drafts
from chunkpilot.engine.speculation.speculative import make_proposer
from chunkpilot.engine.core.stats import SchedulerStats, StepStats
from chunkpilot.engine.execution.tp_worker import RankFailedError, WorkerProcesses
from chunkpilot.engine.execution.worker import RankMemory, Worker, resolve_device
from chunkpilot.engine.kv_transfer.wire import fingerprint
from chunkpilot.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from chunkpilot.engine.model.tp_shard import check_tensor_parallel
from chunkpilot.engine.parallel.tp_group import KEEPALIVE, Rendezvous, TPGroup

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, exit_on_rank_failure: bool = True,
                 free_memory: Callable[[torch.device], int | None] = device_free_memory) -> None:
        """`exit_on_rank_failure`: under tensor parallelism, a rank that dies or hangs exits the process
        non-zero (a server: the pod restarts); False raises RankFailedError from `step` instead. `free_memory`:
        reads the device's free bytes for the token budget's bound (execution/activation_memory.py); a stand-in lets a
        test play a GPU on the CPU. Rank 0's only, so not under tensor parallelism."""
        if free_memory is not device_free_memory and config.tensor_parallel_size > 1:
            raise ValueError("free_memory is rank 0's reading: the other ranks could not agree on a bound from it; "
                             "give it with tensor_parallel_size 1")
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model_config = ModelConfig.from_dir(config.model)
        check_tensor_parallel(self.model_config, config.tensor_parallel_size)  # before any process starts
        self.tokenizer = Tokenizer(config.model)
        self._workers: WorkerProcesses | None = None
        self.group = group = TPGroup(0, config.tensor_parallel_size)
        try:  # everything that may fail once workers run: they must not outlive a failed start
            self._build(config, exit_on_rank_failure, free_memory)
        except BaseException:
            if self._workers is not None:
                self._workers.kill()
            group.close()
            raise
        # Every collective of rank 0 holds this: a step's, or a keep-alive's while the engine is idle.
        self._collective = threading.Lock()
        self._last_collective = time.monotonic()
        self._keepalive_stop = threading.Event()
        if self._workers is not None:
            self._workers.arm()
            # not a bound method: the thread must not keep the engine alive (its finalizer stops the workers)
            threading.Thread(target=_keepalive, args=(weakref.ref(self), config.tensor_parallel_timeout / 4),
                             name="tp-keepalive", daemon=True).start()
        self._pending: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._pending_adds = 0  # submitted, not yet in the scheduler (admission counts them as waiting)
        self._pending_lock = threading.Lock()
        self._live: dict[str, tuple[Sequence, IncrementalDetokenizer]] = {}
        self.last_step = StepStats()
        self._row_cost = RowCost() if config.speculative_config else None
        # Move everything built so far (model, tokenizer, pools) out of the garbage collector's generations:
        # full collections then scan far less, which shortens the pauses that show up as inter-token spikes.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let interpreter shutdown free them as usual (extensions check for leaks)
        # Stops the workers when the engine is collected or the interpreter exits, without keeping it alive.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, self.group, False,
                                           self._keepalive_stop, self._collective)

    def _build(self, config: EngineConfig, exit_on_rank_failure: bool,
               free_memory: Callable[[torch.device], int | None]) -> None:
        group, store = self.group, None
        if group.distributed:
            resolve_device(config.device, 0, group.world)  # a missing GPU is said here, not by N crashes
            rendezvous = Rendezvous(group.world, config.tensor_parallel_join_timeout)
            store = rendezvous.store
            self._workers = WorkerProcesses(config, group.world, rendezvous, exit_on_failure=exit_on_rank_failure)
        self.worker = Worker(config, self.model_config, group, store,
                             check=self._workers.check if self._workers else None, free_memory=free_memory)
        self.rank_memory: list[RankMemory] = [RankMemory(*m) for m in group.gather_ints(self.worker.memory.values())]
        self.device, self.dtype = self.worker.device, self.worker.dtype
        self.max_model_len = self.worker.max_model_len
        self.model, self.kv_cache, self.runner = self.worker.model, self.worker.kv_cache, self.worker.runner
        self.sampler = self.runner.sampler
        self.attention_backend = self.worker.attention_backend
        self.block_manager = BlockManager(
            self.kv_cache.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        spec = config.speculative_config
        # drafts for the next step, guessed after each step (propose_drafts) and handed to the scheduler
        self.proposer = proposer = self._proposer(spec) if spec else None
        if proposer is not None:
            # a draft model's weights and KV pool share this device: what is left for activations is read once
            # they are loaded, or a budget pushed up to the bound runs the device out of memory mid-step
            self.worker.remeasure_activation_fit()
        self.max_token_budget = self._max_token_budget()
        self.knobs = KnobHolder(
            SchedulerKnobs(config.token_budget, config.max_chunk, 0), min_token_budget=config.max_num_seqs,
            max_token_budget=self.max_token_budget,
        )
        eos = self.model_config.eos_token_ids
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self.max_model_len, tuple(eos), config.slo_classes),
            self.block_manager, self.knobs,
            spec.num_speculative_tokens if spec else 0, spec.disable_by_batch_size if spec else None,
        )

    def _proposer(self, spec):
        """A draft model gets its own engine on this process's device (rank 0's under tensor parallelism), with
        as many KV blocks as this one, so it can keep every running sequence's context."""
        return make_proposer(spec, self.config, max_model_len=self.max_model_len, num_blocks=self.kv_cache.num_blocks,
                             vocab_size=self.model_config.vocab_size, tokenizer=self.tokenizer,
                             new_engine=functools.partial(LLMEngine, exit_on_rank_failure=False))

    def close(self, *, force: bool = False) -> None:
        """Stop the tensor-parallel workers: they finish and exit 0. `force` kills them instead (the step loop
        may still be inside a collective). Idempotent."""
        if self._workers is not None:
            self._finalizer.detach()
            _stop_workers(self._workers, self.group, force, self._keepalive_stop, self._collective)
        # The freeze at start put this engine itself out of the collector's reach: a closed engine left in a
        # reference cycle (a test's patched step, say) would keep its KV pool for good. Everything goes back to
        # the generations (other engines in this process included: they are only scanned again).
        gc.unfreeze()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (empty without tensor parallelism)."""
        return self._workers.pids if self._workers is not None else []

    # ---- construction -----------------------------------------------------------------------------------
    def _max_token_budget(self) -> int:
        """No step can use more than every running sequence's whole context, nor more activations than the GPU
        has left after weights and KV cache; a larger budget (a typo in a knobs file, a tuner bound) could only
        run the device out of memory and kill the step loop."""
        cfg = self.config
        bound = cfg.max_num_seqs * self.max_model_len
        fits = self.worker.activation_fit  # the smallest over the ranks; None on the CPU
        if fits is not None:
            if cfg.token_budget > fits:
                need = activation_bytes_per_token(self.model_config, self.dtype, self.worker.shard) * cfg.token_budget / 2**30
                raise ValueError(f"--token-budget {cfg.token_budget} needs about {need:.1f} GiB of activations, but "
                                 f"this GPU has room for {fits} tokens after weights and KV cache: lower "
                                 "--token-budget or --gpu-memory-utilization")
            if cfg.max_token_budget is not None and cfg.max_token_budget > fits:
                log.warning("--max-token-budget %d does not fit this GPU's memory; budgets up to %d are accepted",
                            cfg.max_token_budget, fits)
            bound = min(bound, fits)
        if cfg.max_token_budget is not None:
            bound = min(bound, cfg.max_token_budget)
        return max(bound, cfg.token_budget)

    # ---- requests ---------------------------------------------------------------------------------------
    def make_sequence(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        cache_salt: bytes = b"",
    ) -> Sequence:
        """Tokenize and validate a request; raises ValueError naming the field at fault. Sizes are checked
        before any tokenizing or templating, so an oversized prompt costs nothing."""
        params = params or SamplingParams()
        if messages is not None:
            if len(messages) > self.max_model_len:  # every message costs at least one token of the template
                raise ValueError(f"messages has {len(messages)} entries, more than max_model_len={self.max_model_len}")
            self._check_chars(sum(len(m.get("content") or "") for m in messages), "messages")
            token_ids = self.tokenizer.encode_chat(messages)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string")
            self._check_chars(len(prompt), "prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt:
            self._check_tokens(len(prompt))
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        self._check_tokens(len(token_ids))
        return Sequence(request_id, token_ids, params, cache_salt=cache_salt)

    @property
    def max_prompt_chars(self) -> int:
        # Twice the bound the vocabulary gives: normalizers (NFC and the like) may fold a few characters into one.
        return 2 * self.max_model_len * self.tokenizer.max_token_chars

    def _check_chars(self, chars: int, what: str) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(
                f"{what} has {chars} characters: more than max_model_len={self.max_model_len} tokens can hold (at "
                f"most {self.max_prompt_chars} characters here); shorten the prompt"
            )

    def _check_tokens(self, n: int) -> None:
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len} (the prompt and at "
                "least one new token must fit): shorten the prompt"
            )

    def add_request(self, request_id: str, prompt=None, params: SamplingParams | None = None, *, messages=None) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params, messages=messages)
        self.submit(seq)
        return seq

    def submit(self, seq: Sequence, detok: IncrementalDetokenizer | None = None) -> None:
        """Queue a sequence made by `make_sequence`; it joins the batch at the next step. `detok`: the one
        `first_output` made, for a sequence whose first token a prefill pod sampled (it is prefilled here after
        all, with that token)."""
        with self._pending_lock:
            self._pending_adds += 1
        self._pending.put(("add", (seq, detok)))

    # ---- disaggregation (kv_transfer/): the step loop owns the block manager, so these are queued too ------
    def first_output(self, seq: Sequence, token: int, logprob=None) -> tuple[RequestOutput, IncrementalDetokenizer]:
        """Decode side: append the first token a prefill pod sampled and say it as the step loop would (its text,
        whether it ends the request). Any thread: it touches only `seq`, which no step has seen yet."""
        detok = IncrementalDetokenizer(self.tokenizer, list(seq.params.stop), seq.prompt_token_ids)
        seq.output_token_ids.append(token)
        seq.num_new_tokens = 1
        text, hit_stop = detok.add(token)
        reason = FinishReason.STOP if hit_stop else self.scheduler.stop_reason(seq, token)
        if reason is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            text += detok.flush()
        lps = [TokenLogprob(token, logprob[0], logprob[1])] if logprob is not None else []
        return self._output(seq, [token], text, lps), detok

    def reserve_prefilled(self, seq: Sequence) -> Future:
        """Decode side: blocks for every prompt token of `seq` (its cached prefix shared, fresh blocks for the
        rest, which the transfer fills). The future's result: True, or False when the pool or the running
        sequences are full (then it is prefilled here instead)."""
        fut: Future = Future()
        self._pending.put(("reserve", (seq, fut)))
        return fut

    def admit_prefilled(self, seq: Sequence, detok: IncrementalDetokenizer,
                        on_admitted: Callable[[], None] | None = None) -> None:
        """Decode side: the reserved blocks hold the verified K/V of the whole prompt: `seq` decodes from the next
        step on. `on_admitted`: called on the step loop's thread as it joins the batch, before that step computes
        (--first-token with-kv sends the first token there, so the gap to the second is that one step)."""
        self._pending.put(("admit", (seq, detok, on_admitted)))

    def cancel_reserved(self, seq: Sequence) -> None:
        """Decode side: give back what `reserve_prefilled` took (the transfer failed or the client left); the
        blocks were never named in the prefix cache, so nothing unverified can be found by another prompt."""
        self._pending.put(("cancel", seq))

    def release_held(self, blocks: list[int]) -> None:
        """Prefill side: a lease ended; its blocks go back to the pool."""
        self._pending.put(("release", blocks))

    def drop_held(self, seq: Sequence) -> None:
        """Prefill side: nobody will lease what `seq` holds (its caller left): queued after the abort, so by then
        the sequence was either aborted (its blocks freed) or finished holding them (released here)."""
        self._pending.put(("drop", seq))

    @property
    def kv_pool(self) -> torch.Tensor:
        """The KV pool tensor, which a KV transport registers (kv_transfer/)."""
        return self.kv_cache.tensor

    @property
    def cache_shape(self) -> CacheShape:
        """The KV cache as the endpoint picker and dashboards read it (chunkpilot:cache_config_info)."""
        return self.block_manager.cache_shape

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many of the prompt's tokens this engine's prefix cache holds now. Any thread: the lookup only reads
        the cache's table, and an answer a step makes stale only moves a routing choice, never correctness."""
        return len(self.block_manager.match_prefix(seq.prompt_token_ids, seq.cache_salt)) * self.config.block_size

    def kv_fingerprint(self) -> str:
        """What decides whether another engine's KV blocks are usable here: the model (its config and the
        weights files' headers and sizes), the dtype, quantization, block size, the pool's shape and the blocks'
        checksum."""
        import hashlib
        from pathlib import Path

        model = Path(self.config.model)
        weights = hashlib.sha256()
        for f in sorted(model.glob("*.safetensors")):
            # the header (names, shapes, dtypes) and 16 samples of 64 KiB spread over the values: a fine-tune of
            # the same architecture differs there, and reading them costs milliseconds however large the model
            size = f.stat().st_size
            weights.update(f.name.encode() + str(size).encode())
            with f.open("rb") as fh:
                head = fh.read(8)
                weights.update(fh.read(min(int.from_bytes(head, "little") if len(head) == 8 else 0, 1 << 24)))
                for i in range(16):
                    fh.seek(size * i // 16)
                    weights.update(fh.read(1 << 16))
        config = model / "config.json"
        return fingerprint({
            "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else None,
            "weights": weights.hexdigest(), "dtype": str(self.dtype), "block_size": self.config.block_size,
            "quantization": self.config.quantization,
            "pool": list(self.kv_pool.shape[:2]) + list(self.kv_pool.shape[3:]),
            "checksum": CHECKSUM,
        })

    @property
    def num_waiting(self) -> int:
        """Sequences that wait: submitted but not yet scheduled, or in the scheduler's waiting queue. Read from
        other threads for admission: each part is one atomic read, which is all admission needs."""
        return self._pending_adds + len(self.scheduler.waiting)

    def abort(self, request_id: str) -> None:
        self._pending.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._live) or not self._pending.empty()

    def stats(self) -> SchedulerStats:
        """The engine's state after the last step (call it from the thread that steps)."""
        bm = self.block_manager
        running = self.scheduler.running
        return SchedulerStats(self.last_step, len(running), len(self.scheduler.waiting), bm.usage,
                              bm.prefix_queries, bm.prefix_hits, self.scheduler.num_preemptions,
                              sum(1 for seq in running if seq.drafts_paused > 0),
                              self.scheduler.min_acceptance if self._row_cost is not None else 0.0)

    # ---- the step ---------------------------------------------------------------------------------------
    def _drain(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._pending.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                seq, detok = item
                with self._pending_lock:
                    self._pending_adds -= 1
                if seq.request_id in self._live:
                    raise ValueError(f"request id {seq.request_id!r} is already running")
                self.scheduler.add(seq)
                if detok is None:
                    detok = IncrementalDetokenizer(self.tokenizer, list(seq.params.stop), seq.prompt_token_ids)
                self._live[seq.request_id] = (seq, detok)
            elif kind == "reserve":
                seq, fut = item
                ok = self.scheduler.has_room and self.block_manager.allocate_prompt(seq, len(seq.prompt_token_ids))
                fut.set_result(bool(ok))
            elif kind == "admit":
                seq, detok, on_admitted = item
                seq.num_computed_tokens = len(seq.prompt_token_ids)
                self.scheduler.add_prefilled(seq)
                self._live[seq.request_id] = (seq, detok)
                if on_admitted is not None:
                    on_admitted()
            elif kind == "cancel":
                self.block_manager.free(item)
                item.num_cached_tokens = 0
            elif kind == "release":
                self.block_manager.release(item)
            elif kind == "drop" and item.held_blocks:
                self.block_manager.release(item.held_blocks)
                item.held_blocks = []
            elif kind == "abort" and item in self._live:
                seq, detok = self._live.pop(item)
                self.scheduler.abort(item)
                self.sampler.forget(item)
                outputs.append(self._output(seq, [], detok.flush(), []))

    def step(self) -> list[RequestOutput]:
        outputs = self._drain()
        sched = self.scheduler.schedule()
        t0 = time.perf_counter()
        now = time.monotonic()
        for chunk in sched.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = now
        result = self._execute(sched)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_step = StepStats(
            sched.num_tokens, sched.num_decodes, sched.num_prefill_tokens, time.perf_counter() - t0, sched.preempted,
            # a decode with k drafts is a decode and k token rows to the step-time model (step_cost)
            step_features((c.start, c.num_tokens, i < sched.num_decodes) for i, c in enumerate(sched.chunks)),
            **_draft_counts(sched, result),
        )
        self.scheduler.observe(sched, self.last_step.seconds)
        if self._row_cost is not None:
            self._draft_threshold(sched)
        for seq in self.scheduler.update(sched, result):
            outputs.append(self._advance(seq, result.logprobs.get(seq.request_id)))
        if self.proposer is not None:
            # after _advance: a stop string may have cut a sequence's tokens or finished it
            propose_drafts(self.scheduler, self.proposer)
        return outputs

    def _draft_threshold(self, sched) -> None:
        """Measure what drafts cost on decode-only steps and set the acceptance the scheduler's pause rule asks of
        this step's drafts: the break-even for its batch size, at least MIN_ACCEPTANCE (speculation/draft_cost.py)."""
        if sched.num_prefill_tokens == 0:  # drafts cost their rows and the proposer's time (a draft model's forwards)
            self._row_cost.add(sched.num_decodes, sched.num_draft_tokens, self.last_step.seconds + sched.draft_seconds)
        self.scheduler.min_acceptance = max(MIN_ACCEPTANCE, self._row_cost.break_even(sched.num_decodes))

    def _execute(self, sched):
        workers = self._workers
        if workers is None:
            return self.runner.execute(sched)
        if workers.failure:
            raise RankFailedError(workers.failure)
        try:
            with self._collective:
                try:
                    return self.runner.execute(sched)
                finally:
                    self._last_collective = time.monotonic()
        except BaseException as e:  # a collective failed or timed out (a rank is dead or hung), or rank 0 failed
            # mid-step (Ctrl-C included): the ranks are out of step with each other and only a restart brings them
            # back. On CUDA a hung rank may instead end the process from NCCL's own watchdog.
            workers.fail(f"a tensor-parallel collective failed ({e!r})")
            if not isinstance(e, Exception):
                raise
            raise RankFailedError(workers.failure) from e

    def _advance(self, seq: Sequence, logprob) -> RequestOutput:
        _, detok = self._live[seq.request_id]
        # one token, or a decode's verified drafts and the model's own token
        tokens = seq.output_token_ids[len(seq.output_token_ids) - seq.num_new_tokens :]
        text = ""
        for i, token in enumerate(tokens):
            piece, hit_stop = detok.add(token)
            text += piece
            if hit_stop:
                if i + 1 < len(tokens):  # a stop string ended inside the verified run: nothing after it counts
                    del seq.output_token_ids[len(seq.output_token_ids) - len(tokens) + i + 1 :]
                    tokens = tokens[: i + 1]
                self.scheduler.finish(seq, FinishReason.STOP)
                seq.finish_reason = FinishReason.STOP  # also when this token reached max_tokens: the text was cut
                break
        if seq.is_finished:
            text += detok.flush()
            del self._live[seq.request_id]
            self.sampler.forget(seq.request_id)
        lps = [TokenLogprob(tokens[-1], logprob[0], logprob[1])] if logprob is not None else []
        return self._output(seq, tokens, text, lps)

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], text: str, lps: list[TokenLogprob]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            new_logprobs=lps,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            held_blocks=list(seq.held_blocks) if seq.is_finished else [],
        )


def _draft_counts(sched, result) -> dict:
    """The step's speculative-decoding counts for StepStats: drafts proposed and kept, per position."""
    proposed = [c for c in sched.chunks if c.draft_token_ids]
    if not proposed:
        return {}
    kept = [len(result.verified[c.seq.request_id]) - 1 for c in proposed if c.seq.request_id in result.verified]
    longest = max(len(c.draft_token_ids) for c in proposed)
    return {"num_drafts": len(proposed), "num_draft_tokens": sum(len(c.draft_token_ids) for c in proposed),
            "num_accepted_tokens": sum(kept),
            "accepted_per_position": tuple(sum(1 for k in kept if k > p) for p in range(longest))}


def _keepalive(engine_ref, period: float) -> None:
    """While no step runs, tell the workers every `period` (a quarter of the timeout) that rank 0 is alive: their
    wait for a plan has the group's timeout, and a worker that hung meanwhile times this broadcast out."""
    eng = engine_ref()
    if eng is None:
        return
    workers, group, lock, stop = eng._workers, eng.group, eng._collective, eng._keepalive_stop
    del eng  # only a weak reference between rounds
    while not stop.wait(period / 2):
        eng = engine_ref()
        if eng is None:
            return
        due = time.monotonic() - eng._last_collective >= period
        del eng
        if not due:
            continue
        with lock:
            if stop.is_set() or workers.stopped:
                return
            try:
                group.broadcast(KEEPALIVE)
            except Exception as e:  # noqa: BLE001 - a dead or hung rank
                workers.fail(f"a tensor-parallel keep-alive failed ({e!r})")
                return
            eng = engine_ref()
            if eng is not None:
                eng._last_collective = time.monotonic()
            del eng


def _stop_workers(workers: WorkerProcesses | None, group: TPGroup, force: bool, keepalive_stop: threading.Event,
                  lock: threading.Lock) -> None:
    """Stop the workers (the stop plan, then wait; or kill them), reap them and leave the process group, whatever
    state a failure left them in. Idempotent."""
    if workers is None:
        return
    keepalive_stop.set()
    # a keep-alive in flight finishes first (a step may still hold the lock when forced: then do not wait for it)
    locked = lock.acquire(timeout=0 if force else 30)
    try:
        _stop_locked(workers, group, force or not locked)
    finally:
        if locked:
            lock.release()


def _stop_locked(workers: WorkerProcesses, group: TPGroup, force: bool) -> None:
    if not workers.reaped:
        if force or workers.stopped or workers.failure:  # killed, or already stopping: nobody listens for plans
            workers.kill()
        else:
            workers.begin_stop()  # the watchdog must not take the workers' clean exits for failures
            try:
                group.broadcast(None)
            except Exception:  # a rank already gone: kill the rest
                workers.kill()
            workers.stop()
    group.close()
