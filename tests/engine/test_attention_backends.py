"""The two attention backends agree.

`varlen` calls torch's FlashAttention `varlen_attn`, which runs only on CUDA. On the CPU the test swaps in a
plain-PyTorch implementation of that function's documented contract (packed queries, paged K/V through a block
table, `seqused_k`, bottom-right causal mask), so what is tested here is our metadata (offsets, lengths, block
table, slot mapping). The kernel itself is checked against sdpa at engine start-up (`choose_backend`), and by the
CUDA test below where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.varlen as varlen_module

from chunkpilot.engine import LLM, SamplingParams
from chunkpilot.engine.model import attention

from .tiny_models import TEXTS, make_checkpoint

PROMPTS = [TEXTS[0][:5], " ".join(TEXTS), " ".join(TEXTS * 2)]


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False, seqused_k=None, block_table=None, num_splits=None, return_aux=None):
    out = torch.empty_like(query)
    page = key.shape[1]
    for i in range(len(seqused_k)):
        q = query[cu_seq_q[i] : cu_seq_q[i + 1]]
        n_q, n_k = q.shape[0], int(seqused_k[i])
        pages = block_table[i][: -(-n_k // page)].long()
        k = key[pages].reshape(-1, *key.shape[2:])[:n_k]
        v = value[pages].reshape(-1, *value.shape[2:])[:n_k]
        causal = tuple(window_size) == (-1, 0)
        mask = torch.ones(n_q, n_k, dtype=torch.bool)
        if causal:  # bottom-right aligned: the last query sees every key
            mask = torch.arange(n_k)[None, :] <= (n_k - n_q + torch.arange(n_q))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            scale=scale, enable_gqa=enable_gqa,
        )
        out[cu_seq_q[i] : cu_seq_q[i + 1]] = o[0].transpose(0, 1)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def run(folder, backend, **settings):
    llm = LLM(str(folder), dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=4, attention_backend="sdpa", **settings)
    llm.engine.runner.backend = backend  # on the CPU only sdpa can be chosen at start-up
    return llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True))


def test_varlen_metadata_matches_sdpa(tiny, monkeypatch):
    monkeypatch.setattr(varlen_module, "varlen_attn", reference_varlen_attn)
    for settings in (dict(token_budget=8, max_chunk=3), dict(token_budget=256, max_chunk=256)):
        a = run(tiny, "sdpa", **settings)
        b = run(tiny, "varlen", **settings)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert all(abs(p.logprob - q.logprob) < 1e-4 for p, q in zip(x.logprobs, y.logprobs))


def test_self_check_accepts_a_correct_kernel_and_rejects_a_wrong_one(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(varlen_module, "varlen_attn", reference_varlen_attn)
    assert attention._self_check(cpu, torch.float32, 16)

    def not_causal(*args, **kwargs):
        kwargs["window_size"] = (-1, -1)
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen_module, "varlen_attn", not_causal)
    assert not attention._self_check(cpu, torch.float32, 16)


def test_backend_choice_on_cpu():
    cpu = torch.device("cpu")
    assert attention.choose_backend("auto", cpu, torch.float32, 16) == "sdpa"
    assert attention.choose_backend("sdpa", cpu, torch.float32, 16) == "sdpa"
    with pytest.raises(ValueError, match="varlen is not usable here: it needs a CUDA device"):
        attention.choose_backend("varlen", cpu, torch.float32, 16)


def test_a_cuda_device_is_always_indexed(monkeypatch):
    """`--device cuda` (the chart's default on a GPU node) must name an index: torch.cuda.set_device refuses a bare
    "cuda", and every engine start failed on the first real GPU run."""
    from chunkpilot.engine.execution.worker import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda", rank=1, world=2) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_cudnn_attention_is_switched_off_for_cuda_engines():
    """cuDNN's SDPA cost 1-6 ms of CPU a call on an H200 (a plan per key length): the engine turns it off."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention.configure_cuda_sdpa()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.gpu
def test_cuda_backends_agree(tiny):
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device: run them with `pytest -m gpu` on a GPU machine"
    outs = {}
    for backend in ("sdpa", "auto"):
        llm = LLM(str(tiny), dtype="bfloat16", device="cuda", block_size=16, num_kv_blocks=64, max_num_seqs=4,
                  attention_backend=backend)
        outs[backend] = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        print(backend, "->", llm.engine.attention_backend)
    # bfloat16 kernels differ in rounding: the first tokens must agree
    assert [o.token_ids[:3] for o in outs["sdpa"]] == [o.token_ids[:3] for o in outs["auto"]]


def test_contiguous_blocks_shortcut_matches_the_gather(tiny):
    """A lone sequence on consecutive blocks reads its keys as a slice of the pool; on scattered blocks it
    gathers them. Both must give the same logprobs."""
    from collections import OrderedDict

    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = []
    for scatter in (False, True):
        llm = LLM(str(tiny), dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=1, token_budget=8,
                  max_chunk=8)
        if scatter:  # hand out blocks in descending order: no sequence is ever contiguous
            llm.engine.block_manager._free = OrderedDict((b, None) for b in reversed(range(128)))
        outs.append(llm.generate(PROMPTS[1], params)[0])
    assert outs[0].token_ids == outs[1].token_ids
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(outs[0].logprobs, outs[1].logprobs))


