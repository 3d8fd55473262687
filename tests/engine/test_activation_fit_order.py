"""The token budget's bound is read from the memory left once every model the engine holds has loaded. A draft
model loads on the model's device after the model: a bound read before it counts the draft's weights and KV pool
as room for activations, and a budget pushed up to that bound runs the GPU out of memory mid-step. The CPU plays
the GPU here: a stand-in answers the engine's free-memory reading, and the draft's memory comes out of it as the
draft loads. (bench/gpu_check.sh's draft_fit step checks the same on a real GPU.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.engine import EngineConfig
from chunkpilot.engine.execution.activation_memory import (CUDA_RESERVE_BYTES, activation_bytes_per_token,
                                                           cuda_headroom, max_token_budget)
from chunkpilot.engine import llm_engine
from chunkpilot.engine.model.model_config import ModelConfig
from chunkpilot.engine.speculation.speculative import SpeculativeConfig

from .tiny_models import make_checkpoint

FIT_WITHOUT_DRAFT = 400  # tokens the stand-in's memory holds before the draft loads; below 4 x 128, so it binds


@pytest.fixture(autouse=True)
def collect_engines():
    """Engines freeze what is alive at their start out of the garbage collector (llm_engine.py): free them."""
    import gc

    yield
    gc.unfreeze()
    gc.collect()


class FakeGPU:
    """The device's free memory as the engine reads it: `free` bytes once the model's weights and KV pool are in,
    less what is loaded since. Every reading is kept, in order."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.readings: list[int] = []

    def __call__(self, device: torch.device) -> int:
        self.readings.append(self.free)
        return self.free

    def hold(self, nbytes: int) -> None:
        self.free -= nbytes


@dataclass(frozen=True)
class DraftOnFakeGPU(SpeculativeConfig):
    """A draft model whose weights and KV pool are taken from `gpu` as it loads, as a GPU's would be."""

    gpu: FakeGPU | None = None


class LLMEngine(llm_engine.LLMEngine):
    """The engine, whose draft model (a DraftOnFakeGPU) holds its memory on the stand-in as it loads."""

    def _proposer(self, spec):
        proposer = super()._proposer(spec)
        if isinstance(spec, DraftOnFakeGPU):
            spec.gpu.hold(sum(m.weight_bytes + m.kv_cache_bytes for m in proposer.engine.rank_memory))
        return proposer


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("fit-order")
    return str(make_checkpoint(root / "model", "llama")), str(make_checkpoint(root / "draft", "llama", seed=1))


def engine_config(model: str, draft_gpu: FakeGPU | None = None, draft: str | None = None, **overrides) -> EngineConfig:
    spec = DraftOnFakeGPU(method="draft_model", model=draft, gpu=draft_gpu) if draft else None
    settings = dict(model=model, dtype="float32", max_model_len=128, max_num_seqs=4, token_budget=64, max_chunk=64,
                    num_kv_blocks=64, speculative_config=spec)
    return EngineConfig(**{**settings, **overrides})


def free_for(model: str, tokens: int) -> int:
    """Free bytes that leave room for `tokens` tokens of the model's activations."""
    return CUDA_RESERVE_BYTES + tokens * activation_bytes_per_token(ModelConfig.from_dir(model), torch.float32)


def test_the_bound_is_read_after_the_draft_model_loads(models):
    model, draft = models
    plain = LLMEngine(engine_config(model), free_memory=FakeGPU(free_for(model, FIT_WITHOUT_DRAFT)))
    assert plain.max_token_budget == FIT_WITHOUT_DRAFT
    plain.close()

    gpu = FakeGPU(free_for(model, FIT_WITHOUT_DRAFT))
    llm = LLMEngine(engine_config(model, gpu, draft), free_memory=gpu)
    assert gpu.free < free_for(model, FIT_WITHOUT_DRAFT)  # the draft took its share
    # the last reading is the memory the draft left, and the bound is what that holds
    assert gpu.readings[-1] == gpu.free
    bound = max_token_budget(llm.model_config, llm.dtype, cuda_headroom(gpu.free))
    assert llm.max_token_budget == bound < FIT_WITHOUT_DRAFT
    # a push (the admin endpoint, the knobs file) goes up to that bound, no further
    llm.knobs.set(SchedulerKnobs(bound, 64, 1))
    with pytest.raises(ValueError, match=f"token_budget must be <= {bound}"):
        llm.knobs.set(SchedulerKnobs(bound + 1, 64, 2))
    assert llm.knobs.get() == SchedulerKnobs(bound, 64, 1)
    llm.close()


def test_a_start_up_budget_the_draft_leaves_no_room_for_is_refused(models):
    """A budget that fits beside the model alone but not beside the model and its draft stops the start."""
    model, draft = models
    budget = FIT_WITHOUT_DRAFT - 8
    free = free_for(model, FIT_WITHOUT_DRAFT)
    LLMEngine(engine_config(model, token_budget=budget), free_memory=FakeGPU(free)).close()
    gpu = FakeGPU(free)
    with pytest.raises(ValueError, match=f"--token-budget {budget} needs about"):
        LLMEngine(engine_config(model, gpu, draft, token_budget=budget), free_memory=gpu)


def test_a_free_memory_stand_in_is_refused_under_tensor_parallelism(models):
    """The other ranks read their own devices: a bound from rank 0's stand-in alone could not be agreed."""
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLMEngine(engine_config(models[0], tensor_parallel_size=2), free_memory=FakeGPU(0))
