"""How large a token budget the device's memory allows: every token of a step needs activations, and a budget
beyond what the memory left after weights and KV cache can hold runs the GPU out of memory in the step loop, which
kills the engine. Budgets above the bound are refused at start-up and in the knobs file (the last good knobs
stay)."""

from __future__ import annotations

import torch

from chunkpilot.engine.model.model_config import ModelConfig

# cuBLAS workspaces, the sampler's and attention's buffers and the allocator's slack, kept out of what
# activations may use (the CUDA context is already out of the free memory this is taken from).
CUDA_RESERVE_BYTES = 512 * 2**20


def activation_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, shard=None) -> int:
    """Peak bytes one scheduled token costs in a forward pass. Layers run one after another without autograd, so
    one layer's tensors are live at a time: the residual stream, its norm and the attention output (3 x hidden),
    q, k and v, and the MLP's gate, up and their product (3 x intermediate, the widest). Doubled for the
    temporaries and fragmentation between them. Logits are computed only where a sequence samples, so they grow
    with max_num_seqs, not with the budget. Under tensor parallelism (`shard`: a tp_shard.TPShard) a rank holds
    its heads' q/k/v and its slice of the MLP; the residual stream is whole on every rank."""
    heads = cfg.num_attention_heads if shard is None else shard.heads
    kv_heads = cfg.num_key_value_heads if shard is None else shard.kv_heads
    inter = cfg.intermediate_size if shard is None else shard.intermediate
    q = heads * cfg.head_dim
    kv = 2 * kv_heads * cfg.head_dim
    return 2 * dtype.itemsize * (3 * cfg.hidden_size + q + kv + 3 * inter)


def max_token_budget(cfg: ModelConfig, dtype: torch.dtype, headroom_bytes: int, shard=None) -> int:
    """The largest budget whose activations fit in `headroom_bytes`."""
    return max(0, headroom_bytes) // activation_bytes_per_token(cfg, dtype, shard)


def device_free_memory(device: torch.device) -> int | None:
    """Bytes free on a GPU; None on the CPU, where host memory bounds nothing that the configured bounds do not."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def cuda_headroom(free_bytes: int) -> int:
    """Activations get what is free once weights and KV cache are allocated, less the reserve."""
    return free_bytes - CUDA_RESERVE_BYTES
