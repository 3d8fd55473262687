"""How busy the host is with other programs: the share of the machine's CPU time that went neither to this process
and its children (the engines, Prometheus, the load generator and the tuner) nor to idle.

The demo's sizing measures step times and latencies on a shared machine; a check taken while something else used
the cores measures that program, not the engines. Reading the kernel's CPU accounting (psutil: /proc/stat and each
process's /proc/PID/stat) tells the sizing to repeat such a check rather than resize on it, and lets the report
say how busy the host was in each phase. Time the hypervisor gave to other guests (`steal`) counts as busy too:
on a shared VM that is the usual neighbour."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Sample:
    """Cumulative CPU seconds at one moment: the machine's busy time, this process tree's, and the wall clock."""

    wall: float
    busy: float  # every CPU's non-idle time, steal included
    ours: dict[int, float]  # per process of this tree (a pid's total, so one that exits between samples drops out)
    cores: int


def others_share(before: Sample, after: Sample) -> float:
    """The share of the machine's CPU time between the two samples that other programs took (0 to 1). A process of
    this tree that started in between counts whole; one that exited counts nothing (its last seconds are lost to
    the accounting, which can only overstate the others, never hide them)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    ours = sum(t - before.ours.get(pid, 0.0) for pid, t in after.ours.items())
    return min(1.0, max(0.0, (after.busy - before.busy - ours) / (wall * after.cores)))


def sample() -> Sample:
    times = psutil.cpu_times()
    busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
    # guest time is already inside user time on Linux: counted once
    busy -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    me = psutil.Process(os.getpid())
    ours = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            ours[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return Sample(wall=time.monotonic(), busy=busy, ours=ours, cores=psutil.cpu_count() or 1)


class Busy:
    """A running measurement: `Busy()` starts it, `.share()` reads the other programs' share since then."""

    def __init__(self) -> None:
        self.start = sample()

    def share(self) -> float:
        return others_share(self.start, sample())
