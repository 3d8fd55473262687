"""Speculative decoding (prompt-lookup n-gram drafts) against none, side by side in one run on the same threads:
output tokens/s and inter-token latency at batch 1 and 8, on a workload whose outputs repeat their prompt (copy or
edit a given passage) and on one whose outputs do not (open questions), with the acceptance rate per draft
position. Targets (issue 38): >= 1.5x at batch 1 on the first, >= 0.95x on the second (drafting pauses itself
where drafts are not kept).

    python bench/speculative.py [--threads 2] [--tokens 128] [--k 2] [--min-n 1]

Requests are greedy, up to --tokens tokens or the model's end of turn (not ignored: after it, a 135M model's
text no longer follows the prompt, which would measure something else); both engines do the same work, their
outputs being equal token for token (checked here). ITL is each request's (last token - first token) / (tokens - 1),
from the engine's own step loop. Writes bench/results/speculative.json and .png."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import conditions, model_dir, pyplot, save

from chunkpilot.engine import LLM, SamplingParams

TEXT = (Path(__file__).resolve().parent / "data" / "quality_text.md").read_text()
PARAGRAPHS = [p.strip() for p in TEXT.split("\n\n") if 250 <= len(p.strip()) <= 700][:8]
REPEAT = ([[{"role": "user", "content": f"Repeat this paragraph word for word:\n\n{p}"}] for p in PARAGRAPHS[:4]]
          + [[{"role": "user", "content": f"Fix the spelling in this paragraph and return it whole:\n\n{p}"}]
             for p in PARAGRAPHS[4:8]])
FRESH = [[{"role": "user", "content": q}] for q in (
    "Why is the sky blue?", "Write a short poem about the sea.", "How do vaccines train the immune system?",
    "Give three tips for a job interview.", "What causes the seasons on Earth?", "Tell a story about a robot chef.",
    "Explain recursion to a child.", "What should I pack for a weekend hike?")]


def run(llm: LLM, conversations: list, batch: int, tokens: int) -> dict:
    """Requests `batch` at a time through the engine's step loop; per-request timings and the draft counts."""
    eng = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    itls, outputs, total_tokens = [], [], 0
    drafts = kept = 0
    per_pos: list[int] = []
    t0 = time.perf_counter()
    for lo in range(0, len(conversations), batch):
        first, seqs = {}, {}
        for i, conv in enumerate(conversations[lo : lo + batch]):
            rid = f"r{lo + i}"
            seqs[rid] = eng.make_sequence(rid, params=params, messages=conv)
            eng.submit(seqs[rid])
        while eng.has_unfinished():
            for out in eng.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                if out.finished:
                    n = out.num_output_tokens
                    itls.append((now - first[out.request_id]) / max(1, n - 1))
                    total_tokens += n
            s = eng.last_step
            drafts += s.num_draft_tokens
            kept += s.num_accepted_tokens
            for p, k in enumerate(s.accepted_per_position):
                per_pos += [0] * (p + 1 - len(per_pos))
                per_pos[p] += k
        outputs += [seqs[r].output_token_ids for r in sorted(seqs, key=lambda r: int(r[1:]))]
    wall = time.perf_counter() - t0
    return {"tokens_per_s": total_tokens / wall, "itl_ms": 1e3 * statistics.mean(itls), "draft_tokens": drafts,
            "accepted_tokens": kept, "acceptance": kept / drafts if drafts else None, "accepted_per_position": per_pos,
            "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    ap.add_argument("--min-n", type=int, default=1, help="prompt_lookup_min")
    ap.add_argument("--max-n", type=int, default=4, help="prompt_lookup_max")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.min_n,
            "prompt_lookup_max": args.max_n}
    rows = []
    for workload, convs in (("repeats the prompt", REPEAT), ("does not repeat", FRESH)):
        for batch in (1, 8):
            row = {"workload": workload, "batch": batch}
            for name, config in (("off", None), ("on", spec)):
                llm = LLM(model_dir(), threads=args.threads, token_budget=256, max_chunk=256, max_num_seqs=8,
                          max_model_len=2048, speculative_config=config)
                try:
                    llm.generate("warm up", SamplingParams(max_tokens=4))
                    row[name] = run(llm, convs, batch, args.tokens)
                finally:
                    llm.engine.close()
            same = row["off"].pop("outputs") == row["on"].pop("outputs")
            row.update(speedup=row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"],
                       itl_ratio=row["on"]["itl_ms"] / row["off"]["itl_ms"], outputs_equal=same)
            on = row["on"]
            acc = f"{on['acceptance']:.0%}" if on["acceptance"] is not None else "no drafts"
            print(f"{workload:>18}, batch {batch}: {row['off']['tokens_per_s']:.1f} -> {on['tokens_per_s']:.1f} "
                  f"tokens/s ({row['speedup']:.2f}x), ITL {row['off']['itl_ms']:.1f} -> {on['itl_ms']:.1f} ms, "
                  f"{on['draft_tokens']} drafts, {acc} kept, per position {on['accepted_per_position']}, "
                  f"outputs {'equal' if same else 'DIFFER'}")
            rows.append(row)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in rows]
    ax.bar(labels, [r["speedup"] for r in rows], color=["C2" if r["speedup"] >= 1 else "C3" for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="tokens/s, drafts on / off", title=f"n-gram speculative decoding, k={args.k}, {args.threads} threads")
    ax.tick_params(axis="x", labelsize=7)
    save("speculative", {"conditions": conditions(threads=args.threads, tokens=args.tokens, speculative=spec),
                         "rows": rows}, fig)


if __name__ == "__main__":
    main()
