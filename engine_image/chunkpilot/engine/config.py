"""Engine settings, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.contract import engine_settings as defaults
from chunkpilot.contract.engine_settings import default as setting_default
from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.engine.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class EngineConfig:
    model: str
    # "auto": the checkpoint's dtype on GPU, float32 on CPU (CPU half-precision GEMMs are slow)
    dtype: str = setting_default("dtype")
    device: str = setting_default("device")  # "auto": cuda if available, else cpu
    token_budget: int = defaults.TOKEN_BUDGET
    max_chunk: int = defaults.MAX_CHUNK
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    # default: the model's max_position_embeddings, capped at 8192
    max_model_len: int | None = setting_default("max_model_len")
    block_size: int = setting_default("block_size")
    num_kv_blocks: int | None = None  # explicit pool size; else from kv_cache_memory
    kv_cache_memory_gb: float | None = setting_default("kv_cache_memory_gb")  # CPU: bytes for the pool (default 1 GB)
    # GPU: fraction of total memory for weights + pool
    gpu_memory_utilization: float = setting_default("gpu_memory_utilization")
    enable_prefix_caching: bool = setting_default("enable_prefix_caching")
    seed: int = setting_default("seed")
    threads: int | None = setting_default("threads")  # torch intra-op threads on CPU
    attention_backend: str = setting_default("attention_backend")  # auto | sdpa | varlen (see attention.py)
    # Largest token budget the knobs file may set. None: what the device's memory allows (activation_memory.py),
    # at most max_num_seqs x max_model_len.
    max_token_budget: int | None = setting_default("max_token_budget")
    # Ranks (GPUs) one engine splits the model across; the engine starts ranks 1..N-1 itself (tp_worker.py).
    tensor_parallel_size: int = setting_default("tensor_parallel_size")
    # Seconds a collective between ranks may take before the engine gives up on a hung rank and exits non-zero
    # (longer than the slowest step), and how long the ranks may take to load their weights and meet.
    tensor_parallel_timeout: float = setting_default("tensor_parallel_timeout")
    tensor_parallel_join_timeout: float = 1800.0
    # Weight-only quantization of the linear layers at load time (quantization.py): int8 | int4 (CPU) | fp8 (CUDA)
    quantization: str | None = setting_default("quantization")
    # Speculative decoding (speculative.py): vLLM's --speculative-config, as JSON or parsed; None: off
    speculative_config: SpeculativeConfig | str | dict | None = setting_default("speculative_config")
    # Compile the forward of small steps (decodes) with torch.compile at start-up (compiled_forward.py); CPU only
    compile: bool = setting_default("compile")

    def __post_init__(self) -> None:
        if not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("token_budget", "max_chunk", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_token_budget is not None and (not isinstance(self.max_token_budget, int)
                                                  or self.max_token_budget < self.token_budget):
            raise ValueError(f"max_token_budget ({self.max_token_budget}) must be an integer >= token_budget "
                             f"({self.token_budget})")
        # the knobs' own rules (the chunk within the budget, a budget token for every running sequence): the
        # contract's one validation, the same the knobs file and the operator's spec go through
        SchedulerKnobs(self.token_budget, self.max_chunk).validated(min_token_budget=self.max_num_seqs)
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization is not None and self.quantization not in defaults.QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(defaults.QUANTIZATION_METHODS)} or none, got "
                             f"{self.quantization!r}")
        if self.attention_backend not in ("auto", "sdpa", "varlen"):
            raise ValueError(f"attention_backend must be auto, sdpa or varlen, got {self.attention_backend!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        for name in ("tensor_parallel_timeout", "tensor_parallel_join_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
