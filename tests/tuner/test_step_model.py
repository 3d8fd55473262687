"""The step-time model: fitted from the sums of products the engines export (chunkpilot.contract.step_cost), on
synthetic step logs with known costs of both shapes (CPU: linear in prompt tokens from the first; GPU: flat until
the step turns compute-bound, then linear), with noise."""

from __future__ import annotations

import numpy as np
import pytest

from chunkpilot.contract.step_cost import FEATURES, StepMoments, step_features
from chunkpilot.tuner.step_model import StepModel, fit_moments


def steps(seed: int, n: int = 600) -> list[list[tuple[int, int, bool]]]:
    """Steps as the scheduler makes them: up to 16 decodes at random contexts, then prefill chunks filling a
    budget drawn from the knob range the tuner explores."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        decodes = [(int(rng.integers(8, 1500)), 1, True) for _ in range(int(rng.integers(0, 17)))]
        budget = int(rng.choice([16, 32, 64, 128, 256, 512, 1024, 2048, 4096]))
        left, chunks = budget - len(decodes), []
        while left > 0 and rng.random() < 0.8:
            n_tok = int(min(left, rng.integers(8, 2048)))
            chunks.append((int(rng.integers(0, 1024)), n_tok, False))
            left -= n_tok
        if decodes or chunks:
            out.append(decodes + chunks)
    return out


def cpu_cost(chunks) -> float:
    """SmolLM2 on 2 CPU threads, roughly: every prompt token costs from the first."""
    prefill = sum(n for _, n, d in chunks if not d)
    decodes = sum(1 for _, _, d in chunks if d)
    kv = sum(n * s + n * (n + 1) / 2 for s, n, _ in chunks)
    return 0.058 + 0.00086 * prefill + 0.0046 * decodes + 4.2e-7 * kv


def gpu_cost(chunks) -> float:
    """An 8B model on one big GPU, roughly: ~12 ms while memory-bound, compute-bound from ~600 tokens (a knee that
    is not one of the model's hinges)."""
    tokens = sum(n for _, n, _ in chunks)
    kv = sum(n * s + n * (n + 1) / 2 for s, n, _ in chunks)
    return 0.012 + 2.2e-5 * max(0, tokens - 600) + 1.5e-10 * kv


def fitted(cost, seed: int, noise: float = 0.03):
    rng = np.random.default_rng(seed + 100)
    acc = StepMoments()
    for chunks in steps(seed):
        acc.add(step_features(chunks), cost(chunks) * (1 + noise * rng.standard_normal()))
    return fit_moments(acc.terms())


def held_out_error(model, cost, seed: int) -> float:
    return float(np.median([abs(model.predict(c) - cost(c)) / cost(c) for c in steps(seed + 1)]))


@pytest.mark.parametrize("cost", [cpu_cost, gpu_cost], ids=["cpu", "gpu"])
def test_fit_predicts_unseen_steps_of_either_shape(cost):
    model = fitted(cost, seed=1)
    assert model is not None and all(v >= 0 for v in model.coefficients.values())
    assert held_out_error(model, cost, seed=1) < 0.03, model
    assert 0.01 < model.relative_error < 0.06  # the 3 % noise, as the moments alone tell it


def test_cpu_fit_recovers_the_coefficients():
    c = fitted(cpu_cost, seed=2, noise=0.01).coefficients
    assert c["overhead"] == pytest.approx(0.058, rel=0.05)
    assert c["prefill_tokens"] == pytest.approx(0.00086, rel=0.05)
    assert c["decode_seqs"] == pytest.approx(0.0046, rel=0.1)
    assert c["tokens_over_512"] + c["tokens_over_2048"] < 0.1 * c["prefill_tokens"]


def test_gpu_fit_is_flat_then_linear():
    model = fitted(gpu_cost, seed=3)
    small, medium, large = (model.predict([(0, n, False)]) for n in (32, 384, 3000))
    assert medium == pytest.approx(small, rel=0.1)  # memory-bound: more prompt tokens cost next to nothing
    assert large > 3 * small and large == pytest.approx(gpu_cost([(0, 3000, False)]), rel=0.08)


def test_sums_from_several_pods_and_windows_fit_as_one():
    """What Prometheus does: increase() over a window, summed over pods, is the sum of the pods' terms."""
    all_steps = steps(4)
    whole, pods = StepMoments(), [StepMoments(), StepMoments()]
    for i, chunks in enumerate(all_steps):
        t = cpu_cost(chunks)
        whole.add(step_features(chunks), t)
        pods[i % 2].add(step_features(chunks), t)
    summed = {k: pods[0].terms()[k] + pods[1].terms()[k] for k in whole.terms()}
    a, b = fit_moments(whole.terms()), fit_moments(summed)
    assert a.coefficients == pytest.approx(b.coefficients, rel=1e-9, abs=1e-12)
    assert a.steps == len(all_steps)


def test_too_few_steps_or_no_data_give_no_model():
    assert fit_moments({}) is None
    acc = StepMoments()
    for chunks in steps(5, n=10):
        acc.add(step_features(chunks), cpu_cost(chunks))
    assert fit_moments(acc.terms()) is None


def test_features_unexercised_by_the_window_stay_zero():
    """Only small steps in the window: the hinges have no data and must not be guessed."""
    acc = StepMoments()
    for chunks in steps(6):
        small = [c for c in chunks if c[2]] + [(0, 64, False)]
        acc.add(step_features(small), cpu_cost(small))
    c = fit_moments(acc.terms()).coefficients
    assert c["tokens_over_512"] == 0 and c["tokens_over_2048"] == 0
    assert set(c) == set(FEATURES)


def test_each_coefficient_has_an_interval_that_narrows_with_data():
    wide = fitted(cpu_cost, 7, noise=0.05)
    acc = StepMoments()
    rng = np.random.default_rng(8)
    for seed in range(7, 11):  # four times the steps
        for chunks in steps(seed):
            acc.add(step_features(chunks), cpu_cost(chunks) * (1 + 0.05 * rng.standard_normal()))
    narrow = fit_moments(acc.terms())
    for f in ("overhead", "prefill_tokens", "decode_seqs"):
        lo, hi = wide.interval(f)
        assert lo < wide.coefficients[f] < hi
        assert narrow.standard_error(f) < 0.7 * wide.standard_error(f), f  # ~1/sqrt(4) of it


def test_steps_that_never_vary_identify_nothing_they_cannot_tell_apart():
    """Every step decodes 8 sequences and computes no prompt: the per-step and the per-sequence costs are one
    column twice over. The fit must say so (an infinite interval) rather than split the time between them."""
    acc = StepMoments()
    rng = np.random.default_rng(3)
    for _ in range(500):
        chunks = [(int(rng.integers(100, 600)), 1, True) for _ in range(8)]
        acc.add(step_features(chunks), cpu_cost(chunks) * (1 + 0.02 * rng.standard_normal()))
    model = fit_moments(acc.terms())
    terms = model.identification()
    assert terms["overhead"].high == float("inf") and terms["decode_seqs"].high == float("inf")
    assert {"overhead", "decode_seqs", "prefill_tokens"} <= set(model.unidentified())
    # a step like the ones seen (8 decodes) is predicted with a finite interval, collinear or not: the unseen
    # direction cancels; a step of another composition, or one that uses an unseen feature, is unbounded
    same = step_features([(300, 1, True)] * 8)
    assert model.upper().step_seconds(same) < float("inf")
    assert abs(model.step_seconds(same) - cpu_cost([(300, 1, True)] * 8)) < 0.1 * model.step_seconds(same)
    assert model.upper().step_seconds(step_features([(300, 1, True)] * 4)) == float("inf")
    prefill = step_features([(300, 1, True)] * 8 + [(0, 64, False)])
    assert model.upper().step_seconds(prefill) == float("inf") and model.step_seconds(prefill) < float("inf")


def test_an_upper_bound_is_never_below_the_point_prediction_and_a_hand_given_cost_is_exact():
    model = fitted(cpu_cost, 9)
    for chunks in steps(10, n=50):
        lo, hi = model.step_interval(step_features(chunks))
        assert lo <= model.predict(chunks) <= hi == model.upper().predict(chunks)
    exact = StepModel(model.coefficients, steps=1, rms_error=0, mean_seconds=1)
    assert exact.upper().predict(steps(10, n=1)[0]) == exact.predict(steps(10, n=1)[0])
    assert all(t.status != "unidentified" or t.coefficient == 0 for t in exact.identification().values())


def test_contention_noise_keeps_the_mean_and_spans_the_range_it_says():
    from chunkpilot.sim.costmodel import Contended, default

    cost = default()
    chunks = [(0, 64, False), (100, 1, True)]
    noisy = Contended(cost, 1.0, seed=3)
    ratios = np.array([noisy.step_seconds(chunks) for _ in range(4000)]) / cost.step_seconds(chunks)
    assert abs(ratios.mean() - 1) < 0.02 and ratios.max() / ratios.min() > 1.9 and ratios.max() <= 4 / 3 + 1e-9
    a, b = Contended(cost, 1.0, seed=5), Contended(cost, 1.0, seed=5)  # seeded: a run repeats
    assert [a.step_seconds(chunks) for _ in range(5)] == [b.step_seconds(chunks) for _ in range(5)]
