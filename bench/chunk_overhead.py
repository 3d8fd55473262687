"""One long prompt prefilled in 512-token chunks against one shot (target: chunked ≤ 1.10× the one-shot time).

    python bench/chunk_overhead.py [--tokens 4096] [--chunk 512] [--repeats 3] [--device cpu|cuda] [--dtype ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import conditions, kv_blocks, model_dir, pyplot, save, sync

from chunkpilot.engine import LLM, SamplingParams


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    """Time to the first token of one request: the whole prefill (plus one sampled token)."""
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()  # every repeat computes the whole prompt
    seq = eng.make_sequence(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    eng.submit(seq)
    sync(eng.device)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    sync(eng.device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    prompt = torch.randint(1000, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.tokens + 16, max_num_seqs=1,
                  num_kv_blocks=kv_blocks(1, args.tokens + 16))
    runs = {}
    engines = {
        "one-shot": LLM(model_dir(), token_budget=args.tokens, max_chunk=args.tokens, **common),
        f"chunked-{args.chunk}": LLM(model_dir(), token_budget=args.chunk, max_chunk=args.chunk, **common),
    }
    for llm in engines.values():
        prefill_seconds(llm, prompt[:256])  # warm-up
    # Interleave the two so machine noise hits both alike.
    for _ in range(args.repeats):
        for name, llm in engines.items():
            runs.setdefault(name, []).append(prefill_seconds(llm, prompt))
    one, chunked = (statistics.median(v) for v in runs.values())
    ratio = chunked / one
    eng = next(iter(engines.values())).engine
    print(f"{args.tokens}-token prefill: one-shot {one:.2f}s, {args.chunk}-token chunks {chunked:.2f}s "
          f"→ chunked / one-shot = {ratio:.3f} (target ≤ 1.10)")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(list(runs), [statistics.median(v) for v in runs.values()], color=["tab:blue", "tab:orange"])
    ax.set(ylabel="prefill seconds (median)", title=f"{args.tokens}-token prefill: ratio {ratio:.3f}")
    save("chunk_overhead", {"conditions": conditions(device=str(eng.device), dtype=str(eng.dtype)),
                            "tokens": args.tokens, "chunk": args.chunk, "seconds": runs,
                            "ratio_chunked_over_one_shot": ratio, "target": 1.10}, fig)


if __name__ == "__main__":
    main()
