"""The model's forward compiled by torch.compile (inductor) for small steps, opt-in (`--compile`).

Why: a batch-1 decode of a small quantized model is mostly overhead, not arithmetic. SmolLM2-135M in int4 on 2
cores spent ~5 ms of a 15 ms step in its matmuls and the rest in ~1,200 small eager ops (norms, RoPE, casts,
residual adds) and their Python. Compiled, the step is a few fused C++ loops around each layer's matmuls and its
attention call (the attention is one opaque operator: model/attention_op.py), and with freezing and max-autotune
inductor generates its own weight-only int8/int4 GEMMs (AMX or AVX-512 micro-kernels) fused with the norms that
feed them. Measured in bench/quantization.py.

What compiles: steps of fewer than COMPILE_ROWS tokens (decode batches, drafted decodes, short prompts), with the
token count dynamic, so two graphs (one token, and 2..COMPILE_ROWS-1) cover every decode batch. Larger steps
(prefill chunks) run eager: their GEMMs dominate, and the quantized layers switch to a dense bfloat16 path there
(quantization.DENSE_ROWS). Both graphs compile at start-up (ModelRunner._warm_up), never in front of a request.

What it costs: the compile at every start (about 2 minutes for SmolLM2 on 2 cores; inductor's cache in
TORCHINDUCTOR_CACHE_DIR keeps the C++ kernels and max-autotune's timings, never a graph: see INDUCTOR). The guards
on the model's modules are dropped (the weights never change after load), so a compiled engine must not have its
modules replaced. CPU only, one rank: on CUDA the engine's launches are not yet captured as graphs, and under
tensor parallelism the all-reduces would have to be traced."""

from __future__ import annotations

import os
import shutil
import types

import torch
from torch import nn

COMPILE_ROWS = 32  # = quantization.DENSE_ROWS["int8"]: below it every quantized layer takes its kernel path
# inductor's settings, set around the start-up steps that compile (CompiledForward.compiling) rather than for
# the process; later steps run the graphs without them (setting them costs ~40 us a call, and nothing compiles
# then: tests/engine/test_compiled_forward.py holds a served generate to no compile at all)
INDUCTOR = {
    "freezing": True,  # the weights become constants: inductor may pack them for its own GEMMs
    "max_autotune": True,  # generate and time its C++ GEMM templates against ATen's kernels
    "max_autotune_gemm_backends": "CPP,ATEN",
    # never a compiled graph from inductor's on-disk cache: a frozen graph holds its weights as constants, and
    # the cache finds a graph by its structure, so an engine whose model has the same shapes as one compiled before
    # (another checkpoint of it, a fine-tune) was handed that one's weights (tests/engine/test_compiled_forward.py
    # caught it). The C++ kernels and max-autotune's timings are still cached (they hold no weights).
    "fx_graph_cache": False,
}


class CompileError(ValueError):
    """--compile where this engine cannot compile: the message says what to change."""


def check(device: torch.device, world: int) -> None:
    """Refuse, before any weight loads, a compile that cannot happen here."""
    if device.type != "cpu":
        raise CompileError(f"--compile runs on the CPU; this engine runs on {device}: drop --compile")
    if world > 1:
        raise CompileError("--compile runs with one rank: drop --compile or --tensor-parallel-size")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:  # inductor writes C++ and builds it at start-up
        raise CompileError(f"--compile needs a C++ compiler and {compiler!r} is not on PATH: install g++ (the "
                           "engine images do not carry one) or drop --compile")


class CompiledForward:
    """`model(input_ids, cos, sin)` and `model.logits(hidden)` compiled, for fewer than COMPILE_ROWS rows. The
    LM head is a graph of its own (the forward's rows and the sampled rows differ in number whenever a prompt is
    part of the step): compiled, its int8 GEMM at one row took 1.9 ms against the kernel's 2.6 (SmolLM2's
    49152 x 576 head, weights out of cache)."""

    def __init__(self, model: nn.Module) -> None:
        # the guards on hundreds of parameters and modules cost ~0.7 ms a step; the model never changes after load
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._forward = torch.compile(_own(model, "forward"), dynamic=True, fullgraph=True, options=options)
        self._logits = torch.compile(_own(model, "logits"), dynamic=True, fullgraph=True, options=options)

    @staticmethod
    def covers(rows: int) -> bool:
        return rows < COMPILE_ROWS

    @staticmethod
    def compiling():
        """inductor's settings for the calls that compile (the first ones): it reads them when it compiles, inside
        a call (options= on torch.compile does not reach freezing)."""
        return torch._inductor.config.patch(INDUCTOR)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._forward(input_ids, cos, sin)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits(hidden)


def _own(model: nn.Module, method: str) -> types.MethodType:
    """`model.method` bound to a copy of its function's code. Dynamo keeps compiled graphs on the code object and
    finds them again by their guards, and neither the guards it keeps (the modules' are dropped above) nor a
    tensor's shape tell two models apart: a second compiled engine in the process would run the first one's graph,
    whose frozen constants are the first one's weights. Its own code object gives each engine its own graphs."""
    fn = getattr(type(model), method)
    code = fn.__code__.replace()
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, model)
