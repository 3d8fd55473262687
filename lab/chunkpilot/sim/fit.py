"""Fit the cost model on the real engine on this machine: run LLMEngine on a stream of mixed requests while the
knobs cycle through small and large budgets, time every whole step (schedule + forward + update, what a client's
inter-token gap is made of), and fit step time against the step's features."""

from __future__ import annotations

import itertools
import time

import numpy as np

from chunkpilot.sim.costmodel import CostModel, fit, relative_error, step_features

KNOB_CYCLE = [(32, 32), (64, 32), (128, 64), (256, 128), (512, 256), (1024, 512), (2048, 1024)]


def measure_engine(model: str, *, seconds: float = 60.0, seed: int = 0, threads: int | None = None,
                   max_prompt: int = 1536, concurrency: int = 12, progress: bool = True):
    from chunkpilot.engine.config import EngineConfig
    from chunkpilot.contract.knobs import SchedulerKnobs
    from chunkpilot.engine.llm_engine import LLMEngine
    from chunkpilot.engine.core.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, token_budget=2048, max_chunk=2048, max_num_seqs=32,
                                    enable_prefix_caching=False, threads=threads))
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    last = {}
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        last["features"] = step_features([(c.start, c.num_tokens, i < out.num_decodes)
                                          for i, c in enumerate(out.chunks)])
        return out
    engine.scheduler.schedule = spy

    ids = itertools.count()
    running: set[str] = set()
    samples = []
    knobs = itertools.cycle(KNOB_CYCLE)
    t_end = time.monotonic() + seconds
    gen = 0
    while time.monotonic() < t_end:
        if len(samples) % 40 == 0:
            tb, mc = next(knobs)
            gen += 1
            engine.knobs.set(SchedulerKnobs(tb, mc, gen))
        while len(running) < concurrency:
            long = rng.random() < 0.25
            n = int(rng.integers(256, max_prompt)) if long else int(rng.integers(8, 96))
            rid = f"fit-{next(ids)}"
            engine.add_request(rid, rng.integers(1000, vocab, size=n).tolist(),
                               SamplingParams(max_tokens=int(rng.integers(8, 48)), temperature=0.0, ignore_eos=True))
            running.add(rid)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if "features" in last and last["features"][1] + last["features"][2] > 0:
            samples.append((last.pop("features"), dt))
        for o in outs:
            if o.finished:
                running.discard(o.request_id)
        if progress and len(samples) % 100 == 0:
            print(f"  {len(samples)} steps measured", flush=True)
    return samples


def fit_engine(model: str, *, seconds: float = 60.0, seed: int = 0, threads: int | None = None,
               note: str = "") -> tuple[CostModel, float, int]:
    """(model fitted on the first half of the steps, median relative error on the other half, steps)."""
    samples = measure_engine(model, seconds=seconds, seed=seed, threads=threads)
    train, test = samples[0::2], samples[1::2]
    model_ = fit(train, note=note)
    return fit(samples, note=note), relative_error(model_, test), len(samples)
