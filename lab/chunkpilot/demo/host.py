"""How busy the host is with other programs: the share of the CPU time the engines could use that went neither to
this process and its children (the engines, Prometheus, the load generator and the tuner) nor to idle.

The demo's sizing measures step times and latencies on a shared machine; a check taken while something else used
the engines' cores measures that program, not the engines. Reading the kernel's CPU accounting (/proc/stat's
per-CPU lines, and psutil: each process's /proc/PID/stat) tells the sizing to repeat such a check rather than
resize on it, and lets the report say how busy the host was in each phase. Time the hypervisor gave to other
guests (`steal`) counts as busy too: on a shared VM that is the usual neighbour.

What the engines can use is not the whole machine:

* **their cores.** The demo pins each group's engines to cores of its own (`run.placement`), so a program on other
  cores takes nothing from them, while one on their cores takes time they wanted. Busy time is summed over those
  cores alone, and the capacity is those cores.
* **a cgroup v2 CPU quota** (`cpu.max`, this process's cgroup's or an ancestor's) smaller than those cores. Then
  the quota, not the cores, is what runs out, and other processes inside the quota's cgroup take from it whichever
  cores they run on: the cgroup's own usage (`cpu.stat` usage_usec) less this tree's, over the quota, is their
  share. The larger of the two shares is the one reported, since either bottleneck slows the engines. The
  cgroup's throttling is not counted: this tree's own demand throttles it as well, so it says that the quota ran
  out, not who took it; usage less this tree's says who.

The kernel keeps no per-core account per process, so all of this tree's CPU time is taken off the engines' cores,
also what a helper (unpinned, at nice 5) spent on another core: where the engines leave cores free, the share can
understate others by at most the helpers' own time. With the engines on every core and no quota, this is the
machine's share, as before."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """Cumulative CPU seconds at one moment: each CPU's busy time, this process tree's, and the wall clock; with a
    quota, what the quota's cgroup used."""

    wall: float
    busy: dict[int, float]  # by CPU number: non-idle seconds, steal included (every online CPU, not just `cores`)
    ours: dict[int, float]  # per process of this tree (a pid's total, so one that exits between samples drops out)
    cores: frozenset[int]  # the CPUs measured: the engines'
    quota: float | None = None  # CPUs the cgroup v2 quota allows (cpu.max), None without one
    quota_used: float | None = None  # seconds the quota's cgroup used (its cpu.stat usage_usec)


def others_share(before: Sample, after: Sample) -> float:
    """The share of the engines' CPU capacity between the two samples that other programs took (0 to 1): on their
    cores, and, where a cgroup quota is smaller than those cores, in the quota; the larger. A process of this
    tree that started in between counts whole; one that exited counts nothing (its last seconds are lost to the
    accounting, which can only overstate the others, never hide them)."""
    wall = after.wall - before.wall
    # a CPU missing from either sample (offline) ran nothing here: it is no capacity either
    cores = [c for c in after.cores if c in before.busy and c in after.busy]
    if wall <= 0 or not cores:
        return 0.0
    ours = sum(t - before.ours.get(pid, 0.0) for pid, t in after.ours.items())
    on_cores = sum(after.busy[c] - before.busy[c] for c in cores) - ours
    share = on_cores / (wall * len(cores))
    # a quota at least as large as the cores cannot run out before they do: the cores are the capacity
    if (after.quota is not None and after.quota < len(cores)
            and before.quota_used is not None and after.quota_used is not None):
        share = max(share, (after.quota_used - before.quota_used - ours) / (wall * after.quota))
    return min(1.0, max(0.0, share))


def per_cpu_busy(proc_stat: str, ticks: float) -> dict[int, float]:
    """Each CPU's busy seconds from /proc/stat's `cpuN` lines (in clock ticks), by CPU number: the number in the
    line, not its position, since an offline CPU has no line and would shift every later one."""
    busy = {}
    for line in proc_stat.splitlines():
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or name == "cpu":  # "cpu" alone is the machine's total
            continue
        # user nice system idle iowait irq softirq steal guest guest_nice; guest time is already inside user and
        # nice time: counted once
        values = [float(v) for v in fields[:10]] + [0.0] * (10 - len(fields[:10]))
        busy[int(name[3:])] = (sum(values) - values[3] - values[4] - values[8] - values[9]) / ticks
    return busy


