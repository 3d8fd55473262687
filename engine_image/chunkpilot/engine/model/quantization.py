"""Weight-only quantization of the model's linear layers, at load time, from the checkpoint's floating weights.

Decode reads every weight once per step, so bytes per weight decide its speed (vLLM's `--quantization`,
llama.cpp's GGUF k-quants). The layers are quantized after the weights load and computed by PyTorch's own kernels,
never by a float fallback: where a kernel or a shape is missing the engine refuses to start and says what to change.

* `int8`: per output channel, symmetric (w = q * scale), `aten._weight_int8pack_mm` on the CPU.
* `int4`: grouped (GROUP_SIZE weights share a scale and a zero: w = (q - 8) * scale + zero, q in 0..15),
  `aten._weight_int4pack_mm_for_cpu`. The bundled SmolLM2 comes from a Q4_1 GGUF (blocks of 32, w = d * q + m):
  min/max groups of 32 give back those very 4-bit values; what int4 loses on its decoder layers is only the
  scales' and zeros' rounding to bfloat16 (the kernel takes them in the activations' dtype; GGUF keeps float16).
* `fp8`: float8 e4m3 weights per output channel and activations per token, `torch._scaled_mm` (Hopper and
  newer CUDA GPUs).

Both CPU kernels are fast only with bfloat16 activations (with float32 ones they take a path 7-30x slower than a
float32 matmul, measured on a 2-core AVX512-BF16 host): a quantized layer computes in bfloat16 and returns the
model's dtype, so the residual stream, norms, attention and the KV cache keep theirs. The LM head (tied to the
embedding in SmolLM2) is quantized per output channel to int8 under both CPU methods: it is a fifth of the model's
weights, and int4 groups lose more on it (the checkpoint holds it in 8 bits); the embedding lookup stays float.

Large steps (prefill chunks) take another path: the kernels' cost grows with every row, while a bfloat16 GEMM's
barely does (oneDNN's AMX/AVX512-BF16), so from DENSE_ROWS rows a layer dequantizes its weights to bfloat16 for
that one call and runs F.linear (measured on SmolLM2's layers, 2 threads: at 512 rows the int8 kernel takes 2.2x
a float32 GEMM's time, its dequantized bf16 GEMM 0.3x). Nothing dequantized is kept: the memory saved stays saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chunkpilot.contract import engine_settings as defaults

METHODS = defaults.QUANTIZATION_METHODS
GROUP_SIZE = 32  # int4: weights per scale and zero (Q4_1's block; the CPU kernel takes 32, 64, 128 or 256)
INT4_GROUPS = (32, 64, 128, 256)
# rows from which dequantizing to bfloat16 + F.linear beats the kernel: the crossovers measured on 30 copies each
# of SmolLM2's qkv, gate_up and down layers (weights out of cache, as in a step), 2 threads: int8 between 16 and
# 32 rows, int4 at about 128 (its unpacking costs more). Decode batches stay on the kernels.
DENSE_ROWS = {"int8": 32, "int4": 128}
COMPUTE_DTYPE = torch.bfloat16  # what the CPU kernels are fast in
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# the layers of each decoder layer that are quantized (every matmul over the weights; norms stay float)
LAYER_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class QuantizationError(ValueError):
    """A method this engine cannot run here: the message says what to change."""


def _op(name: str):
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        raise QuantizationError(f"this PyTorch ({torch.__version__}) has no aten.{name} kernel: use a PyTorch "
                                "that does (2.6 or newer) or run without --quantization")
    return op


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias, q int8 [out, in], scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self._mm = _op("_weight_int8pack_mm")
        w = weight.detach().float()
        # the scale as the kernel will hold it (bfloat16), and the weights rounded against that very scale: a
        # bfloat16 rounding after the fact would add up to half a step more at the row's largest weights
        scale = (w.abs().amax(1).clamp(min=1e-12) / 127).to(COMPUTE_DTYPE)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("qweight", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(COMPUTE_DTYPE))
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()
        if x2.shape[0] >= DENSE_ROWS["int8"]:  # q is exact in bfloat16 (|q| <= 127); the scale applies per output
            y = F.linear(x2, self.qweight.to(COMPUTE_DTYPE)) * self.scales
        else:
            y = self._mm(x2, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """y = x @ w^T + bias with w = (q - 8) * scale + zero per group of `group` input weights, q in 0..15, packed
    by PyTorch's own layout op (not two plain nibbles a byte)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = GROUP_SIZE) -> None:
        super().__init__()
        out, inp = weight.shape
        if group not in INT4_GROUPS:
            raise QuantizationError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
        if out % 16 or inp % group:
            raise QuantizationError(f"int4 needs a layer's outputs in multiples of 16 and its inputs in groups of "
                                    f"{group}; this model has a {out}x{inp} layer: use --quantization int8")
        self._mm = _op("_weight_int4pack_mm_for_cpu")
        w = weight.detach().float().reshape(out, inp // group, group)
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        # scale and zero (where q = 8 lands: the kernel subtracts 8) as the kernel holds them, in bfloat16, and
        # the weights rounded against those very values
        scale = ((high - low) / 15).clamp(min=1e-12).to(COMPUTE_DTYPE).float()
        zero = (low + 8 * scale).to(COMPUTE_DTYPE).float()
        q = (torch.round((w - zero) / scale) + 8).clamp(0, 15).reshape(out, inp).to(torch.int32).contiguous()
        self.register_buffer("qweight", _op("_convert_weight_to_int4pack_for_cpu")(q, 1))
        # the dense path reads the kernel's packing back; a layout this code does not know keeps the kernel
        q8 = q.to(torch.uint8)
        self.layout = next((layout for layout in INT4_LAYOUTS
                            if (u := _unpack_int4(self.qweight, out, inp, layout)) is not None and torch.equal(u, q8)),
                           None)
        self.unpacks = self.layout is not None
        # [in / group, out, 2]
        self.register_buffer("scales_and_zeros", torch.cat([scale, zero], -1).permute(1, 0, 2)
                             .contiguous().to(COMPUTE_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.detach().to(COMPUTE_DTYPE))
        self.group, self.in_features, self.out_features = group, inp, out

    def dequantized(self) -> torch.Tensor:
        """The float weights the kernel computes with: an identity matrix through the kernel itself."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        sz = self.scales_and_zeros.float()
        return self._mm(eye, self.qweight, self.group, sz).t().contiguous()

    def dense_weight(self) -> torch.Tensor:
        """The bfloat16 weights, unpacked from the kernel's layout: w = q * scale + (zero - 8 * scale) per group,
        one rounding to bfloat16 (the kernel also computes in bfloat16)."""
        q = _unpack_int4(self.qweight, self.out_features, self.in_features, self.layout)
        sz = self.scales_and_zeros.float().permute(1, 0, 2).contiguous()  # [out, in / group, 2]
        scale, zero = sz[..., :1], sz[..., 1:]
        w = torch.addcmul(zero - 8 * scale, q.view(self.out_features, -1, self.group).float(), scale)
        return w.reshape(self.out_features, self.in_features).to(COMPUTE_DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()
        if self.unpacks and x2.shape[0] >= DENSE_ROWS["int4"]:
            y = F.linear(x2, self.dense_weight())
        else:
            y = self._mm(x2, self.qweight, self.group, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


# `_convert_weight_to_int4pack_for_cpu`'s packings (read off PyTorch 2.15 by packing known values): output channels
# in blocks as wide as four of the CPU's float vectors, each block input-major. "half": a byte holds channel j in its
# low nibble and j + block/2 in its high one; "pair": channels 2j and 2j + 1. AVX-512 packs blocks of 64 (halves),
# then one of 32 (pairs); AVX2 blocks of 32 (halves).
INT4_LAYOUTS: tuple[tuple[tuple[int, str], ...], ...] = (((64, "half"), (32, "pair")), ((32, "half"),))


def _unpack_int4(packed: torch.Tensor, out: int, inp: int,
                 layout: tuple[tuple[int, str], ...]) -> torch.Tensor | None:
    """q [out, in] uint8 from a packing of INT4_LAYOUTS; None for shapes outside it (Int4Linear checks the result
    against the values it packed, so a layout this code does not know is never misread, only slower)."""
    flat, parts, at = packed.reshape(-1), [], 0
    for block, nibbles in layout:
        n = (out - sum(p.shape[0] for p in parts)) // block * block
        if not n:
            continue
        b = flat[at : at + n * inp // 2].view(n // block, inp, block // 2)
        at += n * inp // 2
        nib = (torch.cat([b & 15, b >> 4], -1) if nibbles == "half"
               else torch.stack([b & 15, b >> 4], -1).view(n // block, inp, block))
        parts.append(nib.permute(0, 2, 1).reshape(n, inp))
    if at != flat.numel():
        return None
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class Fp8Linear(nn.Module):
    """float8 e4m3 weights per output channel, activations quantized per token at each call, torch._scaled_mm
    (cuBLASLt on Hopper: the second operand column-major, dimensions in multiples of 16), bfloat16 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out, inp = weight.shape
        if out % 16 or inp % 16:
            raise QuantizationError(f"fp8 needs layer sizes in multiples of 16; this model has a {out}x{inp} layer")
        w = weight.detach().float()
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [out, 1]
        self.register_buffer("qweight", (w / scale).to(torch.float8_e4m3fn).contiguous())
        self.register_buffer("scales", scale.t().contiguous())  # [1, out]
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        self.in_features, self.out_features = inp, out

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        pad = (-rows) % 16  # cuBLASLt wants every dimension in multiples of 16
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        sa = x2.abs().amax(1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        y = torch._scaled_mm((x2 / sa).to(torch.float8_e4m3fn), self.qweight.t(), scale_a=sa, scale_b=self.scales,
                             out_dtype=torch.bfloat16)[:rows]
        if self.bias is not None:  # added apart: cuBLASLt takes a bias only with per-tensor scales
            y = y + self.bias
        return y.to(dtype).reshape(*shape[:-1], self.out_features)


@dataclass(frozen=True)
class QuantizedModel:
    """What quantize() did, for the start-up log and /metrics: the method, the layers it replaced and the bytes
    their weights take now against before."""

    method: str
    layers: int
    bytes_before: int
    bytes_after: int


def check(method: str | None, device: torch.device) -> None:
    """Refuse, before any weight loads, a method this device cannot run."""
    if method is None:
        return
    if method not in METHODS:
        raise QuantizationError(f"quantization must be one of {', '.join(METHODS)} (or none), got {method!r}")
    if method == "fp8":
        if device.type != "cuda":
            raise QuantizationError("fp8 runs on CUDA GPUs (Hopper or newer): on the CPU use int8 or int4")
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise QuantizationError(f"fp8 needs compute capability 8.9 or newer (Ada, Hopper); this GPU is "
                                    f"{torch.cuda.get_device_name(device)}: run without --quantization")
        try:  # per-row scales need more than the capability in some PyTorch builds: refuse at start, not mid-request
            Fp8Linear(torch.ones(16, 16, device=device), None)(torch.ones(1, 16, device=device,
                                                                         dtype=torch.bfloat16))
        except RuntimeError as e:
            raise QuantizationError(f"this PyTorch cannot run fp8 per-row scaled matmuls on "
                                    f"{torch.cuda.get_device_name(device)} ({e}): run without --quantization")
    elif device.type != "cpu":
        raise QuantizationError(f"{method} runs on the CPU (PyTorch's packed CPU kernels); on a GPU use fp8")
    else:
        _op("_weight_int8pack_mm" if method == "int8" else "_weight_int4pack_mm_for_cpu")


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _make(method: str, linear: nn.Linear, head: bool = False) -> nn.Module:
    if method == "fp8":
        return Fp8Linear(linear.weight, linear.bias)
    if method == "int8" or head:  # the CPU methods' head is int8 (see the module's docstring)
        return Int8Linear(linear.weight, linear.bias)
    return Int4Linear(linear.weight, linear.bias)


def quantize(model: nn.Module, method: str | None) -> QuantizedModel | None:
    """Replace the decoder layers' linear layers and the LM head of a loaded model by `method`'s. The embedding
    stays float (a tied head gets its own quantized copy)."""
    if method is None:
        return None
    before = after = count = 0
    for layer in model.layers:
        for parent, name in LAYER_LINEARS:
            owner = getattr(layer, parent)
            linear = getattr(owner, name)
            before += _bytes(linear)
            setattr(owner, name, q := _make(method, linear))
            after += _bytes(q)
            count += 1
    head = model.lm_head
    tied = head.weight is model.embed_tokens.weight
    before += 0 if tied else _bytes(head)
    model.lm_head = _make(method, head, head=True)
    after += _bytes(model.lm_head)
    return QuantizedModel(method, count + 1, before, after)
