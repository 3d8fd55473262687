"""Load Hugging Face safetensors checkpoints (one file or sharded with an index) into `LlamaModel`.

Under tensor parallelism each rank reads only its own slices (safetensors' `get_slice` reads just those bytes),
so a rank's memory is about 1/N of the weights plus the replicated norms."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from chunkpilot.engine.model.llama import LlamaModel

# checkpoint name suffix -> (our parameter suffix, which slice of the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    files = _checkpoint_files(Path(model_dir))
    for path in files:
        if not os.access(path, os.R_OK):  # safetensors would call it "No such file or directory"
            raise PermissionError(f"cannot read {path} as uid {os.getuid()}: make the model's files readable by "
                                  "the engine's user (chmod a+r; the engine image runs as uid 10001)")
    return files


def _checkpoint_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if not found:
        raise ValueError(f"no *.safetensors weights in {d}; convert the checkpoint to safetensors first")
    return found


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    cfg, shard = model.config, model.shard
    params = dict(model.named_parameters())
    d = cfg.head_dim
    q, kv, inter = shard.heads * d, shard.kv_heads * d, shard.intermediate
    offsets = {"self_attn.qkv_proj": [0, q, q + kv, q + 2 * kv], "mlp.gate_up_proj": [0, inter, 2 * inter]}
    with torch.no_grad():  # the last rank's vocabulary slice may have padding rows: keep their logits finite
        model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, piece = _target(name)
                if target is None:
                    continue
                if target == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if target not in params:
                    if _dropped_bias(target, shard.owns_bias):
                        continue  # a row-parallel bias: rank 0 adds it
                    raise ValueError(f"checkpoint tensor {name} has no place in the model (config mismatch?)")
                param = params[target]
                with torch.no_grad():
                    if piece is None:
                        dest = param.data
                    else:
                        key = target.split(".", 2)[-1].rsplit(".", 1)[0]
                        lo, hi = offsets[key][piece], offsets[key][piece + 1]
                        dest = param.data[lo:hi]
                    sl = f.get_slice(name)
                    tensor = _read_shard(sl, name, shard, d)
                    if target in ("embed_tokens.weight", "lm_head.weight"):
                        if sl.get_shape()[0] != cfg.vocab_size:  # a slice of a short table would look whole
                            raise ValueError(f"{name}: {sl.get_shape()[0]} rows, but vocab_size is {cfg.vocab_size}")
                        dest = dest[: tensor.shape[0]]  # the real rows of the slice
                    if tuple(dest.shape) != tuple(tensor.shape):
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
                    dest.copy_(tensor.to(dest.dtype))
                loaded.add(f"{target}#{piece}")
    expected = _expected_keys(model)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")  # split output rows
_ROW = re.compile(r"(o_proj|down_proj)\.weight$")  # split input columns


def _read_shard(sl, name: str, shard, head_dim: int) -> torch.Tensor:
    """This rank's part of one checkpoint tensor, read from the file without the rest."""
    if shard.world == 1:
        return sl[:]
    m = _COLUMN.search(name)
    if m:
        lo, hi = _out_range(m.group(1), shard, head_dim)
        return sl[lo:hi]
    m = _ROW.search(name)
    if m:
        lo, hi = _out_range("q_proj" if m.group(1) == "o_proj" else "up_proj", shard, head_dim)
        return sl[:, lo:hi]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return sl[shard.vocab_start : shard.vocab_end]
    return sl[:]  # norms and row-parallel biases: whole on every rank that holds them


def _out_range(proj: str, shard, head_dim: int) -> tuple[int, int]:
    if proj == "q_proj":
        return shard.head_start * head_dim, (shard.head_start + shard.heads) * head_dim
    if proj in ("k_proj", "v_proj"):
        return shard.kv_head_start * head_dim, (shard.kv_head_start + shard.kv_heads) * head_dim
    return shard.intermediate_start, shard.intermediate_start + shard.intermediate  # gate_proj, up_proj


def _dropped_bias(target: str, owns_bias: bool) -> bool:
    return not owns_bias and target.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias"))


def _target(name: str) -> tuple[str | None, int | None]:
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return name.removeprefix("model."), None
    m = _LAYER.match(name)
    if not m:
        return None, None
    layer, mod, kind = m.groups()
    if mod in _FUSED:
        fused, piece = _FUSED[mod]
        return f"layers.{layer}.{fused}.{kind}", piece
    return f"layers.{layer}.{mod}.{kind}", None


def _expected_keys(model: LlamaModel) -> set[str]:
    keys: set[str] = set()
    for name, _ in model.named_parameters():  # tied lm_head is not listed twice
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            keys.update(f"{name}#{i}" for i in range(3))
        elif ".gate_up_proj." in name:
            keys.update(f"{name}#{i}" for i in range(2))
        else:
            keys.add(f"{name}#None")
    return keys