def cgroup_path(proc_self_cgroup: str) -> str | None:
    """This process's cgroup v2 path from /proc/self/cgroup (its "0::/path" line), None with cgroup v1 alone."""
    for line in proc_self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return path.strip()
    return None


def parse_cpu_max(text: str) -> float | None:
    """The CPUs a cgroup v2 cpu.max allows: "50000 100000" (quota and period, µs) is 0.5; "max 100000" is None."""
    fields = text.split()
    if fields[:1] == ["max"]:
        return None
    try:
        quota, period = (int(f) for f in fields)
        if quota <= 0 or period <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"cpu.max reads {text.strip()!r}: expected '<quota µs> <period µs>' or 'max <period µs>' "
                         "(cgroup v2)") from None
    return quota / period


def parse_cpu_stat(text: str) -> dict[str, int]:
    """cgroup v2 cpu.stat ("usage_usec 123" per line) as a dict."""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


@dataclass(frozen=True)
class Quota:
    cpus: float  # quota / period
    cgroup: Path  # the directory whose cpu.max sets it: its cpu.stat counts every process the quota limits


def find_quota(root: Path = Path("/")) -> Quota | None:
    """The tightest cgroup v2 CPU quota over this process: its cgroup's cpu.max or an ancestor's (a parent's quota
    limits all its children together), None without one. `root` is the filesystem's root (tests pass another)."""
    try:
        path = cgroup_path((root / "proc/self/cgroup").read_text())
    except OSError:
        return None
    if path is None:
        return None
    base = root / "sys/fs/cgroup"
    parts = [p for p in path.split("/") if p]
    if ".." in parts:  # a cgroup outside this cgroup namespace: the namespace's root is the nearest we can read
        parts = []
    found = None
    for i in range(len(parts), -1, -1):  # this cgroup, then each ancestor up to the mount's root
        d = base.joinpath(*parts[:i])
        try:
            cpus = parse_cpu_max((d / "cpu.max").read_text())
        except OSError:  # no such cgroup here (not namespaced), or no cpu controller on it
            continue
        except ValueError as e:
            log.warning("%s: %s; not counting this CPU quota", d / "cpu.max", e)
            continue
        if cpus is not None and (found is None or cpus < found.cpus):
            found = Quota(cpus, d)
    return found


def sample(cores: Iterable[int] | None = None, quota: Quota | None = None) -> Sample:
    """Now's sample, measuring `cores` (None: every CPU) and `quota` (None: none)."""
    with open("/proc/stat") as f:
        busy = per_cpu_busy(f.read(), os.sysconf("SC_CLK_TCK"))
    me = psutil.Process(os.getpid())
    ours = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            ours[p.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    used = None
    if quota is not None:
        try:
            used = parse_cpu_stat((quota.cgroup / "cpu.stat").read_text())["usage_usec"] / 1e6
        except (OSError, KeyError, ValueError):  # unreadable now: this interval is judged on the cores alone
            used = None
    return Sample(wall=time.monotonic(), busy=busy, ours=ours, cores=frozenset(busy if cores is None else cores),
                  quota=quota.cpus if quota is not None else None, quota_used=used)


class Busy:
    """A running measurement: `Busy(cores)` starts it on the engines' cores (None: every CPU), and under this
    process's cgroup v2 quota if it has one; `.share()` reads the other programs' share since then."""

    def __init__(self, cores: Iterable[int] | None = None) -> None:
        self.cores = frozenset(cores or ()) or None  # no cores named: every CPU, never none
        self.quota = find_quota()
        self.start = sample(self.cores, self.quota)

    def share(self) -> float:
        return others_share(self.start, sample(self.cores, self.quota))
