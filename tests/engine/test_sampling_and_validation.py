"""Sampling features and input validation, on SmolLM2 (one engine for the module) and on the pure parts."""

from __future__ import annotations

import pytest
import torch

from chunkpilot.engine import LLM, SamplingParams
from chunkpilot.engine.execution.kv_cache import KVCache, pool_bytes
from chunkpilot.engine.model.model_config import ModelConfig
from chunkpilot.engine.model.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, dtype="float32", max_model_len=256, token_budget=64, max_chunk=32, max_num_seqs=8)


PROMPT = "Write a list of fruits:"


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    alone = llm.generate(PROMPT, p)[0]
    with_others = llm.generate(["Hello there", PROMPT, "2 + 2 ="], [SamplingParams(max_tokens=5, temperature=1.0), p, SamplingParams(max_tokens=3)])[1]
    assert alone.token_ids == with_others.token_ids
    other_seed = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=99))[0]
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0))[0]
    top1 = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3))[0]
    assert greedy.token_ids == top1.token_ids


def test_tiny_top_p_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0))[0]
    nucleus = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3))[0]
    assert greedy.token_ids == nucleus.token_ids


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
    stop_at = greedy.token_ids[4]
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at]))[0]
    first = greedy.token_ids.index(stop_at)
    assert cut.token_ids == greedy.token_ids[: first + 1] and cut.finish_reason == "stop"


def test_stop_string_cuts_text(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0))[0]
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


def test_logprobs_are_log_probabilities(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5))[0]
    assert len(out.logprobs) == 4
    for lp in out.logprobs:
        assert len(lp.top) == 5
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob <= 0 and abs(lp.logprob - lp.top[0][1]) < 1e-6
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_eos_stops_generation(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.model_config.eos_token_ids


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(max_tokens=-1), "max_tokens", ">= 1"),
        (dict(max_tokens=0), "max_tokens", ">= 1"),
        (dict(top_p=0.0), "top_p", "(0, 1]"),
        (dict(top_p=1.5), "top_p", "(0, 1]"),
        (dict(temperature=-0.1), "temperature", "[0, 2]"),
        (dict(top_k=-2), "top_k", ">= 0"),
        (dict(stop=123), "stop", "string or a list"),
        (dict(stop=[""]), "stop", "non-empty"),
        (dict(stop_token_ids=[-1]), "stop_token_ids", ">= 0"),
        (dict(logprobs=21), "logprobs", "[0, 20]"),
        (dict(seed="x"), "seed", "integer"),
    ],
)
def test_bad_sampling_params_name_the_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value) and allowed in str(err.value)


def test_bad_prompts_are_refused_with_the_reason(llm):
    with pytest.raises(ValueError, match="prompt must be a non-empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt must be a non-empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"max_model_len is 256.*shorten the prompt"):
        llm.generate("word " * 400)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.generate([[1, 2, 10**9]])
    # nothing was queued by the failed calls: the engine still works
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].token_ids


def test_bad_engine_settings_are_refused():
    from chunkpilot.engine import EngineConfig

    with pytest.raises(ValueError, match="max_chunk"):
        EngineConfig(model="x", token_budget=16, max_chunk=32)
    with pytest.raises(ValueError, match="token_budget must be >= max_num_seqs"):
        EngineConfig(model="x", token_budget=8, max_chunk=8, max_num_seqs=16)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="x", dtype="int8")


def test_kv_pool_bytes_formula(smollm2_dir, llm):
    cfg = ModelConfig.from_dir(smollm2_dir)
    cache = llm.engine.kv_cache
    slots = cache.num_blocks * cache.block_size
    expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * slots
    assert cache.nbytes == cache.expected_bytes == pool_bytes(cfg, torch.float32, slots) == expected
    half = KVCache(cfg, 3, 16, torch.bfloat16, torch.device("cpu"))
    assert half.nbytes == 2 * 30 * 3 * 64 * 2 * 48


def test_incremental_detokenizer_holds_back_partial_stop_strings(llm):
    tok = llm.tokenizer
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, stop=["gamma"])
    streamed, hit = "", False
    for t in ids:
        piece, hit = detok.add(t)
        streamed += piece
        if hit:
            break
    assert hit and streamed == "alpha beta " and detok.text == "alpha beta "


def _metaspace_tokenizer(folder, template=None):
    """A SentencePiece-style tokenizer (Metaspace): decoding one token alone drops its leading space."""
    import json as _json

    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁is": 3, "▁Paris": 4, "!": 5}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(_json.dumps({"chat_template": template} if template else {}))
    from chunkpilot.engine.model.tokenizer import Tokenizer

    return Tokenizer(folder)


def test_first_token_keeps_its_leading_space_after_the_prompt(tmp_path):
    tok = _metaspace_tokenizer(tmp_path)
    assert tok.decode([4]) == "Paris"  # alone, the space is gone
    detok = IncrementalDetokenizer(tok, [], prompt_ids=tok.encode("The capital is"))
    assert detok.add(4) == (" Paris", False) and detok.add(5) == ("!", False)
    assert detok.text == " Paris!"


def test_chat_template_errors_become_value_errors(tmp_path):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}x"
    tok = _metaspace_tokenizer(tmp_path, template)
    with pytest.raises(ValueError, match="chat template: Conversation must start with user"):
        tok.encode_chat([{"role": "assistant", "content": "hi"}])


def test_extreme_sampling_values_are_safe(llm):
    vocab = llm.engine.model_config.vocab_size
    for params in (SamplingParams(max_tokens=3, top_k=10 * vocab, seed=1), SamplingParams(max_tokens=3, temperature=1e-45),
                   SamplingParams(max_tokens=3, temperature=1.0, top_p=1e-50, seed=2), SamplingParams(max_tokens=3, seed=-5),
                   SamplingParams(max_tokens=3, seed=2**63 - 1)):
        assert len(llm.generate(PROMPT, params)[0].token_ids) == 3
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=1e-45))[0].token_ids == greedy.token_ids
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\^63, 2\^63\)"):
        SamplingParams(seed=2**64)
