"""The engine on a virtual clock: the real Scheduler and BlockManager, a fitted step-time cost model instead of
the model, the load generator's workloads as arrivals, the load generator's records and statistics as output.

Because the scheduler is the real one, the simulator makes the same decisions the engine makes for a knob
setting (which decodes run, how prompts are chunked, when KV runs out and who is preempted); only the step time is
predicted. A knob change lands at the next step boundary, as in the engine."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from chunkpilot.contract import step_cost
from chunkpilot.contract.slo import DEFAULT_QUANTILE, SLOClass, SLOClasses, SLOTargets
from chunkpilot.engine.core.block_manager import BlockManager
from chunkpilot.engine.core.knobs import KnobHolder, SchedulerKnobs
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.core.scheduler import RunnerOutput, Scheduler, SchedulerConfig
from chunkpilot.engine.core.sequence import Sequence
from chunkpilot.engine.speculation.proposers import propose_drafts
from chunkpilot.loadgen.stats import RequestRecord, meets
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.tuner.measurement import Window, class_windows
from chunkpilot.tuner.predictor import Load, imbalance_of, prompts_from_buckets
from chunkpilot.sim.costmodel import StepCost
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.step_model import StepModel, fit_moments

# Prompt-length buckets for the simulator's load, so that it reads a histogram as the tuner reads Prometheus's: a
# doubling layout. (The engine's own request_prompt_tokens buckets are vLLM's 1-2-5 layout, coarser still; the
# published simulator figures were made with these, so they stay until the next benchmark run.)
PROMPT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, float("inf"))


@dataclass(frozen=True)
class SimSpeculation:
    """Speculative decoding in the simulator: every decode the scheduler lets draft gets k drafts, and each is kept
    with probability `acceptance` while the ones before it were (the first rejection ends the run), as a
    proposer whose per-position acceptance is that rate. The real scheduler places, verifies, pauses and gives
    back blocks as in the engine; only which drafts are kept is drawn."""

    num_speculative_tokens: int = 2
    acceptance: float = 0.6
    seed: int = 0

    def proposer(self):
        return _FixedDrafts(self.num_speculative_tokens)


class _FixedDrafts:
    def __init__(self, k: int) -> None:
        self.k = k

    def propose_batch(self, requests):
        return [[7] * min(self.k, room) for _, room in requests]  # the ids do not matter: acceptance is drawn


class Simulator:
    def __init__(self, cost: StepCost, requests: list[RequestSpec], knobs: Knobs, *, block_size: int = 16,
                 num_blocks: int = 8192, max_num_seqs: int = 64, max_model_len: int = 16384,
                 speculative: SimSpeculation | None = None, classes: SLOClasses | None = None,
                 class_of: Mapping[str, str] | None = None) -> None:
        """`classes`: per-request SLO classes, each request's by its kind (`class_of`, else the default class)."""
        self.cost = cost
        self.classes = classes
        self.class_of = dict(class_of or {})
        self.holder = KnobHolder(SchedulerKnobs(knobs.token_budget, knobs.max_chunk, 0), min_token_budget=1)
        self.speculative = speculative
        self._accept_rng = random.Random(speculative.seed if speculative else 0)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                   classes=classes),
                                   BlockManager(num_blocks, block_size, enable_prefix_caching=False), self.holder,
                                   speculative.num_speculative_tokens if speculative else 0,
                                   now=lambda: self.now)
        self.proposer = speculative.proposer() if speculative else None
        self.now = 0.0
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))
        self.records: list[RequestRecord] = []
        self.arrivals: list[tuple[float, int, int]] = []  # (time, prompt tokens, max tokens)
        self._live: dict[str, RequestRecord] = {}
        self._ids = 0
        self.steps = 0
        # (end, seconds, prompt tokens) of steps that computed prompt tokens: the engine's prefill_busy counters
        self.prefill_busy: list[tuple[float, float, int]] = []
        # (end, the engine's step-cost features..., seconds) of every step: what the engine's step-cost counters
        # sum, so the tuner's model is fitted from the simulator's steps the way it is from Prometheus
        self.step_log: list[tuple[float, ...]] = []
        # (end, decodes with drafts, draft tokens) of every step: the engine's spec_decode counters
        self.draft_log: list[tuple[float, int, int]] = []

    # -- knobs --------------------------------------------------------------------------------------------
    @property
    def knobs(self) -> Knobs:
        k = self.holder.get()
        return Knobs(k.token_budget, k.max_chunk)

    @property
    def generation(self) -> int:
        return self.holder.get().generation

    def set_knobs(self, knobs: Knobs) -> int:
        gen = self.generation + 1
        self.holder.set(SchedulerKnobs(knobs.token_budget, knobs.max_chunk, gen))
        return gen

    # -- time ---------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.pending and self.pending[0].arrival <= self.now:
            spec = self.pending.popleft()
            prompt = spec.prompt if isinstance(spec.prompt, list) else [1] * max(1, spec.prompt_tokens)
            self._ids += 1
            rid = f"sim-{self._ids}"
            seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=spec.max_tokens, temperature=0.0,
                                                             ignore_eos=True),
                           arrival_time=self.now, slo_class=self._class_of(spec.kind))
            self.scheduler.add(seq)
            rec = RequestRecord(kind=spec.kind, prompt_tokens=len(prompt), start=spec.arrival)
            self._live[rid] = rec
            self.records.append(rec)
            self.arrivals.append((spec.arrival, len(prompt), spec.max_tokens))

    def class_name(self, kind: str) -> str | None:
        """The SLO class a request of this kind is served in (None without classes)."""
        c = self._class_of(kind)
        return None if c is None else c.name

    def _class_of(self, kind: str) -> SLOClass | None:
        if self.classes is None:
            return None
        return self.classes.get(self.class_of.get(kind, self.classes.default))

    def _next_event(self) -> float | None:
        """When an idle engine has something to do next: the next arrival. (An engine that also takes events
        from other engines, sim/split.py's decode engine, wakes for those too.)"""
        return self.pending[0].arrival if self.pending else None

    def _stolen(self, base: float) -> float:
        """Seconds the next step, which takes `base` seconds alone, loses to work beside the step loop on the same
        cores (none here; the decode engine's KV pulls in sim/split.py)."""
        return 0.0

    def advance(self, until: float) -> None:
        """Run steps until the virtual clock reaches `until` (a step in flight then may end a little after)."""
        while self.now < until:
            self._admit()
            if not self.scheduler.has_work:
                wake = self._next_event()
                self.now = min(until, wake) if wake is not None else until
                continue
            out = self.scheduler.schedule()
            if out.is_empty:  # everything waits for KV blocks that only arrivals cannot free: let time pass
                wake = self._next_event()
                self.now = min(until, wake) if wake is not None else until
                continue
            # a decode with k drafts: a decode and k token rows, costed and counted as the engine counts it
            chunks = [(c.start, c.num_tokens, i < out.num_decodes) for i, c in enumerate(out.chunks)]
            base = self.cost.step_seconds(chunks)
            seconds = base + self._stolen(base)
            self.now += seconds
            self.steps += 1
            self.scheduler.observe(out, seconds)
            self.step_log.append((self.now, *step_cost.step_features(chunks), seconds))
            if out.num_prefill_tokens:
                self.prefill_busy.append((self.now, seconds, out.num_prefill_tokens))
            if self.speculative is not None:
                self.draft_log.append((self.now, sum(1 for c in out.chunks if c.draft_token_ids),
                                       out.num_draft_tokens))
            sampled, verified = {}, {}
            for c in out.chunks:
                own = 1000 + (c.start % 1000)
                if c.draft_token_ids:
                    verified[c.seq.request_id] = self._kept(c.draft_token_ids) + [own]
                elif c.samples:
                    sampled[c.seq.request_id] = own
            for seq in self.scheduler.update(out, RunnerOutput(sampled=sampled, verified=verified)):
                rec = self._live.get(seq.request_id)
                if rec is None:
                    continue
                if rec.first_token is None:
                    rec.first_token = self.now
                rec.token_times.append(self.now)  # one gap a step, however many tokens (the engine's ITL too)
                rec.output_tokens += seq.num_new_tokens
                if seq.is_finished:
                    rec.end = self.now
                    del self._live[seq.request_id]
            if self.proposer is not None:  # as the engine: drafts for the next step, guessed after this one
                propose_drafts(self.scheduler, self.proposer)

    def _kept(self, drafts: list[int]) -> list[int]:
        rng, p = self._accept_rng, self.speculative.acceptance
        n = 0
        while n < len(drafts) and rng.random() < p:
            n += 1
        return drafts[:n]

    def run(self, until: float | None = None) -> list[RequestRecord]:
        """Run to `until`, or until every request has finished."""
        if until is not None:
            self.advance(until)
        else:
            while self.pending or self.scheduler.has_work:
                self.advance(self.now + 60.0)
        return self.records

    # -- measurement ----------------------------------------------------------------------------------------
    @property
    def in_system(self) -> int:
        """Requests arrived and not finished (what a least-loaded balancer counts)."""
        return len(self._live) + len(self.pending)

    def window(self, seconds: float, slo: SLOTargets) -> Window:
        return window_over([self], self.now, seconds, slo)

    def load(self, seconds: float) -> Load:
        return load_over([self], self.now, seconds)

    def step_model(self, seconds: float) -> StepModel | None:
        return model_over([self], self.now, seconds)

    def context(self, seconds: float):
        """The step-time model fitted on the window's steps and the window's load (one pod)."""
        from chunkpilot.tuner.guide import Context

        load, model = self.load(seconds), self.step_model(seconds)
        if not load.prompts or model is None:
            return None
        return Context(model=model, load=load, pods=1)


