"""Weight-only quantization (chunkpilot.engine.model.quantization): each layer computes what its dequantized weights
say, through PyTorch's own kernels; a method the device or the shapes cannot run is refused with what to change;
and on SmolLM2 the quantized engine's perplexity (its own forward, chunked, on a text the project ships) and its
greedy agreement with float32 stay within the issue's bounds, with the tuner-facing settings unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chunkpilot.engine import EngineConfig
from chunkpilot.engine.model.perplexity import greedy_agreement
from chunkpilot.engine.model.quantization import (COMPUTE_DTYPE, DENSE_ROWS, Fp8Linear, Int4Linear, Int8Linear,
                                                  QuantizationError, check, quantize)

SHAPES = [(1536, 576), (576, 1536), (960, 576)]  # SmolLM2's gate/up, down and fused qkv


def bf16_reference(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """What the kernels compute: bfloat16 activations against the dequantized weights, in float32."""
    return F.linear(x.to(COMPUTE_DTYPE).float(), w, None if bias is None else bias.to(COMPUTE_DTYPE).float())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 16, 128])  # the kernel, then the dequantized GEMM of large steps
def test_int8_layer_computes_its_dequantized_weights(shape, rows):
    torch.manual_seed(0)
    w, b = torch.randn(shape) * 0.05, torch.randn(shape[0]) * 0.1
    layer = Int8Linear(w, b)
    dq = layer.dequantized()
    # per output channel: every weight within half a step of its row's scale (rounded against the scale as held)
    step = layer.scales.float()[:, None]
    assert ((dq - w).abs() <= 0.501 * step).all()
    x = torch.randn(rows, shape[1])
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
    ref = bf16_reference(x, dq, b)
    assert (y - ref).abs().max() <= 0.02 * ref.abs().max(), (y - ref).abs().max()
    assert layer.qweight.dtype == torch.int8  # one byte a weight, none float


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_int4_layer_computes_its_dequantized_weights(shape, rows):
    torch.manual_seed(1)
    w = torch.randn(shape) * 0.05
    layer = Int4Linear(w, None)
    dq = layer.dequantized()
    groups = w.reshape(shape[0], -1, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, 1)
    # half a step, the zero's rounding to bfloat16 aside (a group's end weights can sit that much past 0 or 15)
    assert ((dq - w).abs() <= 0.51 * step + 2 ** -8 * w.abs().amax(1, keepdim=True)).all()
    x = torch.randn(rows, shape[1])
    ref = bf16_reference(x, dq)
    assert (layer(x) - ref).abs().max() <= 0.02 * ref.abs().max()
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.numel() == w.numel() // 2  # half a byte a weight


@pytest.mark.parametrize("shape", [*SHAPES, (96, 64), (48, 64)])
def test_int4_large_steps_read_the_kernels_packing_back_or_keep_the_kernel(shape):
    """Large steps unpack PyTorch's int4 layout to bfloat16 weights; a layout this code does not read (48 outputs:
    blocks of 64 and 32 do not cover it) keeps the kernel, never a misread weight."""
    torch.manual_seed(3)
    w = torch.randn(shape) * 0.05
    layer = Int4Linear(w, None)
    assert layer.unpacks == (shape[0] % 32 == 0)
    if layer.unpacks:
        assert torch.equal(layer.dense_weight().float(), layer.dequantized().to(COMPUTE_DTYPE).float())
    x = torch.randn(DENSE_ROWS["int4"], shape[1])
    ref = bf16_reference(x, layer.dequantized())
    assert (layer(x) - ref).abs().max() <= 0.02 * ref.abs().max()


def test_int4_gives_back_a_q4_1_checkpoints_values():
    """SmolLM2 ships as Q4_1 (blocks of 32, w = d * q + m): min/max groups of 32 find those very levels."""
    torch.manual_seed(2)
    n, k = 64, 128
    d = torch.rand(n, k // 32, 1) * 0.01 + 1e-3
    m = -torch.rand(n, k // 32, 1) * 0.05
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # each block uses its whole range, as a min/max quantizer's blocks do
    w = (d * q + m).reshape(n, k)
    dq = Int4Linear(w, None).dequantized()
    # exact but for the scale and zero in bfloat16 (8 bits of mantissa)
    assert (dq - w).abs().max() <= 15 * d.max() * 2 ** -8 + m.abs().max() * 2 ** -8


def test_a_method_the_device_or_shapes_cannot_run_is_refused_with_what_to_change():
    with pytest.raises(QuantizationError, match="on the CPU use int8 or int4"):
        check("fp8", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="must be one of"):
        check("int3", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="use --quantization int8"):
        Int4Linear(torch.randn(24, 64), None)  # 24 outputs: not a multiple of 16
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8 or none"):
        EngineConfig(model="m", quantization="awq")
    assert EngineConfig(model="m", quantization="none").quantization is None
    check("int8", torch.device("cpu")) or check("int4", torch.device("cpu"))  # the kernels exist here
    # one list of methods: the CRD's field takes them and none, nothing else
    from typing import get_args

    from chunkpilot.api.types import ModelSpec
    from chunkpilot.contract.engine_settings import QUANTIZATION_METHODS
    assert set(get_args(ModelSpec.model_fields["quantization"].annotation)) == {"none", *QUANTIZATION_METHODS}


def test_quantize_replaces_every_linear_layer_and_keeps_the_embedding():
    from chunkpilot.engine.model.llama import LlamaModel
    from chunkpilot.engine.model.model_config import ModelConfig

    torch.manual_seed(3)
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": True})
    model = LlamaModel(cfg)
    embedding = model.embed_tokens.weight.detach().clone()
    report = quantize(model, "int4")
    assert report.layers == 2 * 4 + 1 and report.bytes_after < report.bytes_before / 3
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)  # the head in int8 under both CPU methods
    assert torch.equal(model.embed_tokens.weight, embedding)


# -- SmolLM2, the engine as it serves ---------------------------------------------------------------------------

# the text: a frozen copy of the project's architecture page (shipped with it, not used by the parity tests)
TEXT = Path(__file__).resolve().parents[2] / "bench" / "data" / "quality_text.md"
TOKENS = 512
PROMPTS = ["The history of the printing press", "def merge_sort(values):\n    ", "Photosynthesis is the process",
           "A haiku about autumn rain:\n"]
NEW = 24
# the issue's bounds: perplexity at most 2 % (int8) and 8 % (int4) above float32's
BOUNDS = {"int8": 1.02, "int4": 1.08}


@pytest.fixture(scope="module")
def float32_figures(smollm2_dir):
    return figures(smollm2_dir, None)


def figures(model_dir: str, method: str | None) -> dict:
    from chunkpilot.engine import LLM, SamplingParams
    from chunkpilot.engine.model.perplexity import perplexity

    llm = LLM(model_dir, quantization=method, token_budget=128, max_chunk=128, max_num_seqs=4, threads=2,
              enable_prefix_caching=False, max_model_len=1024)
    try:
        ids = llm.tokenizer.encode(TEXT.read_text())[:TOKENS]
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0))
        return {"perplexity": perplexity(llm, ids), "tokens": [o.token_ids for o in outs],
                "weights": llm.engine.worker.memory.weight_bytes}
    finally:
        llm.engine.close()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_smollm2_perplexity_and_greedy_agreement(smollm2_dir, float32_figures, method):
    q = figures(smollm2_dir, method)
    ratio = q["perplexity"] / float32_figures["perplexity"]
    print(f"{method}: perplexity {q['perplexity']:.3f} vs float32 {float32_figures['perplexity']:.3f} "
          f"({ratio:.4f}x); greedy agreement {greedy_agreement(q['tokens'], float32_figures['tokens']):.0%}")
    assert 1 < float32_figures["perplexity"] < 100  # a real model on real text
    assert ratio <= BOUNDS[method], ratio
    # greedy outputs part at the first near-tie and differ after it: agreement is reported (here and in
    # bench/quantization.py), not bounded; a broken layer shows in the perplexity above, and in output that is
    # no longer text
    text = [t for t in q["tokens"] if len(t) == NEW]
    assert len(text) == len(PROMPTS) and all(len(set(t)) > 3 for t in text), q["tokens"]
    # the memory the engine accounts for its weights is what the quantized layers hold (buffers, not parameters)
    assert q["weights"] < 0.75 * float32_figures["weights"], (q["weights"], float32_figures["weights"])


@pytest.mark.gpu
def test_fp8_layer_on_a_hopper_gpu_computes_its_dequantized_weights():
    """float8 e4m3 keeps 3 bits of mantissa: each product is within about 6 %, a row's sum within a few % of its
    norm. Rows not a multiple of 16 are padded for cuBLASLt and cut back."""
    dev = torch.device("cuda")
    check("fp8", dev)
    torch.manual_seed(4)
    w, b = torch.randn(4096, 4096, device=dev) * 0.02, torch.randn(4096, device=dev) * 0.1
    layer = Fp8Linear(w, b)
    assert layer.qweight.dtype == torch.float8_e4m3fn
    assert (layer.dequantized() - w).norm() / w.norm() < 0.05
    for rows in (1, 16, 100):
        x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
        y = layer(x)
        ref = F.linear(x.float(), layer.dequantized(), b)
        assert y.shape == (rows, 4096) and y.dtype == torch.bfloat16
        assert (y.float() - ref).norm() / ref.norm() < 0.05, rows
