"""Prefill/decode disaggregation on the virtual clock: P prefill engines and D decode engines, each a Simulator (the
real scheduler, a step cost), and between them what kv_transfer/decode_side.py does for a request:

1. Route, at arrival: the balancer picks a decode engine. A prompt with more uncached tokens than the threshold
   goes to a prefill engine that is not saturated (kv_transfer.peers.choose itself: power of two choices on
   waiting requests, saturated above `prefill_max_waiting`); the others, or all when every prefill engine is
   saturated, are prefilled on the decode engine in chunks under its knobs, as colocated. The simulator models
   no prefix cache, so every prompt token counts as uncached.
2. The prefill engine computes the prompt alone (max_tokens 1, its own knobs and queue) and samples the first
   token at the end of that step. Under the decode engine's `--first-token early` the client has it then (the
   gap to the second token holds the pull); under `with-kv` it is held until the blocks join the batch at a step
   boundary and sent then (LLMEngine.admit_prefilled's on_admitted), so TTFT holds the pull and the first gap is
   the decode step the blocks join. A fallback sends it as the local prefill is queued.
3. At the decode engine's next step boundary blocks are reserved (no room: the prompt is prefilled there after
   all, with the first token, as the engine's `no_room` fallback); the pull (read + checksums, sim/transfer.py)
   runs on a thread for its seconds, and its blocks join the batch at the first step boundary after it ends.
   The steps the pull overlaps lose its CPU time times the cost's `step_loop_share` (charged to the first step).
   Queuing the reserve wakes an idle decode engine's step loop (RemotePrefill.pull's `wake`), so an idle engine
   reserves at once.

Not modelled: the 0.5 s staleness of the prefill engines' polled load (the router sees their queues as they
are), HTTP round trips, the prefill engine's held blocks (freed at once here), a prefill engine failing mid-call.
A threshold of math.inf routes nothing: the decode engines then run exactly as colocated engines do (a test
holds it to the plain Simulator)."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from chunkpilot.contract.engine_settings import FIRST_TOKEN_MODES
from chunkpilot.contract.engine_settings import default as setting_default
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.sequence import Sequence
from chunkpilot.engine.kv_transfer.peers import Peer, choose
from chunkpilot.engine.kv_transfer.wire import PeerLoad
from chunkpilot.loadgen.stats import RequestRecord
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.sim import transfer as transfer_cost
from chunkpilot.sim.costmodel import StepCost
from chunkpilot.sim.fleet import BALANCERS
from chunkpilot.sim.simulator import Simulator
from chunkpilot.sim.transfer import TransferCost
from chunkpilot.tuner.space import Knobs

FIRST_TOKEN = 1000  # the token id the prefill engine "samples" (the simulator's ids carry no meaning)


def prompt_of(spec: RequestSpec) -> list[int]:
    """The prompt's token ids, as Simulator admits it (a length alone becomes that many ids)."""
    return spec.prompt if isinstance(spec.prompt, list) else [1] * max(1, spec.prompt_tokens)


