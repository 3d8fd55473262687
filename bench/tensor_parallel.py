"""Tensor parallelism against one rank: time per step (a prefill chunk, and a decode batch) and memory per rank,
measured side by side in one run, rounds interleaved.

The model is a random-weight Llama at SmolLM2's size but with 12 heads and 4 KV heads (bench/make_model.py
llama-125m), so TP=2 and TP=4 divide it; $CHUNKPILOT_BENCH_MODEL overrides it.

On a CPU this is a correctness feature, not a speed-up: every layer adds two all-reduces over loopback gloo, and
the cores the ranks run on are the same cores one rank could use with more threads. On GPUs the ranks have a GPU
each and NCCL over NVLink; there it is what lets a model larger than one GPU be served at all.

    python bench/tensor_parallel.py [--configs 1x1,1x2,2x1] [--prefill-tokens 256] [--decode-batch 16]
                                    [--rounds 5] [--device cpu|cuda] [--dtype ...]

A config is TPxTHREADS: tensor-parallel size times torch threads per rank. The ratios are against the first
config with as many cores in all (TP=1 with 2 threads against TP=2 with 1 each: the same 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import conditions, kv_blocks, pyplot, save, sync
from make_model import make

from chunkpilot.engine import LLM, SamplingParams


def bench_model(device: str) -> str:
    if os.environ.get("CHUNKPILOT_BENCH_MODEL"):
        return os.environ["CHUNKPILOT_BENCH_MODEL"]
    dtype = "float32" if device == "cpu" else "bfloat16"
    return str(make("llama-125m", Path(tempfile.gettempdir()) / f"chunkpilot-bench-llama-125m-{dtype}", device, dtype))


def prefill_step(llm: LLM, prompt: list[int]) -> float:
    """Seconds of the one step that computes the whole prompt (the budget holds it)."""
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    eng.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    seconds = []
    while eng.has_unfinished():
        eng.step()
        if eng.last_step.num_prefill_tokens:
            seconds.append(eng.last_step.seconds)
    return sum(seconds)


def decode_steps(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Median seconds of the decode-only steps of a batch."""
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    for i, p in enumerate(prompts):
        eng.add_request(f"d{time.monotonic_ns()}-{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True))
    seconds = []
    while eng.has_unfinished():
        eng.step()
        if eng.last_step.num_tokens and not eng.last_step.num_prefill_tokens:
            seconds.append(eng.last_step.seconds)
    return statistics.median(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--configs", default=None,
                    help="TPxTHREADS per rank, comma-separated (the sizes must divide the model's heads); default: "
                         "1x1,1x2,2x1 on the CPU, 1x1 and 2x1 on CUDA (1x1 alone with one GPU)")
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    if args.configs is None:
        gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
        args.configs = "1x1,1x2,2x1" if args.device == "cpu" else ("1x1,2x1" if gpus >= 2 else "1x1")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    names = [f"TP={tp}, {th} thread{'s' if th > 1 else ''}/rank" for tp, th in configs]
    model = bench_model(args.device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 30000, (args.prefill_tokens,), generator=gen).tolist()
    batch = [torch.randint(100, 30000, (64,), generator=gen).tolist() for _ in range(args.decode_batch)]
    max_len = args.prefill_tokens + 80
    common = dict(device=args.device, dtype=args.dtype, max_model_len=max_len,
                  max_num_seqs=args.decode_batch, token_budget=max(args.prefill_tokens, args.decode_batch),
                  max_chunk=args.prefill_tokens, num_kv_blocks=kv_blocks(args.decode_batch + 1, max_len))
    engines = {name: LLM(model, tensor_parallel_size=tp, threads=th, **common)
               for name, (tp, th) in zip(names, configs)}
    threads = dict(zip(names, (th for _, th in configs)))
    prefill = {n: [] for n in names}
    decode = {n: [] for n in names}
    for llm in engines.values():  # warm-up
        prefill_step(llm, prompt)
    for r in range(args.rounds):
        for name, llm in engines.items():
            torch.set_num_threads(threads[name])  # one process holds every rank 0: set its threads each time
            sync(llm.engine.device)
            prefill[name].append(prefill_step(llm, prompt))
            decode[name].append(decode_steps(llm, batch, args.decode_tokens))
        print(f"round {r + 1}/{args.rounds}: " + "; ".join(
            f"{n}: prefill {prefill[n][-1] * 1e3:.0f} ms, decode {decode[n][-1] * 1e3:.1f} ms" for n in names))
    result = {"conditions": conditions(device=args.device, dtype=args.dtype, model=model,
                                       prefill_tokens=args.prefill_tokens, decode_batch=args.decode_batch,
                                       rounds=args.rounds),
              "configs": {}}
    for (tp, th), name in zip(configs, names):
        # the same cores in all: TP=2 x 1 thread against TP=1 x 2 threads
        base = next(n for (t2, h2), n in zip(configs, names) if t2 * h2 == tp * th)
        mem = engines[name].engine.rank_memory
        p, d = statistics.median(prefill[name]), statistics.median(decode[name])
        result["configs"][name] = {
            "tensor_parallel_size": tp, "threads_per_rank": th, "same_cores_as": base,
            "prefill_step_seconds": p, "decode_step_seconds": d,
            "prefill_vs_same_cores": p / statistics.median(prefill[base]),
            "decode_vs_same_cores": d / statistics.median(decode[base]),
            "weight_bytes_per_rank": [m.weight_bytes for m in mem],
            "kv_cache_bytes_per_rank": [m.kv_cache_bytes for m in mem],
        }
    for llm in engines.values():
        llm.engine.close()
    for name, r in result["configs"].items():
        print(f"{name}: prefill step {r['prefill_step_seconds'] * 1e3:.0f} ms ({r['prefill_vs_same_cores']:.2f}x "
              f"{r['same_cores_as']}), decode step {r['decode_step_seconds'] * 1e3:.1f} ms "
              f"({r['decode_vs_same_cores']:.2f}x), weights per rank {max(r['weight_bytes_per_rank']) / 2**20:.0f} "
              f"MiB, KV per rank {max(r['kv_cache_bytes_per_rank']) / 2**20:.0f} MiB")

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(len(names)))
    rows = [result["configs"][n] for n in names]
    ax1.bar([i - 0.2 for i in x], [r["prefill_step_seconds"] * 1e3 for r in rows], 0.4,
            label=f"prefill step ({args.prefill_tokens} tokens)")
    ax1.bar([i + 0.2 for i in x], [r["decode_step_seconds"] * 1e3 for r in rows], 0.4,
            label=f"decode step ({args.decode_batch} sequences)")
    ax1.set_xticks(x, [n.replace(", ", "\n") for n in names])
    ax1.set_ylabel("ms per step (median)")
    ax1.legend()
    ax1.set_title(f"time per step ({args.device})")
    ax2.bar(x, [max(r["weight_bytes_per_rank"]) / 2**20 for r in rows])
    ax2.set_xticks(x, [n.replace(", ", "\n") for n in names])
    ax2.set_ylabel("MiB of weights per rank")
    ax2.set_title("memory per rank")
    save("tensor_parallel", result, fig)


if __name__ == "__main__":
    main()
