"""Batch-1 decode against the memory-bandwidth bound and prefill against the matmul FLOP/s bound, both measured
by this process on this machine, same dtype and threads (targets: ≥ 80 % and ≥ 60 %).

    python bench/roofline.py [--device cpu|cuda] [--dtype ...] [--decode-tokens 128] [--prefill-tokens 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import conditions, model_dir, pyplot, save, sync

from chunkpilot.engine import LLM, SamplingParams


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s moved by a large tensor copy (read + write), the practical memory bound."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def matmul_flops(device, dtype, m: int, k: int, n: int, repeats: int = 10) -> float:
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def decode_tokens_per_s(llm: LLM, n: int) -> tuple[float, int]:
    eng = llm.engine
    eng.add_request(f"d{time.monotonic_ns()}", list(range(1000, 1016)), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    eng.step()  # prefill + first token
    sync(eng.device)
    t0 = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    sync(eng.device)
    return steps / (time.perf_counter() - t0), 16 + n // 2


def prefill_tokens_per_s(llm: LLM, n: int) -> float:
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    prompt = torch.randint(1000, 40000, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(eng.device)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    sync(eng.device)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    args = ap.parse_args()

    n = args.prefill_tokens
    llm = LLM(model_dir(), device=args.device, dtype=args.dtype, token_budget=n, max_chunk=n, max_num_seqs=1,
              max_model_len=max(n, args.decode_tokens + 16) + 16)
    eng, cfg = llm.engine, llm.engine.model_config
    dev, dtype = eng.device, eng.dtype
    elt = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(p.numel() for p in eng.model.parameters()) * elt  # tied head: the embedding is read once
    non_embedding = sum(p.numel() for name, p in eng.model.named_parameters() if "embed" not in name)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elt

    decode_tokens_per_s(llm, 8)  # warm-up
    prefill_tokens_per_s(llm, 128)
    bandwidth = copy_bandwidth(dev)
    decode_tps, avg_ctx = decode_tokens_per_s(llm, args.decode_tokens)
    bytes_per_token = weight_bytes + kv_per_token * avg_ctx
    decode_bound = bandwidth / bytes_per_token

    flops = matmul_flops(dev, dtype, n, cfg.hidden_size, cfg.intermediate_size)
    # per prompt token: 2 FLOPs per non-embedding weight, plus causal attention (QK^T and PV over ~n/2 keys)
    attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (n / 2)
    flops_per_token = 2 * non_embedding + attn
    prefill_tps = prefill_tokens_per_s(llm, n)
    prefill_bound = flops / flops_per_token

    result = {
        "conditions": conditions(device=str(dev), dtype=str(dtype)),
        "decode": {"tokens_per_s": decode_tps, "bound_tokens_per_s": decode_bound,
                   "fraction_of_bound": decode_tps / decode_bound, "target": 0.80,
                   "bandwidth_GBps": bandwidth / 1e9, "bytes_per_token": bytes_per_token},
        "prefill": {"tokens_per_s": prefill_tps, "bound_tokens_per_s": prefill_bound,
                    "fraction_of_bound": prefill_tps / prefill_bound, "target": 0.60,
                    "matmul_GFLOPs": flops / 1e9, "flops_per_token": flops_per_token, "prompt_tokens": n},
    }
    d, p = result["decode"], result["prefill"]
    print(f"decode  batch 1: {decode_tps:.1f} tok/s of {decode_bound:.1f} bound ({bandwidth / 1e9:.1f} GB/s copy, "
          f"{bytes_per_token / 1e6:.0f} MB/token) = {d['fraction_of_bound']:.0%} (target ≥ 80 %)")
    print(f"prefill {n} tok: {prefill_tps:.0f} tok/s of {prefill_bound:.0f} bound ({flops / 1e9:.0f} GFLOP/s matmul) "
          f"= {p['fraction_of_bound']:.0%} (target ≥ 60 %)")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["decode", "prefill"], [d["fraction_of_bound"] * 100, p["fraction_of_bound"] * 100])
    ax.axhline(80, ls="--", c="tab:blue", lw=1)
    ax.axhline(60, ls="--", c="tab:orange", lw=1)
    ax.set(ylabel="% of the measured bound", title=f"roofline ({dev}, {str(dtype).removeprefix('torch.')})")
    save("roofline", result, fig)


if __name__ == "__main__":
    main()
