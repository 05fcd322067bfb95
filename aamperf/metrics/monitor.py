"""Background sampling of the process tree (psutil) and of the GPU (pynvml) around the loop."""

import ctypes
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from aamperf.cgroups import usable_cores
from aamperf.metrics.flops import MAX_OTHER_CORES, busy_seconds


class _GPU:
    """pynvml handle of the run's CUDA device; absent without a GPU or without the NVML library."""

    def __init__(self, index: int):
        import pynvml  # imported only where a GPU exists

        pynvml.nvmlInit()
        self.nvml = pynvml
        # by UUID: NVML numbers every GPU of the machine, CUDA only those CUDA_VISIBLE_DEVICES shows
        self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")

    def sample(self) -> tuple[float, int]:
        util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
        used = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        return float(util), int(used)

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _open_gpu(device: torch.device) -> _GPU | None:
    if device.type != "cuda":
        return None
    try:
        return _GPU(device.index if device.index is not None else torch.cuda.current_device())
    except Exception as exc:  # NVML missing or driver too old: utilisation stays null, training goes on
        print(f"aamperf: GPU utilisation not monitored ({exc})", file=sys.stderr)
        return None


# This process's peak RSS before the last reset_peak_rss() of the current job: the batch-size finder
# resets the kernel's high-water mark to measure each trial, and the job's peak must survive that.
_peak_before_reset = [0]


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Restart this process's peak-RSS counter (Linux: VmHWM), so that peak_rss() measures from now;
    job_peak_rss() still covers the time before."""
    _peak_before_reset[0] = max(_peak_before_reset[0], _vm_hwm() or 0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not permitted: the peak then covers the whole process lifetime
        pass


def start_job_peak_rss() -> None:
    """A new job in this process (an in-process sweep's next job): its peak starts from now, not from
    the largest of the jobs before it."""
    reset_peak_rss()
    _peak_before_reset[0] = 0


def peak_rss() -> int:
    """This process's peak RSS in bytes since it started or since reset_peak_rss(): VmHWM. Not
    ru_maxrss, which Linux starts at the parent's RSS across fork + exec: a run started by a big
    process (a sweep driver, torchrun's agent, a test) would report at least the parent's memory."""
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: KiB there too


def job_peak_rss() -> int:
    """This process's peak RSS over the job (since the process started, or start_job_peak_rss()),
    across the resets of reset_peak_rss(): what `/usr/bin/time -v` reports as "Maximum resident set
    size" for a process without children."""
    return max(_peak_before_reset[0], peak_rss())


def pss_bytes(pid: int | str = "self") -> int:
    """Proportional set size of a process (/proc/<pid>/smaps_rollup, the `smem` PSS): its private pages
    plus each shared page divided by the number of processes sharing it, so a tree's sum counts every
    page once. Falls back to RSS where there is no smaps_rollup."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    proc = psutil.Process() if pid == "self" else psutil.Process(int(pid))
    return proc.memory_info().rss


def release_freed_memory() -> None:
    """Give memory freed by earlier jobs of this process (or the batch-size finder's probes) back to the
    OS, which the allocator keeps otherwise, so what comes next starts from what it really holds:
    tcmalloc's free spans where it is preloaded (system.allocator), else glibc's free heap."""
    try:
        process = ctypes.CDLL(None)  # every library of the process, the preloaded one first
        release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)  # tcmalloc's C API
        if release is not None:
            release()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def is_logger(proc: psutil.Process) -> bool:
    """W&B's service process: a child of the run, but the logger's memory, not training's."""
    try:
        return proc.name().startswith("wandb")
    except psutil.Error:
        return False


def cores_busy_s(cores: list[int]) -> tuple[float, float]:
    """(busy, stolen) CPU seconds so far of the CPUs numbered `cores` (/proc/stat, every process's)."""
    per_cpu = psutil.cpu_times(percpu=True)
    picked = [per_cpu[i] for i in cores if i < len(per_cpu)]
    return sum(busy_seconds(t) for t in picked), sum(getattr(t, "steal", 0.0) for t in picked)


def job_root() -> psutil.Process:
    """The process whose tree is this job's CPU use: this one, or under torchrun with several local ranks
    the agent that started them all (every rank's work is the job's, not another's load)."""
    me = psutil.Process()
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        return me.parent() or me
    return me


MIN_LOAD_WALL_S = 0.5  # CPU time is counted in 10 ms ticks: a shorter loop's load means nothing
PSS_BUDGET = 0.02  # share of one core the tree's PSS readings may take (they cost far more than RSS)


class SystemMonitor:
    """Samples memory and CPU % of this process and its children (dataloader workers) every interval.

    Memory: this process's RSS now (`rss_bytes`), and the process tree's summed PSS (`tree_pss_bytes`,
    workers' shared pages counted once in all); peaks: this process's VmHWM over the job
    (`peak_rss_bytes`) and the sampled peak of the tree's PSS (`peak_tree_pss_bytes`).

    Runs in a daemon thread so the training loop itself never waits on psutil or NVML.
    """

    def __init__(self, device: torch.device, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.device = device
        self._procs: dict[int, psutil.Process] = {}
        self._root = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aamperf-monitor", daemon=True)
        self._gpu = _open_gpu(device)
        self.peak_tree_pss_bytes = 0
        self.tree_pss_bytes = 0
        self.rss_bytes = 0
        self.cpu_percent = 0.0
        self._cpu_sum = 0.0
        self._gpu_util_sum = 0.0
        self.peak_gpu_used_bytes: int | None = None
        self.setup_peak_device_bytes: int | None = None
        self._samples = 0
        self._next_pss_at = 0.0  # perf_counter time of the next PSS reading
        # the cores' other users: the job tree's CPU seconds per process (first and last seen), and
        # the cores' busy seconds at the loop's start and end
        self._cores = usable_cores()
        self._job = job_root()
        self._job_cpu_first: dict[int, float] = {}
        self._job_cpu_last: dict[int, float] = {}
        self._started_at = time.time()
        self._cores_at_start = self._cores_at_end = (0.0, 0.0, 0.0)

    @property
    def gpu_util_percent(self) -> float | None:
        """The GPU's mean utilisation since the start (pynvml), or None without a GPU."""
        return None if self._gpu is None or not self._samples else self._gpu_util_sum / self._samples

    def readings(self) -> dict[str, float]:
        """The latest sample, for a metrics line."""
        return {
            "rss_bytes": self.rss_bytes,
            "tree_pss_bytes": self.tree_pss_bytes,
            "cpu_percent": self.cpu_percent,
        }

    def _tree(self) -> list[psutil.Process]:
        # W&B's service process is a child too, but it is the logger's memory, not training's.
        live = [self._root, *(p for p in self._root.children(recursive=True) if not is_logger(p))]
        # Keep Process objects across samples: cpu_percent() measures since the previous call.
        self._procs = {p.pid: self._procs.get(p.pid, p) for p in live}
        return list(self._procs.values())

    def _count_job_cpu(self) -> None:
        """CPU seconds of every process of the job's tree (loader and compile workers, W&B's service
        and, under torchrun, the other local ranks included): a process started during the loop counts
        from 0, one that ends counts to its last reading."""
        try:
            procs = [self._job, *self._job.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
                if proc.pid not in self._job_cpu_first:
                    started_here = proc.create_time() > self._started_at
                    self._job_cpu_first[proc.pid] = 0.0 if started_here else times.user + times.system
                self._job_cpu_last[proc.pid] = times.user + times.system
            except psutil.Error:  # it ended meanwhile
                continue

    def _cores_now(self) -> tuple[float, float, float]:
        return (*cores_busy_s(self._cores), time.perf_counter())

    def sample(self, force_pss: bool = False) -> None:
        # Reading PSS walks the page tables under the process's memory lock (~15 ms per GiB of RSS
        # here): it is read only as often as keeps that under PSS_BUDGET of one core, not every sample.
        start = time.perf_counter()
        read_pss = force_pss or start >= self._next_pss_at
        pss, cpu = 0, 0.0
        for proc in self._tree():
            try:
                if read_pss:  # each page shared with a forked worker counts once in the tree's sum
                    pss += pss_bytes("self" if proc is self._root else proc.pid)
                cpu += proc.cpu_percent()
            except (psutil.Error, FileNotFoundError, ProcessLookupError):  # a worker exited meanwhile
                continue
        if read_pss:
            self.tree_pss_bytes = pss
            self.peak_tree_pss_bytes = max(self.peak_tree_pss_bytes, pss)
            cost_s = time.perf_counter() - start
            self._next_pss_at = start + max(self.interval_s, cost_s / PSS_BUDGET)
        self._count_job_cpu()
        self.rss_bytes = self._root.memory_info().rss
        self.cpu_percent = cpu
        self._cpu_sum += cpu
        self._samples += 1
        if self._gpu is not None:
            util, used = self._gpu.sample()
            self._gpu_util_sum += util
            self.peak_gpu_used_bytes = max(self.peak_gpu_used_bytes or 0, used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "SystemMonitor":
        reset_peak_rss()  # peak_rss() from here: the loop's own; job_peak_rss() keeps the time before
        if self.device.type == "cuda":  # the build's peak (auto's probes: an fp32 step trial, the batch
            # finder, compile trials) kept apart: peak_device_bytes is what training itself holds
            self.setup_peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._started_at = time.time()
        self._cores_at_start = self._cores_now()
        self.sample(
            force_pss=True
        )  # primes cpu_percent; the first reading of each process is 0 by psutil's design
        self.start_rss_bytes = self.rss_bytes  # model, data and libraries, before the first step
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample(force_pss=True)
        self._cores_at_end = self._cores_now()
        if self._gpu is not None:
            self._gpu.close()

    def summary(self) -> dict[str, Any]:
        peak = job_peak_rss()
        n = max(self._samples - 1, 1)  # the priming sample carries no CPU reading
        out: dict[str, Any] = {
            "peak_rss_bytes": peak,
            "peak_tree_pss_bytes": self.peak_tree_pss_bytes,
            # what training adds on top (activations, gradients, optimizer state)
            "train_rss_growth_bytes": peak_rss() - self.start_rss_bytes,
            "cpu_percent": self._cpu_sum / n,
            "gpu_util_percent": None,
            "peak_gpu_used_bytes": self.peak_gpu_used_bytes,
            "peak_device_bytes": None,
            "setup_peak_device_bytes": self.setup_peak_device_bytes,
        }
        out["loop_load"] = self.loop_load()
        if self._gpu is not None:
            out["gpu_util_percent"] = self._gpu_util_sum / max(self._samples, 1)
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            out["alloc_retries"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        return out

    def loop_load(self) -> dict[str, Any] | None:
        """What else ran on the run's cores while its loop did: `other_cores_busy` (other processes'
        cores, on average), `own_cores_busy` (the job's tree), `steal_cores` (the hypervisor's), and
        `under_load`: why its timings shared the cores, or None. Other processes count only where
        they and the job together filled the cores (a busy 64-core node beside a 2-thread run is no
        load on it)."""
        (busy0, steal0, t0), (busy1, steal1, t1) = self._cores_at_start, self._cores_at_end
        wall = t1 - t0
        if not self._cores or wall < MIN_LOAD_WALL_S:
            return None
        own = sum(last - self._job_cpu_first[pid] for pid, last in self._job_cpu_last.items()) / wall
        other, steal = max(0.0, (busy1 - busy0) / wall - own), (steal1 - steal0) / wall
        cores = len(self._cores)
        reasons = []
        if other > MAX_OTHER_CORES and other + own > cores - MAX_OTHER_CORES:
            reasons.append(f"other processes used {other:.2f} of its {cores} cores beside its own {own:.2f}")
        if steal > MAX_OTHER_CORES:
            reasons.append(f"the hypervisor stole {steal:.2f} of its {cores} cores")
        return {
            "cores": cores,
            "core_ids": self._cores,  # the report's overlap check: runs on other cores shared none
            "own_cores_busy": own,
            "other_cores_busy": other,
            "steal_cores": steal,
            "wall_s": wall,
            "under_load": "; ".join(reasons) or None,
        }
