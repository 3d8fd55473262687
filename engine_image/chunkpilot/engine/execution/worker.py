"""One rank's share of the engine: its device, its model shard, its KV pool and the runner that drives them.

Rank 0 builds one inside `LLMEngine` (which adds the scheduler, the sampler and the requests); under tensor
parallelism every other rank builds the same in its own process (tp_worker.py). The sizes every rank must share
(KV blocks, the attention backend, the token budget the memory allows) are agreed as the smallest over the ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.execution import compiled_forward
from chunkpilot.engine.execution.activation_memory import cuda_headroom, device_free_memory, max_token_budget
from chunkpilot.engine.execution.kv_cache import KVCache, blocks_for_memory
from chunkpilot.engine.execution.model_runner import ModelRunner
from chunkpilot.engine.execution.sampler import Sampler
from chunkpilot.engine.model import quantization
from chunkpilot.engine.model.attention import choose_backend, configure_cuda_sdpa
from chunkpilot.engine.model.llama import LlamaModel
from chunkpilot.engine.model.model_config import ModelConfig
from chunkpilot.engine.model.tp_shard import shard_of
from chunkpilot.engine.model.weights import load_weights
from chunkpilot.engine.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0, world: int = 1) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    if name.startswith("cuda") and world > 1:
        if name != "cuda":
            raise ValueError(f"device {name} names one GPU, but tensor_parallel_size {world} needs {world}: use "
                             "--device cuda (rank r runs on cuda:r of the visible GPUs)")
        if torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs but torch sees "
                             f"{torch.cuda.device_count()}: request {world} GPUs for the pod or lower it")
        return torch.device("cuda", rank)
    if name == "cuda":  # the first visible GPU: torch.cuda.set_device and mem_get_info want an index ("cuda"
        return torch.device("cuda", 0)  # alone fails every start on a real GPU)
    return torch.device(name)


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(model_cfg.dtype, torch.bfloat16)
    return _DTYPES[name]


def resolve_max_model_len(config: EngineConfig, model_cfg: ModelConfig) -> int:
    return config.max_model_len or min(model_cfg.max_position_embeddings, 8192)


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes: its weights (about 1/N of the model) and its KV pool."""

    rank: int
    weight_bytes: int
    kv_cache_bytes: int

    def values(self) -> list[int]:
        """As sent to rank 0 (TPGroup.gather_ints); RankMemory(*values) reads it back."""
        return [self.rank, self.weight_bytes, self.kv_cache_bytes]


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, group: TPGroup, store=None,
                 check=None, free_memory: Callable[[torch.device], int | None] = device_free_memory) -> None:
        """`store`: the group's rendezvous (tensor parallelism); `check()` may raise while this rank waits for the
        others to load (rank 0: a worker died meanwhile); `free_memory(device)`: the bytes free on the device,
        None where its memory bounds no token budget."""
        self.config = config
        self._free_memory = free_memory
        self.model_config = model_config
        self.group = group
        self.device = resolve_device(config.device, group.rank, group.world)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            configure_cuda_sdpa()
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        quantization.check(config.quantization, self.device)  # before any weight loads
        if config.compile:
            compiled_forward.check(self.device, group.world)
        self.max_model_len = resolve_max_model_len(config, model_config)
        self.shard = shard_of(model_config, group.rank, group.world)
        self.model = self._load_model()
        if group.distributed:
            group.join(store, self.device, config.tensor_parallel_timeout, config.tensor_parallel_join_timeout, check)
        num_blocks = group.agree_min(self._local_num_blocks())
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len}: give it more memory (--kv-cache-memory-gb / "
                "--gpu-memory-utilization) or lower --max-model-len"
            )
        self.kv_cache = KVCache(model_config, num_blocks, config.block_size, self.dtype, self.device,
                                kv_heads=self.shard.kv_heads)
        self.attention_backend = self._agreed_backend()
        # None on the CPU: host memory bounds nothing there that the configured bounds do not
        fits = self._activation_fit()
        self.activation_fit = None if fits is None else group.agree_min(fits)
        sampler = Sampler(self.device, config.seed) if group.rank == 0 else None
        self.runner = ModelRunner(self.model, self.kv_cache, self.max_model_len, sampler, self.attention_backend,
                                  compile=config.compile)
        self.memory = RankMemory(group.rank, _param_bytes(self.model), self.kv_cache.nbytes)

    def _load_model(self) -> LlamaModel:
        with torch.device("meta"):
            model = LlamaModel(self.model_config, self.shard, self.group)
        model = model.to_empty(device=self.device).to(self.dtype)
        if self.model_config.tie_word_embeddings:  # to_empty makes new tensors: tie them again
            model.lm_head.weight = model.embed_tokens.weight
        load_weights(model, self.config.model)
        self.quantized = q = quantization.quantize(model, self.config.quantization)
        if q is not None:
            log.info("quantized %d linear layers to %s: their weights %.0f MiB -> %.0f MiB", q.layers, q.method,
                     q.bytes_before / 2**20, q.bytes_after / 2**20)
        return model.eval()

    def _local_num_blocks(self) -> int:
        cfg, bs, heads = self.config, self.config.block_size, self.shard.kv_heads
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
            return blocks_for_memory(self.model_config, self.dtype, bs, budget, heads)
        # CPU: the configured memory is for the whole pool; each rank holds its heads' part of every slot
        gb = cfg.kv_cache_memory_gb if cfg.kv_cache_memory_gb is not None else 1.0
        return blocks_for_memory(self.model_config, self.dtype, bs, int(gb * 2**30))

    def _agreed_backend(self) -> str:
        backend = choose_backend(self.config.attention_backend, self.device, self.dtype, self.config.block_size)
        # every rank must run the same kernels: varlen only where all of them can
        return "varlen" if self.group.agree_min(int(backend == "varlen")) else "sdpa"

    def remeasure_activation_fit(self) -> None:
        """Measure this rank's fit again once more is loaded on its device (rank 0's draft model). No collective:
        the other ranks' memory is as it was when the fit was agreed, so the smaller of the agreed fit and this
        rank's new one is the smallest over the ranks now."""
        if self.activation_fit is not None:
            self.activation_fit = min(self.activation_fit, self._activation_fit())

    def _activation_fit(self) -> int | None:
        free = self._free_memory(self.device)  # weights and KV cache are allocated by now
        if free is None:
            return None
        return max_token_budget(self.model_config, self.dtype, cuda_headroom(free), self.shard)


def _param_bytes(model: torch.nn.Module) -> int:
    # a tied head is counted once; a quantized layer's weights are buffers
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
