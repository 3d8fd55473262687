"""What one tensor-parallel rank holds of a Llama-family model (Megatron-style), as plain numbers.

q/k/v and gate/up are column-parallel (each rank computes its own heads and its slice of the MLP), o and down are
row-parallel (each rank's partial sums meet in one all-reduce). With fewer KV heads than ranks, each KV head is
replicated on the ranks whose query heads use it, as vLLM does. The embedding and lm_head are vocab-parallel:
each rank holds a contiguous slice of the vocabulary's rows, so no rank carries the whole table (with a 128k
vocabulary that is 2 GiB of bf16 per rank at 8192 hidden, replicated).

Pure: the weight loader, the model and the KV pool read their sizes from here, and the checks run before any
process starts, so a size that does not divide gives one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.engine.model.model_config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    rank: int
    world: int
    heads: int  # query heads on this rank
    head_start: int  # first query head
    kv_heads: int  # KV heads on this rank (1 when they are replicated)
    kv_head_start: int
    intermediate: int  # this rank's slice of the MLP
    vocab_start: int
    vocab_rows: int  # rows of the vocabulary slice, padded so every rank's slice has the same size
    vocab_size: int  # the whole vocabulary

    @property
    def vocab_end(self) -> int:
        """End of the real rows (the last rank's slice may be shorter than `vocab_rows`)."""
        return min(self.vocab_start + self.vocab_rows, self.vocab_size)

    @property
    def intermediate_start(self) -> int:
        return self.rank * self.intermediate

    @property
    def owns_bias(self) -> bool:
        """Row-parallel layers add their bias once, on rank 0, so the all-reduce sums it once."""
        return self.rank == 0


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError saying what to change when `world` ranks cannot split this model evenly."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world!r}")
    if world == 1:
        return
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    divisors = ", ".join(str(d) for d in range(1, heads + 1)
                         if heads % d == 0 and _kv_fits(kv, d) and cfg.intermediate_size % d == 0)
    if heads % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's {heads} attention heads; "
                         f"choose one of {divisors}")
    if not _kv_fits(kv, world):
        raise ValueError(f"tensor_parallel_size {world} and the model's {kv} KV heads: one must divide the other "
                         f"(each rank holds whole KV heads); choose one of {divisors}")
    if cfg.intermediate_size % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's intermediate_size "
                         f"{cfg.intermediate_size}; choose one of {divisors}")


def _kv_fits(kv_heads: int, world: int) -> bool:
    return kv_heads % world == 0 or world % kv_heads == 0


def shard_of(cfg: ModelConfig, rank: int, world: int) -> TPShard:
    check_tensor_parallel(cfg, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world}")
    heads = cfg.num_attention_heads // world
    kv = cfg.num_key_value_heads
    if kv >= world:
        kv_heads, kv_start = kv // world, rank * (kv // world)
    else:  # replicated: ranks [i * world/kv, (i+1) * world/kv) all hold KV head i, which their query heads use
        kv_heads, kv_start = 1, rank // (world // kv)
    vocab_rows = -(-cfg.vocab_size // world)
    return TPShard(
        rank=rank, world=world, heads=heads, head_start=rank * heads, kv_heads=kv_heads, kv_head_start=kv_start,
        intermediate=cfg.intermediate_size // world, vocab_start=rank * vocab_rows, vocab_rows=vocab_rows,
        vocab_size=cfg.vocab_size,
    )


def whole(cfg: ModelConfig) -> TPShard:
    """The single-rank case: the whole model."""
    return shard_of(cfg, 0, 1)
