"""The demo's busy-host measurement (chunkpilot.demo.host), on samples fed by hand: other programs count where they
take CPU time the engines could use (the engines' cores, or a cgroup CPU quota smaller than those cores), and
nowhere else."""

from __future__ import annotations

import os

import pytest

from chunkpilot.demo import host
from chunkpilot.demo.host import Quota, Sample, cgroup_path, find_quota, others_share, parse_cpu_max, per_cpu_busy

WALL = 10.0  # seconds between the samples
ENGINE = 1  # our tree's pid in these samples


def samples(busy_cpus: dict[int, float], ours_cpus: float, cores, quota: float | None = None,
            quota_cpus: float | None = None) -> tuple[Sample, Sample]:
    """Two samples WALL seconds apart on a machine whose CPU n was busy busy_cpus[n] of the time, our tree using
    ours_cpus CPUs; with a quota, its cgroup using quota_cpus CPUs."""
    before = Sample(wall=100.0, busy={c: 1000.0 for c in busy_cpus}, ours={ENGINE: 50.0}, cores=frozenset(cores),
                    quota=quota, quota_used=None if quota is None else 5000.0)
    after = Sample(wall=100.0 + WALL, busy={c: 1000.0 + b * WALL for c, b in busy_cpus.items()},
                   ours={ENGINE: 50.0 + ours_cpus * WALL}, cores=frozenset(cores), quota=quota,
                   quota_used=None if quota is None else 5000.0 + quota_cpus * WALL)
    return before, after


def test_a_program_on_a_core_the_engines_do_not_use_takes_nothing_from_them():
    # the engines keep cores 0 and 1 fully busy; another program burns core 2, which they do not run on
    assert others_share(*samples({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}, ours_cpus=2.0, cores={0, 1})) == 0.0


def test_a_program_on_an_engine_core_is_counted_against_the_engines_cores():
    # the engines got 1.5 of their 2 cores; another program took the other half core
    assert others_share(*samples({0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}, ours_cpus=1.5, cores={0, 1})) == pytest.approx(0.25)


def test_with_every_core_and_no_quota_the_share_is_the_machines_as_before():
    # (busy - ours) / (wall x cores) over the whole machine: 4 CPUs busy 2.4 CPUs of it, our tree 1.6
    share = others_share(*samples({0: 0.9, 1: 0.7, 2: 0.5, 3: 0.3}, ours_cpus=1.6, cores={0, 1, 2, 3}))
    assert share == pytest.approx((2.4 - 1.6) / 4)


def test_a_quota_smaller_than_the_cores_is_the_capacity():
    """A 1-CPU quota over 4 cores: our tree used 0.5 CPU and another process in the cgroup 0.5 CPU. It took half of
    what the engines could have had, not an eighth of the cores."""
    before, after = samples({0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}, ours_cpus=0.5, cores={0, 1, 2, 3},
                            quota=1.0, quota_cpus=1.0)
    assert others_share(before, after) == pytest.approx(0.5)


def test_a_quota_counts_only_what_runs_inside_it():
    # the same 1-CPU quota, all of it ours: a program outside the cgroup on the cores shares the cores with us, and
    # the cores are what it is counted against (the quota cannot run out by it)
    before, after = samples({0: 0.5, 1: 0.5, 2: 0.25, 3: 0.25}, ours_cpus=1.0, cores={0, 1, 2, 3},
                            quota=1.0, quota_cpus=1.0)
    assert others_share(before, after) == pytest.approx(0.5 / 4)


def test_a_quota_as_large_as_the_cores_changes_nothing():
    # 2 CPUs of quota for 2 engine cores cannot run out before the cores do: a process of the cgroup on core 3
    # takes nothing from the engines
    before, after = samples({0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}, ours_cpus=2.0, cores={0, 1}, quota=2.0, quota_cpus=3.0)
    assert others_share(before, after) == 0.0


