"""Token budgets are bounded by what the device's memory holds: the engine refuses larger ones in the knobs file
and keeps the last good knobs, instead of running the GPU out of memory in the step loop."""

from __future__ import annotations

import pytest
import torch

from chunkpilot.engine import EngineConfig
from chunkpilot.engine.execution.activation_memory import activation_bytes_per_token, cuda_headroom, max_token_budget
from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.engine.llm_engine import LLMEngine
from chunkpilot.engine.model.model_config import ModelConfig

from .tiny_models import make_checkpoint

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


def test_the_bound_follows_the_model_and_the_memory_left(tmp_path):
    (tmp_path / "config.json").write_text(__import__("json").dumps(LLAMA3_8B))
    cfg = ModelConfig.from_dir(tmp_path)
    per_token = activation_bytes_per_token(cfg, torch.bfloat16)
    assert 150 * 2**10 < per_token < 400 * 2**10  # a few hundred KiB per token for an 8B model in bf16
    free = 8 * 2**30  # an 80 GB card at gpu_memory_utilization 0.9, after weights and KV cache
    fits = max_token_budget(cfg, torch.bfloat16, cuda_headroom(free))
    assert 8192 < fits < 65536  # the usual budgets fit; a million-token budget does not
    assert max_token_budget(cfg, torch.bfloat16, cuda_headroom(free // 4)) < fits
    assert max_token_budget(cfg, torch.bfloat16, cuda_headroom(0)) == 0


def test_budgets_over_the_engines_bound_are_refused_and_the_knobs_stay(tmp_path):
    model = make_checkpoint(tmp_path / "tiny", "llama")
    llm = LLMEngine(EngineConfig(model=str(model), max_model_len=128, max_num_seqs=4, token_budget=64,
                                 max_chunk=64, max_token_budget=256))
    assert llm.max_token_budget == 256
    llm.knobs.set(SchedulerKnobs(256, 64, 1))
    with pytest.raises(ValueError, match="token_budget must be <= 256"):
        llm.knobs.set(SchedulerKnobs(100_000, 64, 2))
    assert llm.knobs.get() == SchedulerKnobs(256, 64, 1)
    # without the setting: every running sequence's whole context, at most
    assert LLMEngine(EngineConfig(model=str(model), max_model_len=128, max_num_seqs=4, token_budget=64,
                                  max_chunk=64)).max_token_budget == 4 * 128
    with pytest.raises(ValueError, match="max_token_budget"):
        EngineConfig(model=str(model), token_budget=512, max_token_budget=64)
