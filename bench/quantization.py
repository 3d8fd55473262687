"""Weight-only quantization, side by side in one run on the same threads: float32, int8 and int4 (and fp8 on a
CUDA device), each eager and with --compile (on the CPU), against llama.cpp's Q4_1 of the same model where
llama-cpp-python is installed.

For each: batch-1 decode ms/token (a 64-token output after a 32-token prompt, the decode steps alone: the
prefill's time subtracted), a 512-token prefill, output tokens/s at batch 16, the weights' bytes, the perplexity of
the engine's own forward on bench/data/quality_text.md (a frozen copy of docs/architecture.md, 1024 tokens), and greedy agreement with float32 on
prompts the parity tests do not use (the share of tokens equal up to each output's first difference), and the
engine's start-up seconds (with --compile: the compile, in an empty inductor cache, as on a first start). Speed
ratios compare each method with float32 in the same mode (eager with eager, compiled with compiled); quality
compares with eager float32.

    python bench/quantization.py [--threads 2] [--device cpu|cuda] [--methods int8,int4] [--no-compile]

llama.cpp runs in a process of its own through llama-cpp-python (no HTTP server: that favours it slightly against
the issue's peer run, which went through its server), on the GGUF the bundled model is converted from, with as
many threads. It is not a project dependency; build it with the host's vector units but without AMX (a native
build here, which turns AMX on, crashed in its first decode):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF" pip install --no-cache-dir llama-cpp-python==0.3.36

Writes bench/results/quantization.json and .png (bench/results/gpu/ with CHUNKPILOT_BENCH_RESULTS)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import conditions, model_dir, pyplot, save, sync

from chunkpilot.engine import LLM, SamplingParams
from chunkpilot.engine.model.perplexity import greedy_agreement, perplexity

PROMPTS = ["The history of the printing press", "def merge_sort(values):\n    ", "Photosynthesis is the process",
           "A haiku about autumn rain:\n", "The three laws of thermodynamics are", "SELECT name FROM users WHERE"]
TEXT = Path(__file__).resolve().parent / "data" / "quality_text.md"  # frozen: figures stay comparable
DECODE_TOKENS = 64
REPEATS = 3


def timed(fn) -> float:
    """The median of REPEATS timings of fn()."""
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(model: str, method: str | None, device: str, threads: int, compile: bool = False) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, quantization=method, device=device, threads=threads, token_budget=512, max_chunk=512,
              max_num_seqs=16, enable_prefix_caching=False, max_model_len=2048, compile=compile)
    startup = time.perf_counter() - t0
    try:
        dev = llm.engine.device
        tok = llm.tokenizer
        prompt = tok.encode("Write a long story about a lighthouse keeper and the sea.")[:32]
        long = (tok.encode(TEXT.read_text()) * 2)[:512]

        def gen(reqs, n):
            llm.generate(reqs, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            sync(dev)
        gen([prompt], 4)  # warm-up
        first = timed(lambda: gen([prompt], 1))
        whole = timed(lambda: gen([prompt], DECODE_TOKENS + 1))
        prefill = timed(lambda: gen([long], 1))
        batch = [tok.encode(p) for p in PROMPTS] * 3
        batch16 = timed(lambda: gen(batch[:16], DECODE_TOKENS))
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
        return {"method": method or str(llm.engine.dtype).removeprefix("torch."), "compile": compile,
                "startup_s": startup, "decode_ms_per_token": 1e3 * (whole - first) / DECODE_TOKENS,
                "prefill_512_s": prefill, "batch16_tokens_per_s": 16 * DECODE_TOKENS / batch16,
                "weight_bytes": llm.engine.worker.memory.weight_bytes,
                "perplexity": perplexity(llm, tok.encode(TEXT.read_text())[:1024]),
                "greedy": [o.token_ids for o in greedy]}
    finally:
        llm.engine.close()


LLAMA = """
import json, statistics, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), n_ctx=2048,
            verbose=False)
prompt = llm.tokenize(b"Write a long story about a lighthouse keeper and the sea.")[:32]
def gen(n):
    llm.reset()
    for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
        if i + 1 >= n:
            break
def timed(n):
    out = []
    for _ in range(3):
        t0 = time.perf_counter(); gen(n); out.append(time.perf_counter() - t0)
    return statistics.median(out)
