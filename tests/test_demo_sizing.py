"""The demo sizes its outputs, its long prompts (and, where the smallest chunks need it, its ITL SLO) to the
machine: pure, on known step costs. A fast host (the shipped 2026-11-29 fit) keeps the demo's prompts and SLO and
gets longer outputs, so that its streams live about as long as on the slower hosts the demo was sized on; one 5x
slower keeps the outputs and gets shorter long prompts, and always some knobs predicted to keep the ITL SLO with
prefill headroom."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from chunkpilot.demo import sizing
from chunkpilot.demo.run import KNOB_BOUNDS, DemoConfig
from chunkpilot.tuner.predictor import predict
from chunkpilot.tuner.space import SearchSpace
from chunkpilot.tuner.step_model import StepModel

SPACE = SearchSpace.from_bounds(KNOB_BOUNDS, KNOB_BOUNDS)
CONFIG = DemoConfig(model="m", out=Path("/nonexistent"))
# the shipped CPU fit (2026-11-29), in the engine's step-cost features
FAST = StepModel({"overhead": 0.058, "prefill_tokens": 0.00086, "decode_seqs": 0.00465, "kv_kilotokens": 0.0004,
                  "tokens_over_512": 0.0, "tokens_over_2048": 0.0}, steps=1000, rms_error=0.005, mean_seconds=0.1)


def slower(model: StepModel, factor: float) -> StepModel:
    return replace(model, coefficients={k: v * factor for k, v in model.coefficients.items()})


def test_a_fast_host_keeps_the_demos_prompts_and_slo():
    assert sizing.itl_slo(CONFIG, FAST, SPACE) == CONFIG.itl_slo
    assert sizing.rag_scale(CONFIG, FAST, SPACE) == 1.0
    # judged as slowed by the busy phase's contention, as `size` judges the probe's fit: still the demo's shapes,
    # with the longer outputs a fast host gets
    busy = sizing.contended(FAST)
    assert busy.coefficients["prefill_tokens"] == FAST.coefficients["prefill_tokens"] * sizing.CONTENTION
    config = replace(CONFIG, output_scale=sizing.output_scale(CONFIG, busy, SPACE))
    assert config.output_scale > 1.0
    assert sizing.itl_slo(config, busy, SPACE) == CONFIG.itl_slo
    assert sizing.rag_scale(config, busy, SPACE) == 1.0


def test_outputs_are_lengthened_until_streams_live_as_long_as_where_the_demo_was_sized():
    # quick decode steps: the least scale whose mean stream decodes STREAM_SECONDS, or the largest
    half = slower(FAST, 2.0)
    scale = sizing.output_scale(CONFIG, half, SPACE)
    assert 1.0 < scale < sizing.OUTPUT_SCALES[-1]
    assert sizing.stream_seconds(replace(CONFIG, output_scale=scale), half, SPACE) >= sizing.STREAM_SECONDS
    below = sizing.OUTPUT_SCALES[sizing.OUTPUT_SCALES.index(scale) - 1]
    assert sizing.stream_seconds(replace(CONFIG, output_scale=below), half, SPACE) < sizing.STREAM_SECONDS
    assert sizing.output_scale(CONFIG, FAST, SPACE) == sizing.OUTPUT_SCALES[-1]
    # every stream, chat and long alike, is that much longer; prompts are untouched
    longer = replace(CONFIG, output_scale=2.0).shapes()
    for kind, shape in CONFIG.shapes().items():
        assert longer[kind].output == (2 * shape.output[0], 2 * shape.output[1])
        assert longer[kind].prompt == shape.prompt
    # a slow host's streams already live that long: its outputs stay
    assert sizing.output_scale(CONFIG, slower(FAST, 5.0), SPACE) == 1.0


def test_a_slow_host_gets_shorter_long_prompts_that_some_knobs_can_serve():
    slow = slower(FAST, 5.0)
    config = replace(CONFIG, itl_slo=sizing.itl_slo(CONFIG, slow, SPACE))
    assert config.itl_slo >= CONFIG.itl_slo
    scale = sizing.rag_scale(config, slow, SPACE)
    assert scale < 1.0
    assert not sizing.fits(config, 1.0, slow, SPACE)  # the demo's own shapes: nothing would do
    load = sizing.busy_load(config, scale, slow, SPACE)
    best = min((predict(slow, k, load) for k in SPACE.all_knobs()), key=lambda p: (p.itl_p99 > 0.9 * config.itl_slo,
                                                                                   p.utilization))
    assert best.itl_p99 <= 0.9 * config.itl_slo and best.utilization <= sizing.TARGET_UTILIZATION
    assert config.shapes(scale)["rag"].prompt[1] < config.shapes(1.0)["rag"].prompt[1]
    assert config.shapes(scale)["chat"] == config.shapes(1.0)["chat"]  # the rag scale does not touch chat


def test_a_failed_probe_keeps_the_configured_load():
    said = []
    out = sizing.size(CONFIG, ["http://127.0.0.1:1"], "http://127.0.0.1:1", 'job="x"', SPACE, say=said.append)
    assert out == CONFIG and "keeping the configured lengths" in said[-1], said
