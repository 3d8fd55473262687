"""Generation stalls: chat streams decoding while long prompts arrive, on one engine, chunked vs unchunked.

Chat p99 inter-token latency with chunked prefill (a small token budget) and unchunked (budget ≥ the longest
prompt), each divided by the decode-only step time measured in the same run, plus the long prompts' TTFT.
Target: chunked p99 ITL ≤ 1.5× the decode-only step; unchunked shows the stall.

    python bench/stall.py [--chat 8] [--long 4] [--long-tokens 2048] [--budget 16,64] [--device ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from common import conditions, kv_blocks, model_dir, pyplot, save, sync

from chunkpilot.engine import LLM, SamplingParams


def run(llm: LLM, chats: int, longs: list[list[int]], every: int, decode_steps: int) -> dict:
    """Keep `chats` chat streams decoding (each restarts after 128 + 16·i tokens, so contexts stay in a steady
    32–300 token range); measure decode-only steps over the second half of `decode_steps`; then inject one long
    prompt every `every` steps until all long prompts have their first token."""
    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    live: dict[str, int] = {}
    counter = iter(range(1_000_000))

    def start_chat(i: int) -> None:
        rid = f"chat{i}-{next(counter)}"
        live[rid] = i
        eng.add_request(rid, list(range(1000 + i, 1032 + i)),
                        SamplingParams(max_tokens=128 + 16 * i, temperature=0.0, ignore_eos=True))

    for i in range(chats):
        start_chat(i)
    last: dict[str, float] = {}
    gaps: list[float] = []
    step_times: list[float] = []
    ttft: dict[str, float] = {}
    arrived: dict[str, float] = {}
    pending = list(longs)
    step = 0
    while len(ttft) < len(longs):
        if step >= decode_steps and pending and (step - decode_steps) % every == 0:
            rid = f"long{len(arrived)}"
            eng.add_request(rid, pending.pop(0), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            arrived[rid] = time.perf_counter()
        sync(eng.device)
        t0 = time.perf_counter()
        outs = eng.step()
        sync(eng.device)
        now = time.perf_counter()
        if decode_steps // 2 <= step < decode_steps:  # only chats decoding, contexts spread out
            step_times.append(now - t0)
        for out in outs:
            rid = out.request_id
            if rid.startswith("chat") and out.new_token_ids:
                if rid in last and step >= decode_steps:
                    gaps.append(now - last[rid])
                last[rid] = now
                if out.finished:
                    start_chat(live.pop(rid))
            elif rid.startswith("long") and out.new_token_ids:
                ttft[rid] = now - arrived[rid]
        step += 1
    for rid in list(live):
        eng.abort(rid)
    eng.step()
    return {"decode_step_s": statistics.median(step_times) if step_times else float("nan"),
            "chat_itl_s": gaps, "long_ttft_s": list(ttft.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chat", type=int, default=8)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=2048)
    ap.add_argument("--budget", default="16,64", help="comma-separated chunked token budgets to compare")
    ap.add_argument("--every", type=int, default=12, help="steps between long-prompt arrivals")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    longs = [torch.randint(1000, 40000, (args.long_tokens,), generator=g).tolist() for _ in range(args.long)]
    seqs = min(args.chat + args.long, 16)
    common = dict(device=args.device, dtype=args.dtype, max_model_len=args.long_tokens + 512, max_num_seqs=seqs,
                  num_kv_blocks=kv_blocks(seqs, args.long_tokens + 512))
    configs = {
        f"chunked (budget {b})": dict(token_budget=b, max_chunk=b) for b in map(int, args.budget.split(","))
    }
    configs |= {
        f"unchunked (budget {args.long_tokens + args.chat})": dict(token_budget=args.long_tokens + args.chat,
                                                                  max_chunk=args.long_tokens),
    }
    results = {}
    for name, knobs in configs.items():
        llm = LLM(model_dir(), **common, **knobs)
        run(llm, 2, longs[:1], 2, 4)  # warm-up
        r = run(llm, args.chat, longs, args.every, 200)
        p99 = float(np.percentile(r["chat_itl_s"], 99))
        r |= {"chat_itl_p99_s": p99, "p99_over_decode_step": p99 / r["decode_step_s"],
              "long_ttft_mean_s": float(np.mean(r["long_ttft_s"]))}
        results[name] = r
        print(f"{name}: decode-only step {r['decode_step_s'] * 1000:.1f} ms, chat p99 ITL {p99 * 1000:.1f} ms "
              f"= {r['p99_over_decode_step']:.2f}× the decode step; long-prompt TTFT {r['long_ttft_mean_s']:.2f} s")
        del llm
    *chunked_runs, unchunked = results.values()
    chunked = chunked_runs[0]
    print("p99 ITL / decode-only step: " + ", ".join(f"{k} {v['p99_over_decode_step']:.2f}×" for k, v in results.items())
          + " (target for chunked ≤ 1.5×)")
    eng_dev = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, r in results.items():
        gaps = np.sort(np.array(r["chat_itl_s"]) * 1000)
        ax.plot(gaps, np.arange(1, len(gaps) + 1) / len(gaps), label=f"{name}: p99 {r['chat_itl_p99_s'] * 1000:.0f} ms")
    ax.axvline(chunked["decode_step_s"] * 1000, ls="--", c="gray", lw=1, label="decode-only step")
    ax.set(xscale="log", xlabel="chat inter-token gap (ms)", ylabel="fraction", title="stalls from long prompts")
    ax.legend(fontsize=8)
    save("stall", {"conditions": conditions(device=eng_dev, chat_streams=args.chat, long_prompts=args.long,
                                            long_tokens=args.long_tokens),
                   "results": {k: {kk: vv for kk, vv in v.items() if kk != "chat_itl_s"} for k, v in results.items()},
                   "target_chunked_p99_over_step": 1.5}, fig)


if __name__ == "__main__":
    main()
