"""What a block pull costs the decode steps beside it, on one core as a CPU decode pod has it: a decode-only
LLMEngine steps in the main thread while another thread pulls a prompt's KV blocks (1024 tokens of SmolLM2 by
default) through NIXL and checks them, one pull a second, the way the decode pod's pull thread does. Side by side
in one run, with fresh sequences for each way of pulling, in rounds (ABC ABC: drift lands on every arm):

- alone: no pull;
- before: the whole read, then a CRC-32 per block (zlib), as pulls were until 2026-12-07;
- whole + xxh3: the whole read, then the XXH3 checksums pulls use now;
- paced: pacing.paced_read as pods run it (slices of SLICE_BYTES, each checked as it lands, at most PULL_SHARE
  of the wall time, --pull-share; --shares sets the arms' shares).

For each arm: the median step; for each pull the longest step that overlapped it (what a request decoding beside
the pull sees as its longest gap), median and max; the pull's own wall time. Pin it to one core:

    taskset -c 0 python bench/pull_contention.py [--tokens 1024] [--seqs 4] [--pulls 12] [--rounds 2]

Writes bench/results/pull_contention.json and .png."""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import zlib

import torch
from common import conditions, model_dir, pyplot, save

from chunkpilot.engine.config import EngineConfig
from chunkpilot.engine.core.sampling_params import SamplingParams
from chunkpilot.engine.execution.kv_blocks import block_checksums, block_regions, pool_layout
from chunkpilot.engine.kv_transfer.nixl_transport import NixlTransport
from chunkpilot.contract.engine_settings import PULL_SHARE
from chunkpilot.engine.kv_transfer.pacing import SLICE_BYTES, paced_read
from chunkpilot.engine.llm_engine import LLMEngine

BLOCK = 16


def crc32_blocks(pool: torch.Tensor, blocks: list[int]) -> list[int]:
    """The checksum pulls computed before: zlib's CRC-32 over each block's regions in place."""
    flat, base = pool.view(-1).view(torch.uint8).numpy(), pool.data_ptr()
    _, num_slots, layers, row_bytes = pool_layout(pool)
    out = []
    for b in blocks:
        crc = 0
        for address, length in block_regions(base, num_slots, layers, row_bytes, BLOCK, [b]):
            crc = zlib.crc32(flat[address - base:address - base + length], crc)
        out.append(crc)
    return out


