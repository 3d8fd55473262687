"""Random tiny Llama/Mistral/Qwen2 checkpoints made by transformers: the engine's logprobs must match
transformers' logits, chunked prefill must match one-shot prefill, in both config.json styles."""

from __future__ import annotations

import shutil

import pytest
import torch

from chunkpilot.engine import LLM, SamplingParams

from .tiny_models import TEXTS, _to_transformers4_style, make_checkpoint

ARCHS = ["llama", "llama3", "mistral", "qwen2"]
PROMPTS = [TEXTS[0][:9], " ".join(TEXTS), " ".join(TEXTS * 3)]
TOL = 2e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        modern = make_checkpoint(root / arch, arch, sharded=arch == "llama")
        legacy = root / f"{arch}-legacy"
        shutil.copytree(modern, legacy)
        _to_transformers4_style(legacy / "config.json")
        out[arch] = (modern, legacy)
    return out


def generate(folder, **settings):
    llm = LLM(str(folder), dtype=settings.pop("dtype", "float32"), block_size=4, max_num_seqs=4,
              num_kv_blocks=256, **settings)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    return llm, llm.generate(PROMPTS, params)


def hf_logprobs(folder, prompt_ids, out_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    return lp[n - 1 : n - 1 + len(out_ids)]


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_and_chunking_changes_nothing(checkpoints, arch):
    modern, legacy = checkpoints[arch]
    _, one_shot = generate(modern, token_budget=512, max_chunk=512)
    _, chunked = generate(modern, token_budget=8, max_chunk=3)
    _, legacy_out = generate(legacy, token_budget=16, max_chunk=7, enable_prefix_caching=False)
    for a, b, c in zip(one_shot, chunked, legacy_out):
        assert len(a.prompt_token_ids) > 0 and len(a.token_ids) == 12
        assert a.token_ids == b.token_ids == c.token_ids
        for x, y, z in zip(a.logprobs, b.logprobs, c.logprobs):
            assert abs(x.logprob - y.logprob) < TOL and abs(x.logprob - z.logprob) < TOL
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
        ref = hf_logprobs(modern, a.prompt_token_ids, a.token_ids)
        for step, lp in enumerate(a.logprobs):
            assert int(ref[step].argmax()) == lp.token_id, f"step {step}: transformers' greedy choice differs"
            assert abs(float(ref[step, lp.token_id]) - lp.logprob) < TOL
            top_ref = ref[step].topk(3)
            assert torch.allclose(top_ref.values, torch.tensor([v for _, v in lp.top]), atol=TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(checkpoints, dtype):
    modern, _ = checkpoints["llama"]
    _, ref = generate(modern, token_budget=64, max_chunk=64)
    llm, half = generate(modern, token_budget=64, max_chunk=64, dtype=dtype)
    assert llm.engine.kv_cache.tensor.dtype == getattr(torch, dtype)
    # Half precision may flip a close greedy choice later on; the first token's logprob must be close.
    for a, b in zip(ref, half):
        assert len(b.token_ids) == 12
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.1


def test_sharded_checkpoint_is_read(checkpoints):
    modern, _ = checkpoints["llama"]
    assert (modern / "model.safetensors.index.json").is_file()


def test_a_closed_engine_in_a_reference_cycle_is_collected(tmp_path):
    """An engine freezes the objects alive at its start (itself included) out of the garbage collector; closed,
    it must hand them back, or an engine in a reference cycle (a test's patched step) keeps its KV pool for good."""
    import gc
    import weakref

    llm = LLM(str(make_checkpoint(tmp_path / "tiny", "llama")), max_model_len=64, num_kv_blocks=8)
    engine = llm.engine
    engine.cycle = engine
    gone = weakref.ref(engine)
    engine.close()
    del llm, engine
    gc.collect()
    assert gone() is None
