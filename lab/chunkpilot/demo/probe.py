"""The demo's probe: steps of deliberately varied composition, so that the step-time fit identifies every term.

At its start-up knobs (2048, unchunked) an engine's steps are all alike: large prefill steps and a few decode steps
at one or two sequences. Such steps cannot tell a per-step cost from a per-sequence or a per-token one, yet at
32-token chunks the per-step cost is most of a step, so every prediction for the small knobs the demo depends on
would rest on a term the data never pinned down. The probe drives the tuned group's engines, through the knobs
file the tuner uses, through:

* decode-only steps at 1, 4 and max-num-seqs sequences (short prompts, longer outputs, all sent at once);
* prefill steps at 32-, 128- and 512-token chunks (one long prompt each, the knobs set to that chunk);
* unchunked prefill steps above the 512-token hinge: one long prompt a step, and one step of four short prompts
  with as many tokens (as many tokens over the hinge, a quarter of the keys read).

It fits after every round over everything the probe has run and repeats the stages that vary the terms still
open until every term is identified or negligible (chunkpilot.tuner.step_model), or MAX_ROUNDS have run. The plan is data (`designed_stages`), so a
test runs the same plan on the simulator with a cost whose coefficients it knows."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark_async
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.tuner import Knobs, StepModel, reference_steps

log = logging.getLogger(__name__)

DECODE_BATCHES = (1, 4)  # and max-num-seqs
DECODE_TOKENS = 32  # outputs of the decode stages: the steps after the first are decode-only
CHUNKS = (32, 128, 512)
LONG_PROMPT = 1024  # the chunked stages' prompt: 32 steps at 32-token chunks, 2 at 512
UNCHUNKED = (1024, 1536)  # above the 512-token hinge, one prompt a step
TOGETHER = 4  # prompts of UNCHUNKED[-1] / TOGETHER tokens in one step
MAX_ROUNDS = 4
# What each kind of stage varies: a round after the first repeats only the stages that vary a term still open.
DECODE_TERMS = frozenset({"overhead", "decode_seqs"})
CHUNK_TERMS = frozenset({"overhead", "prefill_tokens", "kv_kilotokens"})
UNCHUNKED_TERMS = frozenset({"prefill_tokens", "kv_kilotokens", "tokens_over_512", "tokens_over_2048"})


@dataclass(frozen=True)
class Stage:
    """Requests sent at once (at most `concurrency` in flight) while the engines run `knobs`."""

    what: str
    knobs: Knobs
    requests: tuple[RequestSpec, ...]
    concurrency: int
    informs: frozenset[str] = frozenset()  # the terms whose coefficients these steps vary (empty: all)


def _prompt(tokens: int, salt: int) -> list[int]:
    """A prompt of exactly `tokens` ids, different for every request (no prefix is shared)."""
    return [1000 + (salt * 7919 + i * 31) % 40000 for i in range(tokens)]


def designed_stages(max_num_seqs: int, start: Knobs, round_: int = 0) -> list[Stage]:
    stages, salt = [], 1000 * round_
    for b in (*DECODE_BATCHES, max_num_seqs):
        reqs = tuple(RequestSpec("decode", _prompt(16, salt + i), DECODE_TOKENS, 0.0, 16) for i in range(b))
        stages.append(Stage(f"decode x{b}", start, reqs, b, DECODE_TERMS))
        salt += b
    for c in CHUNKS:
        stages.append(Stage(f"chunks of {c}", Knobs(c, c),
                            (RequestSpec("prefill", _prompt(LONG_PROMPT, salt), 1, 0.0, LONG_PROMPT),), 1,
                            CHUNK_TERMS))
        salt += 1
    reqs = tuple(RequestSpec("prefill", _prompt(n, salt + i), 1, 0.0, n) for i, n in enumerate(UNCHUNKED))
    stages.append(Stage("unchunked", start, reqs, 1, UNCHUNKED_TERMS))
    salt += len(UNCHUNKED)
    # The same step size from several short prompts at once: as many tokens over the hinge, a fraction of the keys
    # read (each prompt attends only to itself), which is what tells the hinge from the KV term.
    n = UNCHUNKED[-1] // TOGETHER
    reqs = tuple(RequestSpec("prefill", _prompt(n, salt + i), 1, 0.0, n) for i in range(TOGETHER))
    stages.append(Stage(f"unchunked, {TOGETHER} at once", start, reqs, TOGETHER, UNCHUNKED_TERMS))
    return stages


def startup_stages(max_num_seqs: int, start: Knobs, round_: int = 0) -> list[Stage]:
    """What the demo probed before this design: chat and long prompts mixed, every step at the start-up knobs."""
    salt = 1000 * round_ + 500
    reqs = tuple(RequestSpec("chat" if i % 2 else "rag", _prompt(n, salt + i), out, 0.0, n)
                 for i, (n, out) in enumerate(((40, 16), (700, 4), (64, 24), (900, 4), (32, 20), (512, 6),
                                               (80, 12), (1000, 4))))
    return [Stage("start-up knobs", start, reqs, 4)]


def identified(model: StepModel | None, max_tokens: int, decodes: int) -> bool:
    return model is not None and not model.unidentified(reference_steps(max_tokens, decodes))


def describe(model: StepModel, max_tokens: int, decodes: int) -> str:
    """One line per term: value, interval, status."""
    units = {"overhead": ("ms per step", 1e3), "prefill_tokens": ("ms per prompt token", 1e3),
             "decode_seqs": ("ms per decode", 1e3), "kv_kilotokens": ("ms per 1k keys read", 1e3),
             "tokens_over_512": ("ms per token over 512", 1e3), "tokens_over_2048": ("ms per token over 2048", 1e3)}
    parts = []
    for f, t in model.identification(reference_steps(max_tokens, decodes)).items():
        unit, k = units.get(f, (f, 1.0))
        hi = f"{k * t.high:.3g}" if t.high != float("inf") else "inf"
        parts.append(f"{k * t.coefficient:.3g} {unit} [{k * t.low:.3g}, {hi}] {t.status}")
    return "; ".join(parts)


class EngineProbe:
    """Runs stages on real engines: the knobs through `actuator` (the tuner's own FileActuator), the requests
    through the load generator, the fit from Prometheus over everything run since `started`."""

    def __init__(self, urls: list[str], actuator, fit, apply_timeout: float = 30.0,
                 stop: threading.Event | None = None) -> None:
        self.urls, self.actuator, self.fit = urls, actuator, fit  # fit(seconds) -> StepModel | None
        self.apply_timeout = apply_timeout
        self.stop = stop or threading.Event()
        self.started = time.monotonic()

    def apply(self, knobs: Knobs, force: bool = False) -> None:
        """Set the knobs and wait until every engine of the group runs them (`force`: even when stopping)."""
        if self.stop.is_set() and not force:
            raise InterruptedError("the demo is stopping")
        if self.actuator.current() == knobs:
            return
        generation = self.actuator.apply(knobs)
        deadline = time.monotonic() + self.apply_timeout
        while not self.actuator.applied(generation):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engines did not apply {knobs.token_budget}/{knobs.max_chunk} within "
                                   f"{self.apply_timeout:g} s")
            time.sleep(0.25)

    def run(self, stage: Stage) -> None:
        # raises when the demo is stopping (no stage starts after Ctrl-C), but a knobs-only stage still applies
        self.apply(stage.knobs, force=not stage.requests)
        if not stage.requests:
            return
        threads = [threading.Thread(target=lambda u=u: asyncio.run(run_benchmark_async(BenchmarkConfig(
            base_url=u, model="smollm2", requests=list(stage.requests), concurrency=stage.concurrency,
            progress=False, timeout=120))), daemon=True) for u in self.urls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def model(self) -> StepModel | None:
        time.sleep(2.5)  # 1-s scrapes: the last steps reach Prometheus
        return self.fit(time.monotonic() - self.started + 2)


def probe(runner, max_num_seqs: int, start: Knobs, max_tokens: int, say=print,
          stages=designed_stages, max_rounds: int = MAX_ROUNDS) -> tuple[StepModel | None, int]:
    """Rounds of `stages` on `runner` (EngineProbe, or the tests' simulator) until the fit identifies every term
    (or `max_rounds`); the fit and the rounds run. The engines are left at `start`."""
    model, rounds, open_ = None, 0, None
    try:
        for rounds in range(1, max_rounds + 1):
            for stage in stages(max_num_seqs, start, rounds - 1):
                if open_ is None or not stage.informs or stage.informs & open_:
                    t0 = time.monotonic()
                    runner.run(stage)
                    log.info("probe round %d, %s: %.1f s", rounds, stage.what, time.monotonic() - t0)
            model = runner.model()
            if identified(model, max_tokens, max_num_seqs):
                break
            if model is not None and rounds < max_rounds:
                open_ = set(model.unidentified(reference_steps(max_tokens, max_num_seqs)))
                say(f"probe round {rounds}: {', '.join(sorted(open_))} not identified yet: another round of the "
                    "stages that vary them")
    finally:
        runner.run(Stage("back to start", start, (), 1))
    return model, rounds

