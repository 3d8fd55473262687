"""Random tiny checkpoints written by transformers itself, in every config style the loader must read."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention keeps the kv cache in fixed size blocks",
    "chunked prefill splits long prompts into pieces",
    "hello world, hello chunkpilot! 0123456789",
]


def make_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))


def make_checkpoint(folder: Path, arch: str, *, legacy_config: bool = False, sharded: bool = False, seed: int = 0,
                    **sizes) -> Path:
    """arch: llama | llama3 (llama3 rope scaling) | mistral | qwen2. `sharded` writes several safetensors files
    and an index, as large checkpoints come. `sizes` override the config (e.g. num_key_value_heads=1)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=0, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=arch == "qwen2",
    )
    common.update(sizes)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=500.0))
    elif arch == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 500.0}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=scaling))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None, head_dim=32))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    else:
        raise ValueError(arch)
    # Random init is small; scale weights up so logits are far from uniform and greedy choices are clear.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0 if p.dim() > 1 else 1.0)
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    model.save_pretrained(str(folder), max_shard_size="60KB" if sharded else "10GB")
    make_tokenizer(folder)
    if legacy_config:
        _to_transformers4_style(folder / "config.json")
    return folder


def _to_transformers4_style(path: Path) -> None:
    """Rewrite a transformers 5.x config.json into the 4.x spelling (rope_theta/rope_scaling/torch_dtype)."""
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    path.write_text(json.dumps(cfg))