def measure(eng: LLMEngine, pull, seqs: int, pulls: int, every: float, tag: str, live: list[str]) -> dict:
    """Fresh decoding sequences (the last arm's, ids in `live`, aborted first); `pull` (None: none) from another
    thread every `every` s while the steps run."""
    for rid in live:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    live[:] = [f"{tag}-{i}" for i in range(seqs)]
    for rid in live:
        eng.add_request(rid, [1 + live.index(rid)] * 64, SamplingParams(max_tokens=100000, ignore_eos=True))
    for _ in range(5):  # their prefills and first decodes
        eng.step()
    steps: list[tuple[float, float]] = []
    spans: list[tuple[float, float]] = []
    stop = threading.Event()

    def puller() -> None:
        while not stop.wait(every):
            t0 = time.perf_counter()
            pull()
            spans.append((t0, time.perf_counter()))
    thread = threading.Thread(target=puller, daemon=True)
    if pull is not None:
        thread.start()
    end = time.perf_counter() + every * (pulls + 0.5)
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        eng.step()
        steps.append((t0, time.perf_counter()))
    stop.set()
    if pull is not None:
        thread.join()
    worst = [max((b - a for a, b in steps if a < pe and b > ps), default=0.0) for ps, pe in spans]
    return {"steps": [b - a for a, b in steps], "worst": worst, "pulls": [b - a for a, b in spans]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seqs", type=int, default=4, help="sequences decoding beside the pulls")
    ap.add_argument("--pulls", type=int, default=12, help="pulls per arm and round")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between pulls")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shares", default=f"{PULL_SHARE}", help="paced arms: the shares of the wall time to pull in")
    ap.add_argument("--cores", default="0", help="the cores to run on, comma-separated (a decode pod's CPU limit)")
    args = ap.parse_args()
    os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})  # before any thread starts: they inherit it
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    eng = LLMEngine(EngineConfig(model=model_dir(), dtype="float32", max_model_len=4096, num_kv_blocks=1024,
                                 block_size=BLOCK, max_num_seqs=8, token_budget=256, max_chunk=256))
    pool = eng.kv_pool
    n = args.tokens // BLOCK
    src_pool = torch.randn(pool.shape).to(pool.dtype)
    src, dst = list(range(n)), list(range(pool.shape[2] // BLOCK - n, pool.shape[2] // BLOCK))
    prefill = NixlTransport("bench-prefill", src_pool, BLOCK)
    decode = NixlTransport("bench-decode", pool, BLOCK)
    sums = block_checksums(src_pool, BLOCK, src)

    def whole() -> None:
        decode.read(prefill.name, prefill.metadata, prefill.layout, src, dst, 30.0)

    arms = {
        "alone": None,
        "before (whole, CRC-32)": lambda: (whole(), crc32_blocks(pool, dst)),
        "whole, XXH3": lambda: (whole(), block_checksums(pool, BLOCK, dst)),
    }
    for share in (float(x) for x in args.shares.split(",")):
        arms[f"paced ({SLICE_BYTES >> 20} MiB slices, share {share:g})"] = (
            lambda share=share: paced_read(decode, prefill.name, prefill.metadata, prefill.layout, src, dst, sums,
                                           30.0, share=share))
    got: dict[str, dict[str, list[float]]] = {a: {"steps": [], "worst": [], "pulls": []} for a in arms}
    live: list[str] = []
    for r in range(args.rounds):
        for i, (arm, pull) in enumerate(arms.items()):
            m = measure(eng, pull, args.seqs, args.pulls, args.every, f"r{r}a{i}", live)
            for k, v in m.items():
                got[arm][k] += v
    prefill.close()
    decode.close()
    alone = statistics.median(got["alone"]["steps"])
    rows = []
    for arm, m in got.items():
        row = {"arm": arm, "step_p50_s": statistics.median(m["steps"]), "steps": len(m["steps"]),
               "step_p99_s": statistics.quantiles(m["steps"], n=100)[98],
               "worst_step_p50_s": statistics.median(m["worst"]) if m["worst"] else None,
               "worst_step_max_s": max(m["worst"]) if m["worst"] else None,
               "pull_p50_s": statistics.median(m["pulls"]) if m["pulls"] else None, "pulls": len(m["pulls"])}
        rows.append(row)
        extra = "" if row["worst_step_p50_s"] is None else (
            f"; longest step beside a pull: median {row['worst_step_p50_s'] * 1000:6.1f} ms "
            f"({row['worst_step_p50_s'] / alone:4.2f}x the median step alone), max "
            f"{row['worst_step_max_s'] * 1000:6.1f} ms; the pull {row['pull_p50_s'] * 1000:6.1f} ms")
        print(f"{arm:34s} step p50 {row['step_p50_s'] * 1000:6.1f} ms, p99 {row['step_p99_s'] * 1000:6.1f} ms{extra}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    pulled = [r for r in rows if r["worst_step_p50_s"] is not None]
    xs = range(len(pulled))
    ax.bar([x - 0.2 for x in xs], [r["worst_step_p50_s"] * 1000 for r in pulled], 0.4,
           label="longest step beside a pull (median)")
    ax.bar([x + 0.2 for x in xs], [r["pull_p50_s"] * 1000 for r in pulled], 0.4, label="the pull (median)")
    ax.axhline(alone * 1000, color="k", linestyle="--", label="median step, no pull")
    ax.set_xticks(list(xs), [r["arm"] for r in pulled], fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(f"A {args.tokens}-token pull beside {args.seqs} decodes on {len(os.sched_getaffinity(0))} core(s)")
    ax.legend(fontsize=7)
    save("pull_contention", {"conditions": conditions(tokens=args.tokens, seqs=args.seqs, every_s=args.every,
                                                      pulls=args.pulls, rounds=args.rounds,
                                                      cores=sorted(os.sched_getaffinity(0))), "rows": rows}, fig)


if __name__ == "__main__":
    main()