def test_decode_groups_by_context_length_change_nothing(tiny, monkeypatch):
    """Decodes are split into groups of similar context length (each pads only to its own longest context), and
    long prefill chunks run as groups of their own. Every decode and chunk alone, and all decodes in one group and
    all chunks in another, must give the same logprobs; the prompts differ in length so the groups differ in
    context length and batch position."""
    from chunkpilot.engine.execution import model_runner

    prompts = [" ".join(TEXTS * k) for k in (1, 2, 3, 4)] + [TEXTS[0][:5], TEXTS[3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    outs, groups_seen = [], []
    for cost in (0, 10**9):
        monkeypatch.setattr(model_runner, "GROUP_COST_SLOTS", cost)
        monkeypatch.setattr(model_runner, "SOLO_CHUNK", 1 if cost == 0 else cost)
        llm = LLM(str(tiny), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, token_budget=512,
                  max_chunk=512)
        runner = llm.engine.runner
        original = runner._metadata

        def spy(chunks, num_decodes, positions, original=original):
            meta = original(chunks, num_decodes, positions)
            groups_seen.append((cost, num_decodes, len(chunks), len(meta.groups)))
            return meta

        runner._metadata = spy
        outs.append(llm.generate(prompts, params))
    split = [(d, n, g) for c, d, n, g in groups_seen if c == 0]
    assert max(g for d, n, g in split if d == n) > 2  # decodes really were split
    assert any(d == 0 and g == n > 1 for d, n, g in split)  # every prompt chunk alone
    assert all(g <= 2 for c, d, n, g in groups_seen if c > 0)  # one decode group, one prefill group
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert all(abs(x.logprob - y.logprob) < 1e-5 for x, y in zip(a.logprobs, b.logprobs))


def test_split_by_context_covers_every_decode_once_and_never_costs_more():
    from chunkpilot.engine.execution.model_runner import split_by_context

    lengths = [20, 560, 300, 40, 550, 33, 290, 300]
    for cost in (0, 64, 256, 10**9):
        groups = split_by_context(lengths, 16, cost)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(g == sorted(g) for g in groups)  # step order inside a group

        def padded(g):
            return cost + len(g) * -(-max(lengths[i] for i in g) // 16) * 16

        assert sum(padded(g) for g in groups) <= padded(list(range(len(lengths))))
    assert len(split_by_context(lengths, 16, 10**9)) == 1
    # free groups: one per distinct length in whole blocks (32, 48, 304, 560 slots)
    assert split_by_context(lengths, 16, 0) == [[1, 4], [2, 6, 7], [3, 5], [0]]
    assert split_by_context([], 16) == []