def test_proc_stat_is_read_by_cpu_number():
    # cpu1 is offline: cpu2's line is CPU 2, not the second; guest time is inside user time, iowait is idle
    text = ("cpu  300 0 100 900 50 0 0 0 40 0\n"
            "cpu0 100 0 50 450 50 0 0 10 40 0\n"
            "cpu2 200 0 50 450 0 0 0 0 0 0\n"
            "intr 12345 0\n\n")
    assert per_cpu_busy(text, ticks=100) == {0: pytest.approx(1.6), 2: pytest.approx(2.5)}


def test_cpu_max_says_how_many_cpus_the_quota_allows():
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("max") is None
    assert parse_cpu_max("50000 100000\n") == 0.5
    assert parse_cpu_max("200000 100000") == 2.0
    with pytest.raises(ValueError, match="expected '<quota µs> <period µs>'"):
        parse_cpu_max("fifty 100000")


def test_proc_self_cgroup_gives_the_v2_path():
    assert cgroup_path("0::/user.slice/session-2.scope\n") == "/user.slice/session-2.scope"
    # hybrid: v1 hierarchies beside the v2 one
    assert cgroup_path("12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n") == "/docker/abc"
    assert cgroup_path("0::/\n") == "/"
    assert cgroup_path("2:cpu,cpuacct:/\n1:name=systemd:/\n") is None  # v1 only: no quota read


def fake_root(tmp_path, proc_cgroup: str, cpu_max: dict[str, str]):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(proc_cgroup)
    for d, text in cpu_max.items():
        (tmp_path / "sys/fs/cgroup" / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / "sys/fs/cgroup" / d / "cpu.max").write_text(text)
    return tmp_path


def test_the_tightest_quota_over_this_process_is_found_in_its_cgroup_or_an_ancestor(tmp_path):
    # the parent limits the child to half a CPU although the child itself has no quota
    root = fake_root(tmp_path, "0::/app.slice/demo.scope\n",
                     {"app.slice": "50000 100000\n", "app.slice/demo.scope": "max 100000\n"})
    assert find_quota(root) == Quota(0.5, root / "sys/fs/cgroup/app.slice")


def test_a_quota_is_found_where_the_cgroup_is_namespaced(tmp_path):
    # a container: /proc/self/cgroup says "/" and /sys/fs/cgroup is its own cgroup, with cpu.max
    root = fake_root(tmp_path, "0::/\n", {".": "200000 100000\n"})
    assert find_quota(root) == Quota(2.0, root / "sys/fs/cgroup")
    # a path outside the namespace ("/../..") reads the namespace's root, and ends
    (root / "proc/self/cgroup").write_text("0::/../..\n")
    assert find_quota(root) == Quota(2.0, root / "sys/fs/cgroup")


def test_no_quota_without_cgroup_v2_or_cpu_max(tmp_path):
    assert find_quota(fake_root(tmp_path / "v1", "2:cpu,cpuacct:/\n", {".": "50000 100000\n"})) is None
    assert find_quota(fake_root(tmp_path / "nomax", "0::/a\n", {"a": "max 100000\n"})) is None
    assert find_quota(tmp_path / "nothing") is None


def test_a_sample_reads_the_quotas_cgroup_usage(tmp_path):
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n"
                                       "nr_periods 10\nnr_throttled 3\nthrottled_usec 40000\n")
    s = host.sample({0}, Quota(0.5, tmp_path))
    assert s.quota == 0.5 and s.quota_used == pytest.approx(2.5) and s.cores == {0}
    assert os.getpid() in s.ours and set(s.busy) >= os.sched_getaffinity(0)


def test_the_engines_cores_are_their_groups_or_this_process_affinity():
    from chunkpilot.demo.run import engine_cores

    assert engine_cores({"tuned": [0, 1], "fixed": [2, 3]}) == {0, 1, 2, 3}
    assert engine_cores({}) == os.sched_getaffinity(0)  # unpinned: they inherit this process's
