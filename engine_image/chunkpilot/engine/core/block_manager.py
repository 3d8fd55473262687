"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts, prefix caching.

Pure Python, no tensors: the pool itself lives in `kv_cache.KVCache`; this class only decides which slot of the
pool each token's K/V goes to. Prefix caching follows vLLM: a full block is named by a hash chained over all the
tokens before it, so equal hashes mean equal prefixes. A block whose reference count drops to zero keeps its hash
and stays findable until the allocator hands it out again (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from chunkpilot.engine.core.sequence import Sequence


def block_hash(parent: bytes | None, tokens: Seq[int], salt: bytes = b"") -> bytes:
    """Hash of one full block, chained on its parent's hash so it identifies the whole prefix. The first block
    also takes the sequence's cache salt (as vLLM's `cache_salt`): sequences salted differently share nothing."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root:" + salt)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(frozen=True)
class CacheShape:
    """The KV cache's shape as others read it (vLLM's cache_config_info: an endpoint picker sizes its prefix index
    by it)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (front = least recently freed). A free block may still carry a hash.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        # Hashes of each sequence's full blocks, in order (prefix caching only).
        self._seq_hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # ---- accounting -------------------------------------------------------------------------------------
    @property
    def cache_shape(self) -> CacheShape:
        return CacheShape(self.block_size, self.num_blocks, self.enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def free_slots_for(self, seq: Sequence) -> int:
        """How many more tokens `seq` could take right now (its last block's room plus every free block)."""
        room = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return room + self.num_free_blocks * self.block_size

    # ---- prefix cache -----------------------------------------------------------------------------------
    def match_prefix(self, token_ids: Seq[int], salt: bytes = b"") -> list[int]:
        """Blocks that already hold a prefix of `token_ids`. The last token is never matched: the model must
        compute at least one position to produce the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent: bytes | None = None
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs], salt)
            block = self._block_of_hash.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_prompt(self, seq: Sequence, first_chunk: int) -> bool:
        """Admit a sequence that holds no blocks: reuse cached prefix blocks, then allocate for `first_chunk`
        tokens after them. Returns False and changes nothing if the pool cannot hold it."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        token_ids = seq.token_ids
        cached = self.match_prefix(token_ids, seq.cache_salt)
        num_cached_tokens = len(cached) * self.block_size
        first_chunk = min(first_chunk, len(token_ids) - num_cached_tokens)
        need_total = -(-(num_cached_tokens + first_chunk) // self.block_size)
        # Cached blocks with no owner sit in the free list: taking them uses up free capacity too.
        reclaimed = sum(1 for b in cached if self.ref_counts[b] == 0)
        if need_total - len(cached) + reclaimed > self.num_free_blocks:
            return False
        self.prefix_queries += len(token_ids)
        self.prefix_hits += num_cached_tokens
        for b in cached:
            self._take(b)
        seq.block_table = list(cached)
        seq.num_computed_tokens = num_cached_tokens
        seq.num_cached_tokens = num_cached_tokens
        if self.enable_prefix_caching:
            self._seq_hashes[seq.request_id] = [self._hash_of_block[b] for b in cached]
        self._grow(seq, need_total - len(cached))
        return True

    # ---- growth and release -----------------------------------------------------------------------------
    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block table cover `num_new_tokens` more tokens. All or nothing."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        self._grow(seq, need)
        return True

    def commit(self, seq: Sequence) -> None:
        """Called after a step computed tokens of `seq`: name every newly filled block so others can reuse it."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        full = seq.num_computed_tokens // self.block_size
        if len(hashes) >= full:
            return
        token_ids = seq.token_ids
        bs = self.block_size
        for i in range(len(hashes), full):
            h = block_hash(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], seq.cache_salt)
            hashes.append(h)
            block = seq.block_table[i]
            # Another sequence may have computed the same prefix at the same time: keep the first one findable.
            if h not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[h] = block
                self._hash_of_block[block] = h

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (speculative decoding reserved them for drafts the model
        rejected). They are private and unnamed: only full computed blocks are ever hashed or shared."""
        keep = -(-len(seq) // self.block_size)
        for b in reversed(seq.block_table[keep:]):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] != 0:
                raise RuntimeError(f"block {b} past sequence {seq.request_id}'s computed tokens is shared")
            self._free[b] = None
            self._free.move_to_end(b, last=False)  # unnamed: reused first, before any block a prefix could hit
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Tail blocks go to the free list first so they are evicted first."""
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} freed more often than it was taken")
            if self.ref_counts[b] == 0:
                self._free[b] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq.request_id, None)

    def hold(self, seq: Sequence) -> list[int]:
        """Take a finished sequence's blocks away from it without releasing them: a prefill pod holds them under
        a lease until the decode pod has pulled them (`release`). Full blocks stay findable by their hashes, so
        other prompts may share them meanwhile; nobody can be handed them for new tokens."""
        blocks, seq.block_table = seq.block_table, []
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq.request_id, None)
        return blocks

    def release(self, blocks: Seq[int]) -> None:
        """Give back blocks taken by `hold` (the lease ended: acknowledged, aborted or expired)."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b} released more often than it was taken")
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> None:
        self._block_of_hash.clear()
        self._hash_of_block.clear()

    # ---- internals --------------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _grow(self, seq: Sequence, n: int) -> None:
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            stale = self._hash_of_block.pop(block, None)
            if stale is not None:
                del self._block_of_hash[stale]
            self.ref_counts[block] = 1
            seq.block_table.append(block)
