"""Where a decode step's time goes on the GPU: torch.profiler over batch-1 decode steps of the engine, the top
operators by CPU and by CUDA time, and the step time (eager). Run by
hand on a GPU machine after bench/make_model.py (bench/gpu_check.sh makes the model):

    python bench/gpu_profile.py --steps 16 > profile.txt
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common import model_dir, sync

from chunkpilot.engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    llm = LLM(model_dir(), device=args.device, dtype=args.dtype, token_budget=512, max_chunk=512,
              max_num_seqs=max(args.batch, 1), max_model_len=1024, num_kv_blocks=64 * max(args.batch, 1) + 8)
    eng = llm.engine
    from chunkpilot.engine.model.attention import _varlen_unusable

    print("attention backend:", eng.attention_backend, "device:", eng.device, "dtype:", eng.dtype,
          "| varlen:", _varlen_unusable(eng.device, eng.dtype, eng.config.block_size) or "usable",
          "| cuDNN SDPA enabled:", torch.backends.cuda.cudnn_sdp_enabled())
    for i in range(args.batch):
        eng.add_request(f"r{i}", list(range(1000 + i, 1016 + i)),
                        SamplingParams(max_tokens=3 * args.steps + 8, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # prefill and warm-up
        eng.step()
    sync(eng.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync(eng.device)
    print(f"decode step (batch {args.batch}): {(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms, eager")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        for _ in range(args.steps):
            eng.step()
        sync(eng.device)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
