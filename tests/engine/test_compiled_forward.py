"""The compiled forward (--compile, chunkpilot.engine.execution.compiled_forward): small steps run through the graphs
torch.compile built at start-up and give the eager forward's logits (the same weights through inductor's own
fused GEMMs, so within bfloat16 rounding, not bit for bit); larger steps stay eager; and where it cannot run it is
refused with what to change. Its speed is measured in bench/quantization.py, not here."""

from __future__ import annotations

import pytest
import torch

from chunkpilot.engine.execution.compiled_forward import COMPILE_ROWS, CompileError, check
from chunkpilot.engine.parallel.step_plan import PlannedChunk, StepPlan


@pytest.fixture(scope="module")
def compiled_llm(tmp_path_factory):
    from chunkpilot.engine import LLM

    from .tiny_models import make_checkpoint

    model = make_checkpoint(tmp_path_factory.mktemp("compiled") / "tiny", "llama")
    # int4 layers and the int8 head: the kernels inductor's freezing and max-autotune replace by its own GEMMs
    llm = LLM(str(model), quantization="int4", max_model_len=64, num_kv_blocks=64, enable_prefix_caching=False,
              threads=2, compile=True)
    yield llm
    llm.engine.close()


def chunk(start: int, ids: list[int], block: int) -> PlannedChunk:
    return PlannedChunk(start, ids, [block], samples=True)


PLANS = {
    "a prompt of 5 tokens": StepPlan([chunk(0, [5, 17, 42, 8, 99], 1)], num_decodes=0),
    "one decode": StepPlan([chunk(5, [7], 1)], num_decodes=1),
    "three decodes": StepPlan([chunk(6, [9], 1), chunk(3, [4], 2), chunk(2, [11], 3)], num_decodes=3),
    "a prompt of COMPILE_ROWS tokens (eager)": StepPlan([chunk(0, list(range(1, COMPILE_ROWS + 1)), 4)] , 0),
}


def compiled_and_eager(llm, plan: StepPlan, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The plan's logits through the compiled runner and through the eager model, over the same cache (each
    forward writes this step's keys itself), and how many times the compiled forward ran."""
    runner = llm.engine.runner
    compiled, calls = runner.compiled, []
    with monkeypatch.context() as patch:
        patch.setattr(compiled, "forward", lambda *a, _f=compiled.forward: calls.append(1) or _f(*a))
        got = runner.forward(plan)
    with monkeypatch.context() as patch:
        patch.setattr(runner, "compiled", None)
        want = runner.forward(plan)
    return got, want, len(calls)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.02 * scale, ((got - want).abs().max(), scale)


@pytest.mark.parametrize("name", PLANS)
def test_small_steps_run_compiled_and_give_the_eager_logits(compiled_llm, monkeypatch, name):
    plan = PLANS[name]
    got, want, calls = compiled_and_eager(compiled_llm, plan, monkeypatch)
    assert calls == (sum(c.num_tokens for c in plan.chunks) < COMPILE_ROWS)
    assert got.shape == want.shape == (len(plan.logit_rows), 300)
    assert_close(got, want)


def test_two_compiled_engines_in_one_process_each_run_their_own_weights(compiled_llm, tmp_path, monkeypatch):
    """The graphs hold the weights as constants (freezing): a second engine must get graphs of its own, not find
    the first one's (dynamo keeps graphs on the code object, and the guards left do not tell models apart)."""
    from chunkpilot.engine import LLM

    from .tiny_models import make_checkpoint

    other = LLM(str(make_checkpoint(tmp_path / "other", "llama", seed=1)), quantization="int4", max_model_len=64,
                num_kv_blocks=64, enable_prefix_caching=False, threads=2, compile=True)
    try:
        plan = PLANS["one decode"]
        got, want, calls = compiled_and_eager(other, plan, monkeypatch)
        first, _, _ = compiled_and_eager(compiled_llm, plan, monkeypatch)
        assert calls == 1
        assert_close(got, want)
        assert (first - want).abs().max() > 0.1 * want.abs().max()  # the two models do differ
    finally:
        other.engine.close()


def test_a_compiled_engine_generates_without_compiling_in_front_of_requests(compiled_llm):
    """The graphs compiled at start-up cover every decode step: generating compiles nothing more (a recompile
    would take seconds, in front of a request)."""
    from torch._dynamo.utils import counters

    from chunkpilot.engine import SamplingParams

    before = sum(counters["stats"].values()), sum(counters["frames"].values())
    outs = compiled_llm.generate(["the quick brown fox", "paged attention", "a", "b", "c"],
                                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6] * 5
    assert (sum(counters["stats"].values()), sum(counters["frames"].values())) == before, dict(counters)


def test_compile_where_it_cannot_run_is_refused_with_what_to_change(monkeypatch):
    with pytest.raises(CompileError, match="drop --compile"):
        check(torch.device("cuda"), 1)
    with pytest.raises(CompileError, match="one rank"):
        check(torch.device("cpu"), 2)
    check(torch.device("cpu"), 1)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(CompileError, match="install g\\+\\+"):
        check(torch.device("cpu"), 1)
