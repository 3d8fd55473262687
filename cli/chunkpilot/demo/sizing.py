"""The demo's outputs and long prompts sized to the machine it runs on.

The same 2-core CI machine class ran SmolLM2's matmuls 3.5x slower on one day than on another (2026-11-29 against
2026-12-01: 4.5 ms against 0.9 ms per prompt token, from the demo's own step-time fits). With fixed prompt lengths
the busy phase then asks more prompt tokens per second than *any* knobs can prefill within the inter-token SLO:
the best fixed knobs in hindsight met 70 % of the requests, and a demo whose SLO nothing can meet says nothing
about a tuner. So before the load, a short probe (the same requests to every engine of both groups) fits the
step-time model from the engines' own steps through Prometheus, exactly as the tuner does. Then the long ("rag")
prompts are shrunk until some knobs of the tuner's space are predicted, at the busiest phase's rate, to keep the
ITL SLO with prefill demand within TARGET_UTILIZATION of the capacity those knobs leave. Prompts are never made
longer than the demo's own shapes. Before that, on a host whose decode steps are quick, the outputs are made
longer (OUTPUT_SCALES), so that streams live as long as they did where the demo was sized. Both groups get the
same sized load. The report prints the scales."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from dataclasses import replace

from chunkpilot.loadgen.runner import BenchmarkConfig, run_benchmark_async
from chunkpilot.loadgen.workloads import Phase, Shape, build_workload
from chunkpilot.tuner.measurement import LATENCY_MARGIN
from chunkpilot.tuner.predictor import Load, predict
from chunkpilot.tuner.prometheus import PrometheusSource
from chunkpilot.tuner.space import SearchSpace
from chunkpilot.tuner.step_model import StepModel

log = logging.getLogger(__name__)

# Prompt demand of the busiest phase over the prefill capacity of the knobs that keep the ITL SLO. The tuner keeps
# 0.8 as headroom (measurement.MAX_PREFILL_UTILIZATION) and judges at 1.5x the measured load; Poisson bursts of
# the busy phase's 20-s windows push a 0.55 average past 0.8 now and then.
TARGET_UTILIZATION = 0.55
# The ITL SLO must leave the smallest chunks room: on the slow host above a 0.5-s SLO was met only by 32-token
# chunks, measured at 0.46-0.49 s (predicted 0.35 s: two engines, Prometheus and the load share two cores), so
# every window sat on the tuner's margin and it kept exploring into breaches. The SLO is the configured one or this
# many times the predicted ITL p99 of the smallest knobs at the busiest load, whichever is larger (on the hosts the
# demo was sized on it stays 0.5 s).
ITL_SLO_ROOM = 1.5
# The probe's steps run beside nothing but the other engines' probe; the busy phase's share two cores with both
# groups' engines streaming to the load generator, Prometheus and the tuner. There, the smallest chunks' ITL p99
# read 1.1-2.2x the probe fit's prediction (2026-12-01, three sized runs: 32/32 at 0.48-0.72 s against 0.33-0.43
# s), so a 0.5-s SLO the sizing judged within reach was met by no knobs at all in two of the three. The sizing
# judges on the probe's fit slowed by this factor (the tuner itself refits and calibrates every window).
CONTENTION = 1.3
SCALES = tuple(round(1.0 - 0.05 * i, 2) for i in range(17))  # 1.0, 0.95, ... 0.2
# A stream that an unchunked prompt stalls breaches the ITL SLO however long it is, so how many streams one long
# prompt hits is how long streams live, and that is the host's decode step times the output length. On
# 2026-12-02's host (2.3-2.5 ms a prompt token, a decode step of about 0.1 s) the demo's 8-32-token outputs lived
# about 2 s, the fixed group met 76-80 % of its requests and goodput read 1.16-1.24x with the tuner at 94-97 %:
# even perfect knobs would have shown little. Replayed on two of those runs' own traces with outputs twice as long
# (the simulator on each run's fitted model), the fixed knobs met 62-66 % and the best fixed knobs 97-100 %. So the
# outputs are lengthened until the busy phase's mean stream decodes for STREAM_SECONDS, about as long as it did on
# the slower hosts the demo was first sized on (decode steps of 0.2-0.3 s: fixed 54-71 %), and no further than
# the largest of OUTPUT_SCALES (three times as long made the best fixed knobs themselves miss 4-15 %).
STREAM_SECONDS = 4.5
OUTPUT_SCALES = (1.0, 1.25, 1.5, 1.75, 2.0)
# The probe: both kinds of request (about eight), every engine at once, ten seconds; its steps are what the fit sees.
PROBE = Phase(10.0, 0.8, {"chat": 0.5, "rag": 0.5})
PROBE_SHAPES = {"chat": Shape(prompt=(16, 96), output=(8, 32)), "rag": Shape(prompt=(256, 1024), output=(2, 8))}


def probe(urls: list[str], prometheus_url: str, selector: str) -> StepModel | None:
    """Send the probe to every engine at once, wait for two scrapes, fit the step-time model over the probe."""
    specs = build_workload([PROBE], vocab_size=49152, seed=12345, shapes=PROBE_SHAPES)
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda u=u: asyncio.run(run_benchmark_async(
        BenchmarkConfig(base_url=u, model="smollm2", requests=specs, progress=False, timeout=120))), daemon=True)
        for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(2.5)  # 1-s scrapes: the last steps reach Prometheus
    return PrometheusSource(prometheus_url, selector).step_model(time.monotonic() - t0 + 2)


def contended(model: StepModel) -> StepModel:
    """The probe's fit with every step CONTENTION times slower: what the busy phase's steps take."""
    return replace(model, coefficients={k: v * CONTENTION for k, v in model.coefficients.items()})


def _busy(config, scale: float, model: StepModel, space: SearchSpace) -> tuple[Load, float]:
    """The busiest phase's load per engine at this rag scale, and its mean output tokens."""
    phase = max(config.phases(), key=lambda p: p.rate)
    specs = build_workload([replace(phase, duration=600.0)], vocab_size=49152, seed=config.seed,
                           shapes=config.shapes(scale))
    # the mix as a histogram of 64-token bins (the predictor walks every entry for every candidate)
    bins: dict[float, float] = {}
    for spec in specs:
        b = float(64 * (spec.prompt_tokens // 64) + 32)
        bins[b] = bins.get(b, 0.0) + 1.0
    prompts = tuple(sorted(bins.items()))
    outputs = sum(s.max_tokens for s in specs) / max(1, len(specs))
    load = Load(request_rate=phase.rate, prompts=prompts, running=1.0)
    for _ in range(3):  # running depends on the decode step, which depends on running
        step = predict(model, space.all_knobs()[0], load).decode_step
        load = replace(load, running=max(1.0, phase.rate * outputs * step))
    return load, outputs


def busy_load(config, scale: float, model: StepModel, space: SearchSpace) -> Load:
    """The busiest phase's load per engine at this rag scale: its prompts (sampled as the workload samples them)
    and the decodes in flight (arrival rate x output tokens x a decode step, the predictor's own)."""
    return _busy(config, scale, model, space)[0]


def fits(config, scale: float, model: StepModel, space: SearchSpace) -> bool:
    load = busy_load(config, scale, model, space)
    for knobs in space.all_knobs():
        p = predict(model, knobs, load)
        if p.itl_p99 <= config.itl_slo * LATENCY_MARGIN and p.utilization <= TARGET_UTILIZATION:
            return True
    return False


def stream_seconds(config, model: StepModel, space: SearchSpace) -> float:
    """How long the busy phase's mean stream decodes at the smallest knobs (its outputs x their decode step)."""
    load, outputs = _busy(config, 1.0, model, space)
    return outputs * predict(model, space.all_knobs()[0], load).decode_step


def output_scale(config, model: StepModel, space: SearchSpace) -> float:
    """The least of OUTPUT_SCALES at which the mean stream decodes for STREAM_SECONDS (the largest when none does)."""
    return next((s for s in OUTPUT_SCALES
                 if stream_seconds(replace(config, output_scale=s), model, space) >= STREAM_SECONDS),
                OUTPUT_SCALES[-1])


def itl_slo(config, model: StepModel, space: SearchSpace) -> float:
    smallest = predict(model, space.all_knobs()[0], busy_load(config, 1.0, model, space)).itl_p99
    return max(config.itl_slo, math.ceil(20 * ITL_SLO_ROOM * smallest) / 20)  # in 0.05 s


def rag_scale(config, model: StepModel, space: SearchSpace) -> float:
    """The largest scale (at most 1) at which some knobs fit; the smallest one tried when none does."""
    return next((s for s in SCALES if fits(config, s, model, space)), SCALES[-1])


def size(config, urls: list[str], prometheus_url: str, selector: str, space: SearchSpace, say=print):
    """The config with its outputs and long prompts sized to this host (or as it was, when the probe says too
    little)."""
    say("probing this machine's engines (ten seconds of requests) to size the outputs and long prompts...")
    try:
        model = probe(urls, prometheus_url, selector)
    except Exception as e:  # noqa: BLE001 - sizing is a refinement: the demo goes on with the configured load
        say(f"the probe failed ({type(e).__name__}: {e}): keeping the configured lengths")
        return config
    if model is None:
        say("the probe fitted no step-time model: keeping the configured lengths")
        return config
    fitted, model = model, contended(model)
    # outputs first: the decodes in flight are part of every load the SLO and the prompts are sized against
    config = replace(config, output_scale=output_scale(config, model, space))
    config = replace(config, itl_slo=itl_slo(config, model, space))
    scale = rag_scale(config, model, space)
    c, rag = fitted.coefficients, config.shapes(1.0)["rag"].prompt
    say(f"step-time fit: {1e3 * c.get('prefill_tokens', 0):.2f} ms per prompt token, "
        f"{1e3 * c.get('overhead', 0):.0f} ms per step (judged {CONTENTION:g}x slower under load); ITL SLO "
        f"{config.itl_slo:g} s; outputs {config.output_scale:g}x the demo's; long prompts at {scale:.0%} of the "
        f"demo's {rag[0]}-{rag[1]} tokens")
    return replace(config, rag_scale=scale)
