"""What moving a prompt's KV blocks costs: a NIXL read between two registered pools (two agents, as a decode and a
prefill process hold them), beside a plain in-process copy of the same blocks and the per-block checksums the
decode side computes, for prompts of 256 to 4096 tokens in the model's own pool layout (SmolLM2's by default: 47 MB
for 1024 tokens in float32). On a GPU the pools are device memory (NIXL registers VRAM; UCX moves it with CUDA IPC or
copies), the per-role timing bench/gpu_check.sh records.

    python bench/kv_transfer.py [--device cpu|cuda] [--dtype float32] [--repeats 5]

Writes bench/results/kv_transfer.json and .png."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import conditions, model_dir, pyplot, save, sync

from chunkpilot.engine.execution.kv_blocks import block_checksums, copy_blocks
from chunkpilot.engine.kv_transfer.nixl_transport import NixlTransport
from chunkpilot.engine.model.model_config import ModelConfig

BLOCK = 16


def timed(fn, repeats: int, device) -> float:
    """Median seconds of `repeats` calls (after one warm-up)."""
    fn()
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", default="256,1024,4096")
    args = ap.parse_args()
    cfg = ModelConfig.from_dir(model_dir())
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    sizes = [int(t) for t in args.tokens.split(",")]
    num_blocks = 2 * max(sizes) // BLOCK + 8
    shape = (cfg.num_hidden_layers, 2, num_blocks * BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    prefill_pool = torch.randn(shape, device=device).to(dtype)
    decode_pool = torch.zeros(shape, device=device, dtype=dtype)
    prefill = NixlTransport("bench-prefill", prefill_pool, BLOCK)
    decode = NixlTransport("bench-decode", decode_pool, BLOCK)
    rows = []
    for tokens in sizes:
        n = tokens // BLOCK
        src, dst = list(range(n)), list(range(n, 2 * n))  # different block ids on the two sides, as in a pod
        nbytes = n * prefill_pool[:, :, :BLOCK].numel() * prefill_pool.element_size()
        nixl = timed(lambda: decode.read(prefill.name, prefill.metadata, prefill.layout, src, dst, 30.0),
                     args.repeats, device)
        assert torch.equal(decode_pool[:, :, n * BLOCK:2 * n * BLOCK], prefill_pool[:, :, :n * BLOCK])
        copy = timed(lambda: copy_blocks(prefill_pool, decode_pool, BLOCK, src, dst), args.repeats, device)
        crc = timed(lambda: block_checksums(decode_pool, BLOCK, dst), args.repeats, device)
        rows.append({"tokens": tokens, "blocks": n, "bytes": nbytes, "nixl_s": nixl, "copy_s": copy,
                     "checksum_s": crc, "nixl_gbps": nbytes / nixl / 1e9, "nixl_vs_copy": nixl / copy})
        print(f"{tokens:5d} tokens, {nbytes / 2**20:6.1f} MiB: NIXL read {nixl * 1000:7.1f} ms "
              f"({nbytes / nixl / 1e9:5.2f} GB/s, {nixl / copy:4.1f}x a local copy), checksums {crc * 1000:6.1f} ms")
    prefill.close()
    decode.close()
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("nixl_s", "NIXL read"), ("copy_s", "local copy"), ("checksum_s", "checksums")):
        ax.plot([r["tokens"] for r in rows], [r[key] * 1000 for r in rows], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.set_title(f"Moving a prompt's KV blocks ({args.device}, {args.dtype})")
    ax.legend()
    save("kv_transfer", {"conditions": conditions(device=args.device, dtype=args.dtype, model=cfg.model_type), "rows": rows}, fig)


if __name__ == "__main__":
    main()
