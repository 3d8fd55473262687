"""A stand-in for ModelRunner that checks the scheduler's and block manager's work.

It keeps a simulated KV pool: each computed token writes what its real K/V would depend on (the whole prefix up to
and including it) into the slot its block table names. Before computing, it reads back every earlier position
through the block table and checks it holds the right prefix, so a wrong block table, a leaked or reused block, or a bad prefix-cache hit shows up as an error.
The next token is a function of the tokens read from the pool, so outputs depend only on each sequence's own
history, exactly like a real model's greedy decode.
"""

from __future__ import annotations

from chunkpilot.engine.core.scheduler import RunnerOutput, SchedulerOutput


def next_token(history: list[int], vocab: int) -> int:
    return (sum(history[-3:]) * 31 + len(history) * 7) % vocab


class FakeRunner:
    def __init__(self, num_slots: int, block_size: int, vocab: int = 50) -> None:
        self.pool: list[tuple[int, ...] | None] = [None] * num_slots
        self.block_size = block_size
        self.vocab = vocab

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        sampled, verified = {}, {}
        # Write every chunk's tokens first (as the real model does, layer by layer), then read. A decode's draft
        # tokens are written after its last token, at the positions they would take.
        for c in sched.chunks:
            tokens = c.seq.token_ids + c.draft_token_ids
            for pos in range(c.start, c.start + c.num_tokens):
                self.pool[self._slot(c.seq.block_table, pos)] = tuple(tokens[: pos + 1])
        for c in sched.chunks:
            tokens = c.seq.token_ids + c.draft_token_ids
            end = c.start + c.num_tokens
            seen = [self.pool[self._slot(c.seq.block_table, p)] for p in range(end)]
            want = [tuple(tokens[: p + 1]) for p in range(end)]
            if seen != want:
                bad = next(p for p in range(end) if seen[p] != want[p])
                raise AssertionError(f"KV pool corrupt for {c.seq.request_id} at position {bad}")
            if c.draft_token_ids:  # greedy verification: keep drafts while they are the model's next token
                first = len(c.seq)
                out = []
                for i, d in enumerate(c.draft_token_ids):
                    out.append(next_token(list(seen[first - 1 + i]), self.vocab))
                    if out[-1] != d:
                        break
                else:
                    out.append(next_token(list(seen[-1]), self.vocab))
                verified[c.seq.request_id] = out
            elif c.samples:
                sampled[c.seq.request_id] = next_token(list(seen[-1]), self.vocab)
        return RunnerOutput(sampled=sampled, verified=verified)


def reference_output(prompt: list[int], max_tokens: int, vocab: int, eos: tuple[int, ...] = ()) -> list[int]:
    history, out = list(prompt), []
    while len(out) < max_tokens:
        t = next_token(history, vocab)
        history.append(t)
        out.append(t)
        if t in eos:
            break
    return out