class DecodeEngine(Simulator):
    """A Simulator that also serves requests whose prompt a prefill engine computes. Their events (first token
    came, pull ended, prefill here after all) are handled at the first step boundary at or after their time, as
    the engine's step loop drains its queue of reserve/admit/add messages before each step."""

    def __init__(self, cost: StepCost, knobs: Knobs, transfer: TransferCost, first_token: str = "early",
                 pull_share: float = setting_default("pull_share"), **sim_options) -> None:
        super().__init__(cost, [], knobs, **sim_options)
        if first_token not in FIRST_TOKEN_MODES:
            raise ValueError(f"first_token must be one of {', '.join(FIRST_TOKEN_MODES)}, got {first_token!r}")
        if not 0 < pull_share <= 1:
            raise ValueError(f"pull_share must be in (0, 1], got {pull_share}")
        self.transfer = transfer
        # the engine's --pull-share (kv_transfer/pacing.py): a pull of c seconds of work lasts c / share, and a step
        # beside it loses at most share / (1 - share) of its own time to it; 1: read whole, its time all at once
        self.pull_share = pull_share
        self.with_kv = first_token == "with-kv"  # the engine's --first-token: hold it until the blocks are here
        self._held: set[str] = set()  # requests whose first token the client does not have yet
        self._events: list[tuple[float, int, str, str]] = []  # heap of (time, order, kind, request id)
        self._order = itertools.count()
        self._remote: dict[str, Sequence] = {}  # sent away, not yet in this engine's scheduler
        self._owed: list[list[float]] = []  # pulls in flight: [end, seconds of work the steps have still to lose]
        self.fallbacks: Counter[str] = Counter()  # the engine's remote_prefill_fallbacks_total reasons
        self.transfers: list[tuple[int, float]] = []  # (tokens pulled, seconds) of every pull

    # -- the decode engine's side of one remote prefill --------------------------------------------------
    def expect(self, spec: RequestSpec) -> str:
        """A request routed to a prefill engine at its arrival: the client's record starts now."""
        prompt = prompt_of(spec)
        self._ids += 1
        rid = f"sim-{self._ids}"
        self._remote[rid] = Sequence(rid, list(prompt), SamplingParams(max_tokens=spec.max_tokens, temperature=0.0,
                                                                       ignore_eos=True))
        rec = RequestRecord(kind=spec.kind, prompt_tokens=len(prompt), start=spec.arrival)
        self._live[rid] = rec
        self.records.append(rec)
        self.arrivals.append((spec.arrival, len(prompt), spec.max_tokens))
        return rid

    def first_token(self, rid: str, at: float) -> None:
        """The prefill engine sampled the first token at `at`; the pull begins. Early, the client has the token
        then; with-kv, it is held until the blocks are here (or the prompt falls back to a local prefill), except
        for a request that ends with it: no pull follows, so the engine sends it at once."""
        seq, rec = self._remote[rid], self._live[rid]
        seq.output_token_ids.append(FIRST_TOKEN)
        seq.num_new_tokens = 1
        if seq.params.max_tokens <= 1:  # done with its first token: the lease is released unread
            self._send(rid, at)
            rec.end = at
            del self._live[rid], self._remote[rid]
            return
        if self.with_kv:
            self._held.add(rid)
        else:
            self._send(rid, at)
        self._post(at, "reserve", rid)

    def _send(self, rid: str, at: float) -> None:
        """The client receives the first token at `at`."""
        rec = self._live[rid]
        rec.first_token = at
        rec.token_times.append(at)
        rec.output_tokens = 1

    def _send_held(self, rid: str, at: float) -> None:
        if rid in self._held:
            self._held.discard(rid)
            self._send(rid, at)

    def _post(self, at: float, kind: str, rid: str) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, rid))

    def _admit(self) -> None:
        super()._admit()
        due = []
        while self._events and self._events[0][0] <= self.now:
            due.append(heapq.heappop(self._events))
        self._handle(due)

    def _handle(self, due: list[tuple[float, int, str, str]]) -> None:
        for at, _, kind, rid in due:  # what is posted now waits for the next boundary, as in the engine
            seq = self._remote[rid]
            if kind == "reserve":
                self._reserve(seq)
            elif kind == "admit":
                # with-kv: the engine sends the held token as the blocks join the batch (this boundary), before
                # the step that makes the second token
                self._send_held(rid, self.now)
                seq.num_computed_tokens = len(seq.prompt_token_ids)
                self.scheduler.add_prefilled(seq)
                del self._remote[rid]
            else:  # "add": prefill here, the first token included (the engine's fallback path)
                self.scheduler.add(seq)
                del self._remote[rid]

    def _reserve(self, seq: Sequence) -> None:
        # as LLMEngine's "reserve": a running slot and blocks for every prompt token, or the no_room fallback
        n = len(seq.prompt_token_ids)
        if not (self.scheduler.has_room and self.scheduler.block_manager.allocate_prompt(seq, n)):
            self.fallbacks["no_room"] += 1
            self._send_held(seq.request_id, self.now)  # the local prefill goes on from the first token: it goes first
            self._post(self.now, "add", seq.request_id)
            return
        bs = self.scheduler.block_manager.block_size
        tokens = n - (seq.num_cached_tokens // bs) * bs  # only the blocks this engine's cache lacks move
        work = self.transfer.seconds(tokens, bs)
        seconds = work / self.pull_share
        self.transfers.append((tokens, seconds))
        self._owed.append([self.now + seconds, work * self.transfer.step_loop_share])
        self._post(self.now + seconds, "admit", seq.request_id)

    # -- the Simulator's hooks -----------------------------------------------------------------------------
    def _next_event(self) -> float | None:
        times = [super()._next_event()] + [t for t, _, _, _ in self._events]
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def _stolen(self, base: float) -> float:
        # pulls still running when this step starts take their CPU time from it, read whole all of what is left,
        # paced at most their share of the step's time; those that ended while the engine stood idle took nothing
        live = [p for p in self._owed if p[0] > self.now]
        cap = base * self.pull_share / (1 - self.pull_share) if self.pull_share < 1 else float("inf")
        lost = 0.0
        for p in live:
            take = min(p[1], cap)
            p[1] -= take
            lost += take
        self._owed = [p for p in live if p[1] > 0]
        return lost

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.scheduler.has_work or self._events or self._remote)


