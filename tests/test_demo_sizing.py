"""The demo sizes its load from what the machine measures: a probe designed to identify the step-time model (run
here on the simulator, with a cost whose coefficients the test knows), the sizing judged at the fit's upper
bound, and a measured check that refuses a load no knobs can serve and resizes it (a simulated engine slower than
the probe said). A fast host keeps the demo's prompts and SLO and gets longer outputs; a slow one keeps the
outputs and gets shorter long prompts, always with some knobs predicted to keep the ITL SLO with headroom."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from chunkpilot.demo import probe as probes
from chunkpilot.demo import sizing
from chunkpilot.demo.run import KNOB_BOUNDS, MAX_NUM_SEQS, DemoConfig
from chunkpilot.contract import step_cost
from chunkpilot.loadgen.workloads import build_workload
from chunkpilot.tuner.predictor import predict
from chunkpilot.tuner.sim.costmodel import CostModel
from chunkpilot.tuner.sim.simulator import Simulator
from chunkpilot.tuner.space import Knobs, SearchSpace
from chunkpilot.tuner.step_model import IDENTIFIED, NEGLIGIBLE, StepModel, fit_moments

SPACE = SearchSpace.from_bounds(KNOB_BOUNDS, KNOB_BOUNDS)
CONFIG = DemoConfig(model="m", out=Path("/nonexistent"))
START = Knobs(2048, 2048)
# a CPU fit of SmolLM2 on 2 cores, in the engine's step-cost features
FAST = StepModel({"overhead": 0.058, "prefill_tokens": 0.00086, "decode_seqs": 0.00465, "kv_kilotokens": 0.0004,
                  "tokens_over_512": 0.0, "tokens_over_2048": 0.0}, steps=1000, rms_error=0.005, mean_seconds=0.1)


def slower(model: StepModel, factor: float) -> StepModel:
    return replace(model, coefficients={k: v * factor for k, v in model.coefficients.items()})


def test_a_fast_host_keeps_the_demos_prompts_and_slo():
    assert sizing.itl_slo(CONFIG, FAST, SPACE) == CONFIG.itl_slo
    assert sizing.output_scale(CONFIG, FAST, SPACE) == sizing.OUTPUT_SCALES[-1]
    # every stream, chat and long alike, is that much longer; prompts are untouched
    longer = replace(CONFIG, output_scale=2.0).shapes()
    for kind, shape in CONFIG.shapes().items():
        assert longer[kind].output == (2 * shape.output[0], 2 * shape.output[1])
        assert longer[kind].prompt == shape.prompt
    # a slow host's streams already live that long: its outputs stay
    assert sizing.output_scale(CONFIG, slower(FAST, 5.0), SPACE) == 1.0


def test_outputs_are_lengthened_until_half_the_streams_meet_a_long_prompt():
    half = slower(FAST, 2.0)
    target = sizing.stream_target(CONFIG)
    # Poisson: the share of streams that see a long prompt arrive while they decode
    assert abs(1 - np.exp(-sizing.long_prompt_rate(CONFIG) * target) - sizing.STALLED_SHARE) < 1e-9
    scale = sizing.output_scale(CONFIG, half, SPACE)
    assert 1.0 < scale < sizing.OUTPUT_SCALES[-1]
    assert sizing.stream_seconds(replace(CONFIG, output_scale=scale), half, SPACE) >= target
    below = sizing.OUTPUT_SCALES[sizing.OUTPUT_SCALES.index(scale) - 1]
    assert sizing.stream_seconds(replace(CONFIG, output_scale=below), half, SPACE) < target


def test_a_slow_host_gets_shorter_long_prompts_that_some_knobs_can_serve():
    slow = slower(FAST, 5.0)
    assert not sizing.fits(replace(CONFIG, itl_slo=sizing.itl_slo(CONFIG, slow, SPACE)), 1.0, slow, SPACE)
    config, knobs = sizing.plan(CONFIG, replace(slow, covariance=None), SPACE)
    assert knobs is not None and config.itl_slo >= CONFIG.itl_slo and config.rag_scale < 1.0
    p = predict(slow, knobs, sizing.busy_load(config, config.rag_scale, slow, SPACE))
    assert p.itl_p99 <= sizing.COUNTED_ITL_SHARE * config.itl_slo and p.utilization <= sizing.TARGET_UTILIZATION
    assert config.shapes()["rag"].prompt[1] < CONFIG.shapes()["rag"].prompt[1]
    assert config.shapes()["chat"].prompt == CONFIG.shapes()["chat"].prompt  # the rag scale does not touch chat
    # slower still: the rate comes down only when no long prompts short enough would do
    slowest, _ = sizing.plan(CONFIG, slower(FAST, 20.0), SPACE)
    assert slowest.rate < CONFIG.rate and config.rate <= CONFIG.rate


# -- the probe, on the simulator: the real scheduler makes the steps, a known cost times them ----------------------

TRUTH = CostModel(overhead=0.04, prefill_tokens=0.0025, decode_seqs=0.004, kv_reads=5e-8)


class Noisy:
    """The known cost with noise: 3 % of the step plus 3 ms, at random (seeded)."""

    def __init__(self, cost, seed: int) -> None:
        self.cost, self.rng = cost, np.random.default_rng(seed)

    def step_seconds(self, chunks) -> float:
        return self.cost.step_seconds(chunks) * (1 + 0.03 * self.rng.standard_normal()) + \
            0.003 * self.rng.standard_normal()


class SimulatedEngine:
    """probe()'s runner on the simulator: each stage's requests at its knobs, the fit over every step run."""

    def __init__(self, cost) -> None:
        self.cost, self.rows, self.knobs = cost, [], []

    def run(self, stage: probes.Stage) -> None:
        self.knobs.append(stage.knobs)
        if stage.requests:
            sim = Simulator(self.cost, list(stage.requests), stage.knobs, max_num_seqs=MAX_NUM_SEQS)
            sim.run()
            self.rows += [r[1:] for r in sim.step_log]

    def model(self) -> StepModel | None:
        rows = np.array(self.rows)
        return fit_moments(step_cost.terms_of(rows.T @ rows))


def test_the_start_up_knobs_probe_is_unidentified_and_the_designed_probe_recovers_every_coefficient():
    truth = TRUTH.as_step_model().coefficients
    engine = SimulatedEngine(Noisy(TRUTH, 1))
    model, rounds = probes.probe(engine, MAX_NUM_SEQS, START, KNOB_BOUNDS[1], stages=probes.startup_stages,
                                 say=lambda s: None)
    assert rounds == probes.MAX_ROUNDS and not probes.identified(model, KNOB_BOUNDS[1], MAX_NUM_SEQS)
    # the per-step and per-sequence costs are what a start-up-knobs probe cannot separate
    assert {"overhead", "decode_seqs"} <= set(model.unidentified())

    engine = SimulatedEngine(Noisy(TRUTH, 2))
    said = []
    model, rounds = probes.probe(engine, MAX_NUM_SEQS, START, KNOB_BOUNDS[1], say=said.append)
    assert probes.identified(model, KNOB_BOUNDS[1], MAX_NUM_SEQS), (said, probes.describe(model, 2048, 16))
    terms = model.identification()
    for f in ("overhead", "prefill_tokens", "decode_seqs"):
        assert terms[f].status == IDENTIFIED and abs(model.coefficients[f] / truth[f] - 1) <= 0.15, (f, terms[f])
    for f in ("kv_kilotokens", "tokens_over_512", "tokens_over_2048"):  # small or zero here: bounded, not guessed
        assert terms[f].status in (IDENTIFIED, NEGLIGIBLE), (f, terms[f])
    # the designed stages really vary the knobs, and the engines are left at the start-up knobs
    assert {Knobs(32, 32), Knobs(128, 128), Knobs(512, 512)} <= set(engine.knobs) and engine.knobs[-1] == START


# -- the measured check, on a simulated engine slower than the probe said ------------------------------------------

def simulated_check(truth: StepModel):
    """measure() on the simulator: the busiest phase's rate for 120 s, the counted knobs and the start-up knobs
    each on an engine whose steps cost `truth`."""
    from chunkpilot.demo.check import itl_p99
    from chunkpilot.tuner.sim.costmodel import FittedCost

    def measure(config, knobs, predicted):
        phase = max(config.phases(), key=lambda p: p.rate)
        specs = build_workload([replace(phase, duration=120.0)], vocab_size=49152, seed=7, shapes=config.shapes())
        itl = {}
        for name, k, q in (("counted", knobs, sizing.COUNTED_QUANTILE), ("start", config.start,
                                                                         sizing.START_QUANTILE)):
            sim = Simulator(FittedCost(truth), specs, k, max_num_seqs=MAX_NUM_SEQS)
            itl[name] = itl_p99(sim.run(), q)
        return sizing.Check(knobs=knobs, itl_slo=config.itl_slo, counted_itl=itl["counted"],
                            start_itl=itl["start"], predicted_itl=predicted)
    return measure


def test_the_check_refuses_a_load_no_knobs_can_serve_and_the_demo_resizes_it():
    probed = replace(slower(FAST, 3.0), covariance=None)
    engine = slower(probed, 2.5)  # the busy engine is 2.5x slower than the probe said
    said = []
    config, done = sizing.size(CONFIG, probed, SPACE, simulated_check(engine), say=said.append)
    first, last = done.checks[0], done.checks[-1]
    assert not first.ok and first.counted_itl > sizing.CHECK_SHARE * first.itl_slo, said
    assert last.ok and len(done.checks) >= 2, said
    # resized from what was measured: shorter long prompts or a looser SLO than the first plan, never more
    assert (config.rag_scale, -config.itl_slo) < (sizing.plan(CONFIG, probed, SPACE)[0].rag_scale, -first.itl_slo)


def test_an_engine_as_fast_as_probed_passes_the_first_check():
    probed = replace(slower(FAST, 3.0), covariance=None)
    config, done = sizing.size(CONFIG, probed, SPACE, simulated_check(probed), say=lambda s: None)
    assert len(done.checks) == 1 and done.checks[0].ok, done.checks


def test_a_host_whose_streams_end_quickly_gets_a_busier_phase():
    """Outputs at their longest still leave fewer than half the streams meeting a long prompt on a fast host: the
    busiest rate goes up until they do (and the knobs counted on are planned at that rate)."""
    fast = replace(FAST, covariance=None)
    assert sizing.stalled_share(replace(CONFIG, output_scale=sizing.OUTPUT_SCALES[-1]), fast, SPACE) \
        < sizing.STALLED_SHARE
    config, knobs = sizing.plan(CONFIG, fast, SPACE)
    assert config.rate > CONFIG.rate and config.output_scale == sizing.OUTPUT_SCALES[-1] and knobs is not None
    assert sizing.stalled_share(config, fast, SPACE) >= sizing.STALLED_SHARE
    # a slower host reaches the share with longer outputs alone
    assert sizing.plan(CONFIG, slower(fast, 2.0), SPACE)[0].rate == CONFIG.rate


def test_start_up_knobs_that_keep_the_slo_make_the_busy_phase_busier():
    check = sizing.Check(knobs=Knobs(64, 32), itl_slo=0.5, counted_itl=0.2, start_itl=0.4, predicted_itl=0.2)
    assert check.counted_ok and not check.start_over and not check.ok
    resize = sizing.next_plan(check, FAST, CONFIG)
    assert resize.model == FAST and resize.config.rate == CONFIG.rate * sizing.RATE_UPS[1] and resize.knobs is None
    # nothing measured for the counted knobs: nothing to resize from
    assert sizing.next_plan(replace(check, counted_itl=None), FAST, CONFIG) is None


def test_counted_knobs_that_keep_the_slo_without_its_room_widen_the_slo_and_keep_the_load():
    """A case measured on a 2-core host: the counted knobs read 0.37 s against a predicted 0.23 s, inside the
    0.5-s SLO but not within 0.7 of it, while the start-up knobs read 2.07 s. Slowing the model by the whole 1.6x
    re-planned a load so light that the start-up knobs kept the SLO, and three checks ran out. The near miss now
    widens the SLO to give the measured knobs their room, the load and knobs unchanged, and checks them again."""
    sized = replace(CONFIG, rate=0.75, itl_slo=0.5, output_scale=2.0, rag_scale=1.0)
    near = sizing.Check(knobs=Knobs(80, 32), itl_slo=0.5, counted_itl=0.373, start_itl=2.07, predicted_itl=0.233,
                        contention=1.28)
    resize = sizing.next_plan(near, FAST, CONFIG, sized)
    assert resize.knobs == Knobs(80, 32) and resize.model == FAST
    assert resize.config == replace(sized, itl_slo=0.55)  # 0.373 / 0.7 = 0.533, in 0.05 s
    assert replace(near, itl_slo=0.55).counted_ok
    # a miss past the SLO itself is the model's: slowed, the load re-planned
    far = replace(near, counted_itl=0.6)
    resize = sizing.next_plan(far, FAST, CONFIG, sized)
    assert resize.knobs is None and resize.config == CONFIG
    assert resize.model.coefficients["overhead"] == FAST.coefficients["overhead"] * 0.6 / 0.233
    # a widened SLO the start-up knobs would keep shows nothing: the model is slowed instead
    assert sizing.next_plan(replace(near, start_itl=0.54), FAST, CONFIG, sized).knobs is None


def test_the_demo_checks_the_same_knobs_again_after_widening_the_slo():
    sized = {}

    def measure(config, knobs, predicted):
        sized.setdefault("first", (config, knobs))
        first_config, first_knobs = sized["first"]
        assert knobs == first_knobs and replace(config, itl_slo=first_config.itl_slo) == first_config
        # the same engine: the counted knobs read just inside the SLO each time
        return sizing.Check(knobs=knobs, itl_slo=config.itl_slo, counted_itl=0.93 * first_config.itl_slo,
                            start_itl=5.0, predicted_itl=predicted)
    said = []
    config, done = sizing.size(CONFIG, FAST, SPACE, measure, say=said.append)
    assert [c.ok for c in done.checks] == [False, True], said
    assert config.itl_slo > done.checks[0].itl_slo and any("ITL SLO" in s and "same load" in s for s in said)
