"""A decode pod's pull read in slices, each checked as it lands, paced so that it takes at most a share of a core.

Why: on the CPU the decode pod's step loop and its pulls share the pod's cores. Read whole, a 1024-token prompt's
pull (45 MiB of SmolLM2's float32 KV: the NIXL read, then a checksum per block) took 110-120 ms of the one core a
decode pod had, and the p99 of the decode steps beside one pull a second was 1.5x theirs alone, 1.06x paced at a
quarter (bench/pull_contention.py): the one long gap is what the p99 inter-token latency of every request decoding
beside the pull reads. Sliced and paced, the
same work spreads over several steps, each a little longer, and no gap takes the whole pull. The price is the
pull's own time (longer by 1/share), which the first token waits for under --first-token with-kv: a prompt sent to
a prefill pod has TTFT to spare where the split pays (TaiChi), and its ITL has none.

A GPU pool is read by the device's copy engines or the NIC, not by the cores the step loop needs: it is read
whole, unpaced, as before."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from chunkpilot.contract.engine_settings import default as setting_default
from chunkpilot.engine.execution.kv_blocks import block_bytes, block_checksums
from chunkpilot.engine.kv_transfer.transport import KVTransport, TransferError
from chunkpilot.engine.kv_transfer.wire import PoolLayout

SLICE_BYTES = 4 << 20  # a slice's read and checksum take a few ms of a core: a fraction of a decode step


class ChecksumMismatch(Exception):
    def __init__(self, bad: int, checked: int, total: int) -> None:
        super().__init__(f"{bad} of the {checked} blocks checked (of {total}) differ from what the prefill pod "
                         "computed")


def slice_blocks(transport: KVTransport) -> int:
    """Blocks per slice: SLICE_BYTES of this pool's blocks, at least one."""
    return max(1, SLICE_BYTES // block_bytes(transport.pool, transport.block_size))


def paced_read(transport: KVTransport, agent: str, fetch_metadata: Callable[[], bytes], remote: PoolLayout,
               remote_blocks: Sequence[int], local_blocks: Sequence[int], checksums: Sequence[int], timeout: float, *,
               share: float = setting_default("pull_share"), sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> int:
    """Read `remote_blocks` of `agent` into `local_blocks` slice by slice, checking each slice's blocks against
    `checksums` as it lands and pausing after it so that the pull works at most `share` of the wall time
    (--pull-share; a pool on a GPU is read whole whatever it says). Returns the bytes moved. Raises TransferError
    (the transport's; also when the whole read passes `timeout`) or ChecksumMismatch, after which no further slice
    is read."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    if transport.pool.device.type == "cuda":
        share = 1.0
    step = slice_blocks(transport) if share < 1 else len(local_blocks) or 1
    deadline = clock() + timeout
    moved = 0
    for lo in range(0, len(local_blocks), step):
        started = clock()
        left = deadline - started
        if left <= 0:
            raise TransferError(f"the read from {agent!r} took over {timeout:.1f} s ({lo} of {len(local_blocks)} "
                                "blocks read)")
        local = local_blocks[lo:lo + step]
        moved += transport.read(agent, fetch_metadata, remote, remote_blocks[lo:lo + step], local, left)
        got = block_checksums(transport.pool, transport.block_size, local)
        bad = sum(a != b for a, b in zip(got, checksums[lo:lo + step], strict=True))
        if bad:
            raise ChecksumMismatch(bad, lo + len(local), len(local_blocks))
        if share < 1 and lo + step < len(local_blocks):
            sleep((clock() - started) * (1 - share) / share)
    return moved