gen(4)
print(json.dumps({"decode_ms_per_token": 1e3 * (timed(int(sys.argv[3]) + 1) - timed(1)) / int(sys.argv[3])}))
"""


def llama_cpp(threads: int) -> dict | None:
    """llama.cpp on the GGUF the bundled SmolLM2 is converted from, in a process of its own (its OpenMP and
    torch's share nothing, and a crash in it costs this bench nothing); None where llama-cpp-python is missing."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from chunkpilot.engine.model.model_fetch import MODELS, find_gguf

    done = subprocess.run([sys.executable, "-c", LLAMA, str(find_gguf(MODELS["smollm2"][0])), str(threads),
                           str(DECODE_TOKENS)], capture_output=True, text=True, timeout=600)
    row = {"method": "llama.cpp Q4_1"}
    if done.returncode != 0:
        return {**row, "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1])}


def _faster(a: dict | None, b: dict | None) -> dict | None:
    """llama.cpp's better run of two (the figure ours must meet), both kept."""
    runs = [r for r in (a, b) if r and "error" not in r]
    if not runs:
        return a or b
    best = min(runs, key=lambda r: r["decode_ms_per_token"])
    return {**best, "runs_ms_per_token": [r["decode_ms_per_token"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default=None, help="comma-separated (default: int8,int4 on the CPU, fp8 on CUDA)")
    ap.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    ap.add_argument("--no-compile", action="store_true", help="eager only (--compile runs on the CPU)")
    args = ap.parse_args()
    import os
    import tempfile

    import torch

    torch.set_num_threads(args.threads)
    methods = args.methods.split(",") if args.methods else (["fp8"] if args.device.startswith("cuda")
                                                           else ["int8", "int4"])
    model = args.model or model_dir()
    modes = [False] if args.no_compile or args.device.startswith("cuda") else [False, True]
    # an empty inductor cache: the start-up figure is a first start's compile
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="chunkpilot-bench-inductor-")
    cpu = not args.device.startswith("cuda")
    before = llama_cpp(args.threads) if cpu else None  # before and after ours: the host's load drifts in a run
    rows = [measure(model, m, args.device, args.threads, c) for c in modes for m in [None, *methods]]
    peer = _faster(before, llama_cpp(args.threads) if cpu else None)
    for r in rows:
        base = next(b for b in rows if b["compile"] == r["compile"])  # float32 in the same mode
        r["decode_speedup"] = base["decode_ms_per_token"] / r["decode_ms_per_token"]
        r["prefill_speedup"] = base["prefill_512_s"] / r["prefill_512_s"]
        # quality against eager float32, the reference the parity tests hold to transformers
        r["perplexity_ratio"] = r["perplexity"] / rows[0]["perplexity"]
        r["greedy_agreement"] = greedy_agreement(r["greedy"], rows[0]["greedy"])
        r["weights_ratio"] = r["weight_bytes"] / base["weight_bytes"]
    for r in rows:
        print(f"{r['method'] + (' compiled' if r['compile'] else ''):>14}: start {r['startup_s']:.0f} s, decode {r['decode_ms_per_token']:.1f} ms/token ({r['decode_speedup']:.2f}x), "
              f"prefill 512 {r['prefill_512_s']:.2f} s ({r['prefill_speedup']:.2f}x), batch 16 "
              f"{r['batch16_tokens_per_s']:.0f} tokens/s, weights {r['weight_bytes'] / 2**20:.0f} MiB, perplexity "
              f"{r['perplexity']:.3f} ({r['perplexity_ratio']:.4f}x), greedy agreement {r['greedy_agreement']:.0%}")
    if peer and "error" in peer:
        print(f"llama.cpp: failed ({peer['error']})")
    elif peer:
        print(f"llama.cpp Q4_1: decode {peer['decode_ms_per_token']:.1f} ms/token")
    else:
        print("llama.cpp: not measured (install llama-cpp-python as this file's docstring says)")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    measured = peer if peer and "error" not in peer else None
    bars = [(r["method"] + ("\ncompiled" if r["compile"] else ""), r["decode_ms_per_token"]) for r in rows] + \
        ([(measured["method"], measured["decode_ms_per_token"])] if measured else [])
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C0"] * len(rows) + ["C3"] * bool(measured))
    ax.set(ylabel="batch-1 decode, ms/token", title=f"weight-only quantization, {args.threads} threads, {args.device}")
    save("quantization", {"conditions": conditions(threads=args.threads, device=args.device),
                          "rows": rows, "llama_cpp": peer}, fig)


if __name__ == "__main__":
    main()
