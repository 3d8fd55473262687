"""The simulator (real Scheduler + BlockManager on a virtual clock) and the tuner measured with it, seeded."""

from __future__ import annotations

import pytest

from chunkpilot.contract.slo import LatencyTarget, SLOTargets
from chunkpilot.loadgen.workloads import RequestSpec
from chunkpilot.tuner.loop import TunerSettings
from chunkpilot.sim.costmodel import CostModel, default, fit, relative_error, step_features
from chunkpilot.sim.experiment import Scenario, evaluate, tune
from chunkpilot.sim.simulator import Simulator
from chunkpilot.tuner.space import Knobs, SearchSpace

COST = CostModel(overhead=0.01, prefill_tokens=0.001, decode_seqs=0.002, kv_reads=0.0)
SLO = SLOTargets(ttft=LatencyTarget(0.99, 20.0), itl=LatencyTarget(0.99, 0.25))


def test_cost_model_fit_recovers_known_coefficients():
    samples = []
    for p in (0, 16, 64, 256, 1024):
        for d in (0, 1, 4, 16):
            if p or d:
                f = step_features([(0, p, False)] * (p > 0) + [(100, 1, True)] * d)
                samples.append((f, 0.02 + 0.0005 * p + 0.003 * d + 1e-7 * f[3]))
    m = fit(samples)
    assert abs(m.overhead - 0.02) < 1e-9 and abs(m.prefill_tokens - 0.0005) < 1e-9
    assert relative_error(m, samples) < 1e-6
    assert default().prefill_tokens > 0 and default().note  # the shipped fit says where it came from


def test_simulated_latencies_follow_the_scheduler():
    # One long prompt arrives while 4 short requests decode: the prompt's prefill is chunked by max_chunk and the
    # decodes' gaps grow by exactly the chunk's cost, as in the engine.
    reqs = [RequestSpec("chat", [7] * 16, 20, 0.0, 16) for _ in range(4)] + [RequestSpec("rag", [7] * 1000, 4, 0.1, 1000)]
    gaps = {}
    for budget in (64, 1024):
        sim = Simulator(COST, reqs, Knobs(budget, budget))
        records = sim.run()
        assert all(r.output_tokens == (4 if r.kind == "rag" else 20) for r in records)
        gaps[budget] = max(g for r in records if r.kind == "chat" for g in r.itls)
    assert gaps[64] < 0.01 + 0.001 * 64 + 0.002 * 5 + 1e-9  # a decode step + one 60-token chunk at most
    assert gaps[1024] > 0.9  # the unchunked prompt stalls every decode for its whole prefill
    again = Simulator(COST, reqs, Knobs(64, 64)).run()
    assert [r.token_times for r in again] == [r.token_times for r in Simulator(COST, reqs, Knobs(64, 64)).run()]


def test_window_reports_the_prefill_capacity_the_knobs_allow():
    # One 2000-token prompt alone: every step computes max_chunk prompt tokens in overhead + max_chunk x per-token
    # seconds, so the capacity is exactly max_chunk / that; halving the chunk costs the overhead twice as often.
    reqs = [RequestSpec("rag", [7] * 2000, 1, 0.01, 2000)]
    for chunk in (64, 128):
        sim = Simulator(COST, reqs, Knobs(chunk, chunk))
        sim.advance(1.0)
        w = sim.window(1.0, SLO)
        assert w.prefill_capacity == pytest.approx(chunk / (0.01 + 0.001 * chunk), rel=1e-6)
    idle = Simulator(COST, [], Knobs(64, 64))
    idle.advance(1.0)
    assert idle.window(1.0, SLO).prefill_capacity is None  # no prompt work: nothing to judge


def test_knob_change_lands_at_the_next_step():
    reqs = [RequestSpec("chat", [7] * 16, 200, 0.0, 16)]
    sim = Simulator(COST, reqs, Knobs(64, 64))
    sim.advance(0.5)
    gen = sim.set_knobs(Knobs(128, 32))
    assert gen == 1 and sim.knobs == Knobs(128, 32)
    sim.advance(1.0)
    assert sim.scheduler.knobs.get().generation == 1


def test_tuner_reaches_the_grid_best_and_beats_a_fixed_2048_budget():
    """The issue's targets, deterministic, on seeds 0-4: >= 95 % of the grid-best goodput within 15 trials and
    >= 1.3x the goodput of vLLM's default budget of 2048, under a tight ITL SLO on the mixed workload. The seeds
    are the ones this test always used; over 30 seeds about one run in 30 still settles just outside the ITL
    SLO at ~85 % (docs/tuner-model.md, "Measuring the tuner"; `python bench/tuner_vs_grid.py --seeds 30` prints them)."""
    scenario = Scenario(rate=0.9, seed=0)
    space = SearchSpace.from_bounds((32, 2048), (32, 2048), 16, points_per_octave=2)
    grid = {k: evaluate(k, scenario, default(), SLO, seconds=300, warmup=30).goodput for k in space.all_knobs()}
    best_grid = max(grid.values())
    fixed = grid[Knobs(2048, 2048)]
    settings = TunerSettings(window=60, warmup=10, max_trials=15, min_requests=15)
    for seed in range(5):
        result = tune(scenario, default(), SLO, space, settings, iterations=15, start=Knobs(2048, 2048), seed=seed)
        found = evaluate(result.best, scenario, default(), SLO, seconds=300, warmup=30).goodput
        assert found >= 0.95 * best_grid, (seed, result.best, found, best_grid)
        assert found >= 1.3 * fixed, (seed, found, fixed)
