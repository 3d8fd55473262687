"""Offline throughput: the engine against transformers `generate` with padded static batches at its best batch
size; 64 requests of mixed prompt lengths, same model, dtype and threads (target: ≥ 3× output tokens/s).

    python bench/vs_transformers.py [--requests 64] [--new-tokens 64] [--batch-sizes 4,8,16,32] [--device ...]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import conditions, kv_blocks, model_dir, pyplot, save, sync

from chunkpilot.engine import LLM, SamplingParams


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 512, (n,), generator=g).tolist()
    return [torch.randint(1000, 40000, (k,), generator=g).tolist() for k in lengths]


def engine_tps(llm: LLM, reqs: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    sync(llm.engine.device)
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params)
    sync(llm.engine.device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def hf_tps(model, reqs: list[list[int]], new_tokens: int, batch: int, device) -> float:
    total, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(r) for r in group)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in group], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in group], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0)
        total += (out.shape[1] - width) * len(group)
    sync(device)
    return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="4,8,16,32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    reqs = prompts(args.requests)
    # Offline throughput has no inter-token SLO: a budget that takes several whole prompts per step (vLLM's
    # offline LLM class defaults to 8k-16k batched tokens). 2048 against 512 here: 96 -> 71 steps, +8 % tokens/s.
    llm = LLM(model_dir(), device=args.device, dtype=args.dtype, token_budget=2048, max_chunk=2048, max_num_seqs=64,
              max_model_len=1024, num_kv_blocks=kv_blocks(64, 1024))  # leaves the GPU room for transformers
    dev, dtype = llm.engine.device, llm.engine.dtype
    engine_tps(llm, reqs[:4], 4)  # warm-up
    ours = engine_tps(llm, reqs, args.new_tokens)
    print(f"chunkpilot: {ours:.1f} output tokens/s")
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=dtype).to(dev).eval()
    hf_tps(model, reqs[:2], 2, 2, dev)  # warm-up
    theirs = {}
    for b in map(int, args.batch_sizes.split(",")):
        theirs[b] = hf_tps(model, reqs, args.new_tokens, b, dev)
        print(f"transformers generate, batch {b}: {theirs[b]:.1f} output tokens/s")
    best_b = max(theirs, key=theirs.get)
    ratio = ours / theirs[best_b]
    print(f"chunkpilot / transformers (best batch {best_b}) = {ratio:.2f}× (target ≥ 3×)")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    labels = ["chunkpilot"] + [f"HF b={b}" for b in theirs]
    ax.bar(labels, [ours] + list(theirs.values()), color=["tab:green"] + ["tab:gray"] * len(theirs))
    ax.set(ylabel="output tokens/s", title=f"{args.requests} requests, {args.new_tokens} new tokens: {ratio:.2f}×")
    save("vs_transformers", {"conditions": conditions(device=str(dev), dtype=str(dtype), requests=args.requests,
                                                      new_tokens=args.new_tokens),
                             "chunkpilot_tokens_per_s": ours, "transformers_tokens_per_s": theirs,
                             "best_batch": best_b, "ratio": ratio, "target": 3.0}, fig)


if __name__ == "__main__":
    main()
