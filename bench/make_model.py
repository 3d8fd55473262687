"""Write a random-weight Llama checkpoint at a real model's size, for the GPU run (bench/gpu_check.sh): the device
machine cannot download weights, and random weights cost a forward pass exactly what trained ones do. Shapes
are Llama-3-8B's (or a tiny one, to try the script on a CPU); the tokenizer is a small byte-level BPE (the
benchmarks send token ids). Made with transformers, on the given device, saved as safetensors shards."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SIZES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    # SmolLM2-sized, but with 12 heads and 4 KV heads, so tensor-parallel sizes 2 and 4 divide it (SmolLM2's 9
    # heads take only 3): bench/tensor_parallel.py on the CPU
    "llama-125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                       rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=50000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", choices=sorted(SIZES), default="llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = ap.parse_args()
    make(args.size, args.out, args.device, args.dtype)


def make(size: str, out: Path, device: str = "cpu", dtype: str = "float32") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.engine.tiny_models import make_tokenizer  # the same small tokenizer the tests use

    if (out / "config.json").is_file():
        print(f"{out} exists; reusing it")
        return out
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**SIZES[size], bos_token_id=None, eos_token_id=0, pad_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will run: seconds on a GPU, not minutes on the CPU
        model = LlamaForCausalLM._from_config(config, torch_dtype=DTYPES[dtype])
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    make_tokenizer(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "chunkpilot-bench.json").write_text(json.dumps({"size": size, "parameters": params}))
    print(f"wrote {out}: {size}, {params / 1e9:.2f} B parameters, {dtype}, {time.perf_counter() - t0:.0f} s")
    return out


if __name__ == "__main__":
    main()