def window_over(sims: list[Simulator], now: float, seconds: float, slo: SLOTargets) -> Window:
    """The window of `seconds` ending `now` over these engines, measured the way Prometheus sees them: TTFT of
    first tokens and every token gap inside the window, requests that finished inside it, the prefill capacity
    per busy second times the engines that were busy."""
    t1, t0 = now, now - seconds
    records = [r for s in sims for r in s.records]
    arrivals = [a for s in sims for a in s.arrivals]
    done = [r for r in records if r.end is not None and t0 < r.end <= t1]
    ttfts = [r.ttft for r in records if r.first_token is not None and t0 < r.first_token <= t1]
    gaps = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:]) if t0 < b <= t1]
    tokens = sum(1 for r in records for t in r.token_times if t0 < t <= t1)
    arrived = [(p, o) for t, p, o in arrivals if t0 < t <= t1]
    # requests in the system at t = arrived by t - finished by t
    in_system = [sum(1 for t, _, _ in arrivals if t <= at) - sum(1 for r in records if r.end is not None and r.end <= at)
                 for at in (t0, t1)]
    q_ttft = slo.ttft.quantile if slo.ttft else DEFAULT_QUANTILE
    q_itl = slo.itl.quantile if slo.itl else DEFAULT_QUANTILE
    busy = [[b for b in s.prefill_busy if t0 < b[0] <= t1] for s in sims]
    busy_pods = sum(1 for b in busy if b)
    flat = [b for bs in busy for b in bs]
    classes, goodput = (), sum(1 for r in done if meets(r, slo)) / seconds
    if sims[0].classes is not None:  # as the engines count them: each class at its own SLOs, spec.slo on the default
        classes = _class_windows(sims[0], records, t0, t1)
        goodput = sum(c.met for c in classes) / seconds
        default = [r for r in records if sims[0].class_name(r.kind) == sims[0].classes.default]
        ttfts = [r.ttft for r in default if r.first_token is not None and t0 < r.first_token <= t1]
        gaps = [b - a for r in default for a, b in zip(r.token_times, r.token_times[1:]) if t0 < b <= t1]
    return Window(
        seconds=seconds, requests=len(done), request_rate=len(arrived) / seconds,
        output_tokens_per_s=tokens / seconds, goodput=goodput, classes=classes,
        ttft=float(np.quantile(ttfts, q_ttft)) if ttfts else None,
        itl=float(np.quantile(gaps, q_itl)) if gaps else None,
        mean_prompt_tokens=float(np.mean([p for p, _ in arrived])) if arrived else 0.0,
        mean_output_tokens=float(np.mean([o for _, o in arrived])) if arrived else 0.0,
        backlog_growth=(in_system[1] - in_system[0]) / seconds,
        prefill_capacity=sum(n for _, _, n in flat) / sum(d for _, d, _ in flat) * busy_pods if flat else None,
        pods=max(1, len(sims)),
    )


