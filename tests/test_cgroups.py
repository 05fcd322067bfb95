"""What a process's control groups grant it: reading them (cgroup v1 and v2, every level), and a run in a
real cgroup with a CPU quota taking threads for the CPU time it has, not for the cores it sees."""

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import read_summary

from aamperf.cgroups import cgroup_dirs, cpu_quota, memory_limits


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_reads_every_level_and_the_lowest_quota_binds(tmp_path):
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "0::/pod/job\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "pod" / "cpu.max", "250000 100000\n")  # the pod: 2.5 cores
    write(root / "pod" / "job" / "cpu.max", "max 100000\n")  # the job itself: no limit of its own
    write(root / "pod" / "memory.max", "1073741824\n")
    write(root / "pod" / "job" / "memory.max", "max\n")
    assert cgroup_dirs("cpu", proc, root) == [(root / "pod" / "job", 2), (root / "pod", 2), (root, 2)]
    assert cpu_quota(proc, root) == 2.5 and memory_limits(proc, root) == [2**30]
    write(root / "pod" / "job" / "cpu.max", "150000 100000\n")
    assert cpu_quota(proc, root) == 1.5


def test_v1_reads_its_controllers_hierarchy_and_minus_one_is_no_limit(tmp_path):
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    write(proc, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n0::/\n")
    write(root / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(proc, root) is None
    # a container without a cgroup namespace: its own group is mounted as the hierarchy's root
    write(root / "cpu" / "cpu.cfs_quota_us", "50000\n")
    write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(proc, root) == 0.5
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert memory_limits(proc, root) == [9223372036854771712]  # v1's "no limit": above any machine's RAM
    assert cpu_quota(tmp_path / "missing", root) is None and memory_limits(tmp_path / "missing", root) == []


def test_the_core_budget_is_the_quota_rounded_up_within_the_cores(monkeypatch):
    import aamperf.cgroups as cgroups

    cores = len(os.sched_getaffinity(0))
    for quota, budget in ((None, cores), (0.3, 1), (1.0, 1), (1.5, min(cores, 2)), (10_000.0, cores)):
        monkeypatch.setattr(cgroups, "cpu_quota", lambda quota=quota: quota)
        assert cgroups.core_budget() == budget


@contextmanager
def cpu_cgroup(quota_cores: float):
    """A real cgroup with a CPU quota (v1's cpu controller or v2's cpu.max), removed afterwards; the
    test is skipped where this process may not make one (not root, a read-only /sys/fs/cgroup)."""
    period = 100000
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        group, files = (
            v1 / f"aamperf_test_{os.getpid()}",
            {"cpu.cfs_quota_us": str(int(quota_cores * period))},
        )
    elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        group, files = (
            v2 / f"aamperf_test_{os.getpid()}",
            {"cpu.max": f"{int(quota_cores * period)} {period}"},
        )
    else:
        pytest.skip("no cgroup cpu controller here to give a run a CPU quota")
    try:
        group.mkdir()
        for name, text in files.items():
            (group / name).write_text(text)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup with a CPU quota here ({exc.strerror}): needs root")
    try:
        yield group
    finally:
        group.rmdir()  # its processes have ended


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_run_under_a_cpu_quota_takes_threads_for_the_time_it_has(launch):
    if len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2:
        pytest.skip("needs 2 cores and torch's 2 threads to tell the quota's threads from the cores'")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with cpu_cgroup(1.0) as group:
        enter = ("sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable)
        runs = {
            name: launch(*overrides, name=name, launcher=enter, env=env)
            for name, overrides in {"quota": (), "given": ("system.num_threads=2",)}.items()
        }
        # predict, on the run just trained, in the same cgroup
        trained = f"run={runs['quota'].run_dir}"
        predicted = launch(
            trained, name="predict", module="aamperf.predict", tiny=False, launcher=enter, env=env
        )
    for proc, _ in [*runs.values(), predicted]:
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_summary(predicted.run_dir)["threads"]["intra_op"] == 1
    quota, given = (read_summary(run_dir) for _, run_dir in runs.values())
    threads = quota["phases"]["threads"]
    assert threads["intra_op"] == 1 and threads["cpu_quota"] == 1.0
    assert threads["note"].startswith("cgroup CPU quota 1 cores: intra-op threads 1, not torch's")
    assert quota["machine"].endswith("(a CPU quota of 1)")
    # what the user set stands; the quota is still named beside it
    assert given["phases"]["threads"]["intra_op"] == 2 and "note" not in given["phases"]["threads"]
    assert given["phases"]["threads"]["cpu_quota"] == 1.0
