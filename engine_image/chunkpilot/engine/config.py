"""Engine settings, validated once at start-up: every settings type of the engine lives here.

The bottom of the engine: every module may read its settings from here, so this one imports nothing of the engine
above it (tests/engine/test_layers.py holds it to that)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from chunkpilot.contract import engine_settings as defaults
from chunkpilot.contract.engine_settings import default as setting_default
from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.contract.slo import SLOClasses

DTYPES = ("float32", "bfloat16", "float16", "auto")
SPECULATIVE_METHODS = defaults.SPECULATIVE_METHODS
MAX_SPECULATIVE_TOKENS = defaults.MAX_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings (vLLM's `--speculative-config`): which proposer drafts tokens and how many a
    decode may verify in one step (speculation/speculative.py builds the proposer from them)."""

    method: str = "ngram"  # or "draft_model": a smaller model with the same tokenizer (speculation/draft_model.py)
    model: str | None = None  # the draft model's folder (vLLM's field; setting it alone means draft_model)
    num_speculative_tokens: int = defaults.NUM_SPECULATIVE_TOKENS
    prompt_lookup_min: int = defaults.PROMPT_LOOKUP[0]  # the n-gram lookup's shortest and longest context
    prompt_lookup_max: int = defaults.PROMPT_LOOKUP[1]
    # no drafts in a step with more decodes than this (vLLM's name): verification rows cost more in larger
    # batches, where a text that does not repeat itself can make drafting a loss; None: never
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method draft_model needs "model": the draft model\'s folder, a smaller '
                             "model with the same tokenizer")
        if self.method != "draft_model" and self.model:
            raise ValueError(f'speculative "model" is for method draft_model, not {self.method!r}: drop one of them')
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"disable_by_batch_size must be an integer >= 1 or null, got {self.disable_by_batch_size!r}")
        if not (isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
                and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, got "
                             f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")

    @classmethod
    def parse(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """vLLM's JSON form, e.g. '{"method": "ngram", "num_speculative_tokens": 3}'; None, "" or "none": off."""
        if text is None or (isinstance(text, str) and text.strip().lower() in ("", "none")):
            return None
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config must be JSON such as '{{\"method\": \"ngram\", "
                                 f"\"num_speculative_tokens\": 3}}': {e}") from None
        if not isinstance(text, dict):
            raise ValueError("speculative config must be a JSON object")
        unknown = set(text) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"speculative config: unknown field(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        if text.get("model") and "method" not in text:
            text = {**text, "method": "draft_model"}  # as vLLM: a draft model named is the method
        return cls(**text)


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
    attention_backend: str = setting_default("attention_backend")  # auto | sdpa | varlen (see model/attention.py)
    # Largest token budget the knobs file may set. None: what the device's memory allows
    # (execution/activation_memory.py), at most max_num_seqs x max_model_len.
    max_token_budget: int | None = setting_default("max_token_budget")
    # Ranks (GPUs) one engine splits the model across; the engine starts ranks 1..N-1 itself (execution/tp_worker.py).
    tensor_parallel_size: int = setting_default("tensor_parallel_size")
    # Seconds a collective between ranks may take before the engine gives up on a hung rank and exits non-zero
    # (longer than the slowest step), and how long the ranks may take to load their weights and meet.
    tensor_parallel_timeout: float = setting_default("tensor_parallel_timeout")
    tensor_parallel_join_timeout: float = 1800.0
    # Weight-only quantization of the linear layers at load time (model/quantization.py): int8 | int4 (CPU) | fp8 (CUDA)
    quantization: str | None = setting_default("quantization")
    # Speculative decoding (SpeculativeConfig above; speculation/speculative.py builds its proposer): vLLM's
    # --speculative-config, as JSON or parsed; None: off
    speculative_config: SpeculativeConfig | str | dict | None = setting_default("speculative_config")
    # Compile the forward of small steps (decodes) with torch.compile at start-up (execution/compiled_forward.py);
    # CPU only
    compile: bool = setting_default("compile")
    # Per-request SLO classes (docs/slo-classes.md): --slo-classes JSON or parsed; None: one implicit class
    slo_classes: SLOClasses | str | None = setting_default("slo_classes")

    def __post_init__(self) -> None:
        if isinstance(self.slo_classes, str):
            self.slo_classes = SLOClasses.from_json(self.slo_classes) if self.slo_classes.strip() else None
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


@dataclass
class SchedulerConfig:
    """What the scheduler is given at start-up beside its knobs: derived from EngineConfig and the model (the
    engine's context length, its EOS ids), or set directly where the simulator drives the scheduler."""

    max_num_seqs: int = 64
    max_model_len: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    # Per-request SLO classes (docs/slo-classes.md); None or one class: first come first served, as without them
    classes: SLOClasses | None = None
