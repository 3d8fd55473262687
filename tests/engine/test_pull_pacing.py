"""The decode side's paced pull (kv_transfer/pacing.py) on small CPU pools through the in-process transport, with
its clock and pauses scripted: slice by slice, each slice checked as it lands, a pause after each but the last that
keeps the pull to its share of the wall time, a whole read at share 1, nothing read after a bad slice, the
deadline across slices. And the setting that sets the share refuses what is not one."""

from __future__ import annotations

import pytest
import torch

from chunkpilot.engine.execution.kv_blocks import block_bytes, block_checksums
from chunkpilot.engine.kv_transfer import pacing
from chunkpilot.engine.kv_transfer.pacing import ChecksumMismatch, paced_read, slice_blocks
from chunkpilot.engine.kv_transfer.transport import InProcessTransport, TransferError

BLOCK = 4
SHAPE = (2, 2, 64 * BLOCK, 2, 8)  # layers, K/V, slots, kv heads, head dim: 64 blocks of 1 KiB in float32


class Script:
    """A clock each read moves on by one second, the pauses asked for, the reads made."""

    def __init__(self) -> None:
        self.now, self.pauses, self.reads = 0.0, [], []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.now += s


class Counting(InProcessTransport):
    script: Script
    corrupt: int | None = None  # a local block overwritten after it lands

    def read(self, agent, fetch, remote, remote_blocks, local_blocks, timeout):
        self.script.reads.append((list(local_blocks), timeout))
        self.script.now += 1.0
        n = super().read(agent, fetch, remote, remote_blocks, local_blocks, timeout)
        if self.corrupt in local_blocks:
            self.pool[0, 0, self.corrupt * BLOCK] += 1.0
        return n


@pytest.fixture
def pools(monkeypatch, request):
    monkeypatch.setattr(pacing, "SLICE_BYTES", 5 * 1024)  # five blocks a slice
    src = InProcessTransport(f"src-{request.node.name}", torch.randn(SHAPE), BLOCK)
    dst = Counting(f"dst-{request.node.name}", torch.zeros(SHAPE), BLOCK)
    dst.script = Script()
    yield src, dst
    src.close()
    dst.close()


def pull(src, dst, n: int, *, share: float, timeout: float = 60.0):
    remote, local = list(range(n)), list(range(32, 32 + n))
    sums = block_checksums(src.pool, BLOCK, remote)
    s = dst.script
    return paced_read(dst, src.name, src.metadata, src.layout, remote, local, sums, timeout, share=share,
                      sleep=s.sleep, clock=s.clock), local


def test_a_paced_pull_reads_slice_by_slice_and_pauses_to_keep_its_share(pools):
    src, dst = pools
    assert block_bytes(dst.pool, BLOCK) == 1024 and slice_blocks(dst) == 5
    moved, local = pull(src, dst, 12, share=0.25)
    s = dst.script
    assert [r[0] for r in s.reads] == [local[:5], local[5:10], local[10:]]
    # each slice took 1 s: 3 s of pause after it keeps the pull to a quarter of the wall time; none after the last
    assert s.pauses == [3.0, 3.0]
    assert moved == 12 * 1024
    assert torch.equal(dst.pool[:, :, 32 * BLOCK:44 * BLOCK], src.pool[:, :, :12 * BLOCK])


def test_share_one_reads_whole_without_a_pause(pools):
    src, dst = pools
    _, local = pull(src, dst, 12, share=1.0)
    assert [r[0] for r in dst.script.reads] == [local] and dst.script.pauses == []


def test_a_bad_slice_stops_the_pull_and_says_how_many_blocks_differ(pools):
    src, dst = pools
    dst.corrupt = 32 + 6  # a block of the second slice
    with pytest.raises(ChecksumMismatch, match="1 of the 10 blocks checked \\(of 12\\) differ"):
        pull(src, dst, 12, share=0.5)
    assert len(dst.script.reads) == 2  # the third slice was never read


def test_the_timeout_holds_for_the_whole_pull_not_each_slice(pools):
    src, dst = pools
    # 1 s a slice, then 1 s of pause at share 0.5: the second slice starts at 2 s (1.5 s left), the third at 4 s
    with pytest.raises(TransferError, match="took over 3.5 s \\(10 of 12 blocks read\\)"):
        pull(src, dst, 12, share=0.5, timeout=3.5)
    assert [t for _, t in dst.script.reads] == [3.5, 1.5]  # each read given what was left of the deadline


def test_a_share_outside_zero_to_one_is_refused(pools):
    src, dst = pools
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="share must be in"):
            pull(src, dst, 4, share=share)


def test_the_pull_share_setting_is_refused_outside_zero_to_one_naming_the_flag():
    from chunkpilot.engine.config import EngineConfig
    from chunkpilot.engine.serving.server import ServerSettings

    for share in (0.0, -1.0, 1.01):
        with pytest.raises(ValueError, match="pull-share must be > 0 and <= 1"):
            ServerSettings(EngineConfig(model="unused"), pull_share=share)
    assert ServerSettings(EngineConfig(model="unused"), pull_share=1.0).pull_share == 1.0
