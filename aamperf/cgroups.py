"""What this process is granted: the CPUs it may run on (`usable_cores`), and what its control groups
allow it: the CPU time (`cpu_quota`: a container's `--cpus`,
Kubernetes' CPU limit, Slurm's cgroup) and, for the memory guard, the memory (`aamperf/guards/memory.py`).
Both cgroup v2 (one hierarchy) and v1 (one per controller); every level from the process's own group up
to the root is read, since each level's limit applies."""

import math
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_dirs(
    controller: str, proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT
) -> list[tuple[Path, int]]:
    """(directory, cgroup version) of each group this process is in that `controller` governs, from its
    own group up to its hierarchy's root. In a container the process's path is often "/": its root is
    the container's group."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:  # "0::/path" (v2) or "4:cpu,cpuacct:/path" (v1)
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            top, version = root, 2
        elif controller in controllers.split(","):
            top, version = root / controller, 1
        else:
            continue
        here = top / path.strip("/")
        found.append((here, version))
        while here != top and top in here.parents:
            here = here.parent
            found.append((here, version))
    return found


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota(proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The cores' worth of CPU time per period this process may use (v2 `cpu.max`, v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`; the tightest of every level), None without one.
    More threads than that are throttled by the kernel for the rest of each period."""
    quotas = []
    for directory, version in cgroup_dirs("cpu", proc, root):
        if version == 2:
            fields = (read_text(directory / "cpu.max") or "").split()
        else:
            fields = [read_text(directory / f"cpu.cfs_{name}_us") or "" for name in ("quota", "period")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0:
            quotas.append(int(fields[0]) / int(fields[1]))  # "max" (v2) and -1 (v1): no limit
    return min(quotas, default=None)


def memory_limits(proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> list[int]:
    """The memory limits in bytes of this process's groups (v2 `memory.max`, v1
    `memory.limit_in_bytes`); "max" and unreadable files left out."""
    limits = []
    for directory, version in cgroup_dirs("memory", proc, root):
        text = read_text(directory / ("memory.max" if version == 2 else "memory.limit_in_bytes"))
        if text is not None and text.isdigit():
            limits.append(int(text))
    return limits


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity: `taskset`, a cpuset, system.cpu_cores)."""
    return (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )


def core_budget() -> int:
    """The cores this process can keep busy: those it may run on, at most its cgroups' CPU quota rounded
    up (on a 2-core AMD EPYC under a 1-core quota 1 thread trained 1.26x faster than 2; under 1.5 cores
    1 thread was 0.88x 2: experiments/cpu_quota)."""
    cores, quota = len(usable_cores()), cpu_quota()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))
