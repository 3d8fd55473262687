"""Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch, over the flattened tokens of one step.

q/k/v and gate/up are fused into one matmul each (fewer, larger GEMMs); the weight loader fills the fused
parameters slice by slice from the checkpoint's separate tensors.

Under tensor parallelism each rank builds the same modules at its shard's sizes (tp_shard.py): its query and KV
heads, its slice of the MLP and of the vocabulary. The group's all-reduce after o_proj and down_proj (and after
the embedding lookup) makes every rank's residual stream the whole model's; with one rank it is a no-op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chunkpilot.engine.model.attention_op import attention
from chunkpilot.engine.model.model_config import ModelConfig
from chunkpilot.engine.model.rope import apply_rope
from chunkpilot.engine.model.tp_shard import TPShard, whole
from chunkpilot.engine.parallel.tp_group import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in float32, cast back, then scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup, layer: int) -> None:
        super().__init__()
        self.group = group
        self.layer = layer  # its slice of the KV pool
        self.num_heads = shard.heads
        self.num_kv_heads = shard.kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias and shard.owns_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k sit side by side in the fused output: one rotation for both heads' sets (half the small ops of a
        # decode step's RoPE, which are dispatch-bound at batch 1)
        qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = attention(q, k, v.view(t, self.num_kv_heads, self.head_dim), self.layer, self.scale)
        return self.group.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.intermediate = shard.intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * shard.intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(shard.intermediate, cfg.hidden_size, bias=cfg.mlp_bias and shard.owns_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.group.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, group: TPGroup, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard, group, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard, group)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard = shard or whole(cfg)
        self.group = group = group or TPGroup.solo()
        # Vocab-parallel: this rank's rows of the vocabulary (the padding rows of the last slice stay zero).
        self.embed_tokens = nn.Embedding(shard.vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, group, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """input_ids: [T]; cos/sin: [T, 1, head_dim]. Returns the final hidden states [T, hidden]. The KV pool and
        the step's attention metadata come from the forward context the runner sets (forward_context.py)."""
        h = self._embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.group.distributed:
            return self.embed_tokens(input_ids)
        # Each rank looks up the ids in its slice and contributes zeros for the others; the sum is the lookup.
        local = input_ids - self.shard.vocab_start
        mine = (local >= 0) & (local < self.shard.vocab_end - self.shard.vocab_start)
        h = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.group.all_reduce(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, vocab] float32 logits on rank 0; None on the other ranks (they only send their slices). Every rank
        must call it for the same rows."""
        return self.group.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)