def _class_windows(sim: Simulator, records: list[RequestRecord], t0: float, t1: float):
    measured = {}
    for c in sim.classes.classes:
        mine = [r for r in records if sim.class_name(r.kind) == c.name]
        done = [r for r in mine if r.end is not None and t0 < r.end <= t1]
        ttfts = [r.ttft for r in mine if r.first_token is not None and t0 < r.first_token <= t1]
        gaps = [b - a for r in mine for a, b in zip(r.token_times, r.token_times[1:]) if t0 < b <= t1]
        q_ttft = c.slo.ttft.quantile if c.slo.ttft else DEFAULT_QUANTILE
        q_itl = c.slo.itl.quantile if c.slo.itl else DEFAULT_QUANTILE
        measured[c.name] = dict(finished=float(len(done)), met=float(sum(1 for r in done if meets(r, c.slo))),
                                ttft=float(np.quantile(ttfts, q_ttft)) if ttfts else None,
                                itl=float(np.quantile(gaps, q_itl)) if gaps else None)
    return class_windows(sim.classes, measured)


def load_over(sims: list[Simulator], now: float, seconds: float, pods: int | None = None) -> Load:
    """The predictor's view of the window of `seconds` ending `now`, per serving engine, as Prometheus gives it: arrivals,
    their prompt mix in histogram buckets, and the decodes in flight on average (as far back as the run goes)."""
    seconds = max(1e-9, min(seconds, now))
    t1, t0 = now, now - seconds
    pods = max(1, len(sims) if pods is None else pods)  # the load is spread over the pods that serve it
    records = [r for s in sims for r in s.records]
    decoding = sum(max(0.0, min(r.end or t1, t1) - max(r.first_token, t0)) for r in records
                   if r.first_token is not None and r.first_token < t1 and (r.end or t1) > t0) / seconds
    arrived = [p for s in sims for a, p, _ in s.arrivals if t0 < a <= t1]
    cumulative = {le: float(sum(1 for p in arrived if p <= le)) for le in PROMPT_BUCKETS}
    steps = sum(1 for s in sims for r in s.step_log[-20000:] if r[0] > t0)
    drafts = [(n, k) for s in sims for t, n, k in s.draft_log[-20000:] if t > t0]
    per_pod = [float(sum(1 for a, _, _ in s.arrivals if t0 < a <= t1)) for s in sims]
    return Load(request_rate=len(arrived) / seconds / pods, imbalance=imbalance_of(per_pod, pods),
                prompts=prompts_from_buckets(cumulative, float(np.mean(arrived)) if arrived else None),
                running=decoding / pods,
                drafting=sum(n for n, _ in drafts) / steps if steps else 0.0,
                draft_tokens=sum(k for _, k in drafts) / steps if steps else 0.0)