@dataclass
class SplitFleet:
    """`prefill` prefill engines and `decode` decode engines on one virtual clock; clients talk to the decode
    engines only (the balancer picks one per arrival, as a Service does)."""

    cost: StepCost  # both roles' step cost, unless prefill_cost is given
    requests: list[RequestSpec]
    decode_knobs: Knobs
    prefill_knobs: Knobs
    prefill: int = 1
    decode: int = 1
    threshold: float = 256  # uncached prompt tokens above which a prompt goes to a prefill engine; inf: never
    transfer: TransferCost = field(default_factory=transfer_cost.default)
    prefill_max_waiting: int = 8  # the engine's --prefill-max-waiting: saturated above it
    balancer: str = "round-robin"
    prefill_cost: StepCost | None = None
    first_token: str = "early"  # the decode engines' --first-token: early, or with-kv (see DecodeEngine)
    pull_share: float = setting_default("pull_share")  # the decode engines' --pull-share (see DecodeEngine)
    sim_options: dict = field(default_factory=dict)
    seed: int = 0  # the power-of-two choice's draws

    def __post_init__(self) -> None:
        if self.balancer not in BALANCERS:
            raise ValueError(f"balancer must be one of {', '.join(BALANCERS)}, got {self.balancer!r}")
        if self.decode < 1 or self.prefill < 0:
            raise ValueError(f"a split needs >= 1 decode and >= 0 prefill engines, got {self.decode}, {self.prefill}")
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0 (math.inf: never split), got {self.threshold}")
        self.now = 0.0
        self.pending = deque(sorted(self.requests, key=lambda r: r.arrival))
        self.decodes = [DecodeEngine(self.cost, self.decode_knobs, self.transfer, self.first_token, self.pull_share,
                                     **self.sim_options) for _ in range(self.decode)]
        self.prefills = [Simulator(self.prefill_cost or self.cost, [], self.prefill_knobs, **self.sim_options)
                         for _ in range(self.prefill)]
        # per prefill engine: the index of each request in its records -> (decode engine, request id there)
        self._awaiting: list[dict[int, tuple[DecodeEngine, str]]] = [{} for _ in self.prefills]
        self._sent = [0] * self.prefill
        self._rng = random.Random(self.seed)
        self._next = 0
        self.routed: Counter[str] = Counter()  # local (at or below the threshold), remote, saturated

    # -- routing ---------------------------------------------------------------------------------------------
    def _decode_for(self) -> DecodeEngine:
        if self.balancer == "round-robin":
            target = self.decodes[self._next % len(self.decodes)]
            self._next += 1
            return target
        return min(self.decodes, key=lambda d: d.in_system)

    def _prefill_for(self) -> int | None:
        peers = [Peer(str(i), PeerLoad(num_waiting=len(p.scheduler.waiting) + len(p.pending),
                                       num_running=len(p.scheduler.running), agent="", fingerprint=""))
                 for i, p in enumerate(self.prefills)]
        peer = choose(peers, self.prefill_max_waiting, self._rng)
        return None if peer is None else int(peer.url)

    def _route(self, spec: RequestSpec) -> None:
        target = self._decode_for()
        uncached = len(prompt_of(spec))  # no prefix cache in the simulator
        if uncached <= self.threshold or not self.prefills:
            self.routed["local"] += 1
            target.pending.append(spec)
            return
        i = self._prefill_for()
        if i is None:
            self.routed["saturated"] += 1
            target.pending.append(spec)
            return
        self.routed["remote"] += 1
        self._awaiting[i][self._sent[i]] = (target, target.expect(spec))
        self._sent[i] += 1
        self.prefills[i].pending.append(RequestSpec(spec.kind, spec.prompt, 1, spec.arrival, spec.prompt_tokens))

    # -- time ------------------------------------------------------------------------------------------------
    def _step_to(self, t: float) -> None:
        # prefill engines first: every first token they sample up to t is posted before a decode engine passes it
        for p in self.prefills:
            p.advance(t)
        for p, awaiting in zip(self.prefills, self._awaiting):
            for k in [k for k in awaiting if k < len(p.records) and p.records[k].first_token is not None]:
                decode, rid = awaiting.pop(k)
                decode.first_token(rid, p.records[k].first_token)
        for d in self.decodes:
            d.advance(t)
        self.now = t

    def advance(self, until: float) -> None:
        while self.pending and self.pending[0].arrival <= until:
            spec = self.pending.popleft()
            self._step_to(max(self.now, spec.arrival))
            self._route(spec)
        self._step_to(max(self.now, until))

    def run(self) -> list[RequestRecord]:
        while (self.pending or any(d.busy for d in self.decodes)
               or any(p.pending or p.scheduler.has_work for p in self.prefills)):
            self.advance(self.now + 60.0)
        return self.records()

    def records(self) -> list[RequestRecord]:
        """What the clients saw (the decode engines' records), in arrival order."""
        return sorted((r for d in self.decodes for r in d.records), key=lambda r: r.start)

    @property
    def fallbacks(self) -> Counter[str]:
        return sum((d.fallbacks for d in self.decodes), Counter())


def colocated(cost: StepCost, requests: list[RequestSpec], knobs: Knobs, engines: int = 1,
              **sim_options) -> list[RequestRecord]:
    """`engines` colocated engines behind a round robin (request i to engine i mod n): the split's baseline."""
    ordered, out = sorted(requests, key=lambda r: r.arrival), []
    for i in range(engines):
        out += Simulator(cost, ordered[i::engines], knobs, **sim_options).run()
    return sorted(out, key=lambda r: r.start)