def model_over(sims: list[Simulator], now: float, seconds: float) -> StepModel | None:
    """The step-time model fitted on the steps that ended in the last `seconds` on these engines (as the tuner fits
    it from the engines' counters)."""
    t0 = now - seconds
    rows = np.array([r[1:] for s in sims for r in s.step_log[-20000:] if r[0] > t0])
    if len(rows) == 0:
        return None
    return fit_moments(step_cost.terms_of(rows.T @ rows))


class SimMeasurer:
    """Measurer for TunerLoop on a Simulator, or on a fleet of them (sim/fleet.py: the same methods)."""

    def __init__(self, sim: Simulator, slo: SLOTargets) -> None:
        self.sim, self.slo = sim, slo

    def check(self) -> None:
        pass

    def wait(self, seconds: float) -> None:
        self.sim.advance(self.sim.now + seconds)

    def measure(self, seconds: float) -> Window:
        return self.sim.window(seconds, self.slo)

    def context(self, seconds: float):
        return self.sim.context(seconds)


class SimActuator:
    """Actuator for TunerLoop on a Simulator or a fleet (both hold knobs and a generation)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def apply(self, knobs: Knobs) -> int:
        return self.sim.set_knobs(knobs)

    def applied(self, generation: int) -> bool:
        return self.sim.generation >= generation

    def current(self) -> Knobs:
        return self.sim.knobs
