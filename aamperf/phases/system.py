"""Process-level switches: torch threads, CPU affinity, the allocator (aamperf/allocator.py),
glibc malloc's reuse of freed memory, cudnn.benchmark, determinism, channels_last."""

import ctypes
import itertools
import os

import torch
from omegaconf import DictConfig
from torch import nn

from aamperf.allocator import ALLOCATORS, TRAIN, Command, in_process, sweeping, why_not_restarted
from aamperf.cgroups import core_budget, cpu_quota, usable_cores
from aamperf.metrics.monitor import release_freed_memory
from aamperf.phases.record import applied, skipped

# The cores and intra-op threads the process had before its first job changed them: a later job of an
# in-process sweep that asks for neither gets these back, not the previous job's.
_given: tuple[list[int], int] | None = None


def given() -> tuple[list[int], int]:
    """The cores and intra-op threads this process had before its first job changed them."""
    global _given
    if _given is None:
        _given = usable_cores(), torch.get_num_threads()
    return _given


def check_system(cfg: DictConfig) -> list[str]:
    """The problems of `system.*` this process can tell before a job starts: cores it may not run on
    (sched_setaffinity's EINVAL as the job set them up), and thread counts torch refuses or ignores."""
    problems, cores, given_cores = [], cfg.cpu_cores, given()[0]
    fix = f"choose among cores {taskset_list(given_cores)}, or system.cpu_cores=null (the cores it was given)"
    if cores is not None and not cores:
        problems.append(f"system.cpu_cores=[] names no core; {fix}")
    elif cores is not None and not set(cores) <= set(given_cores):
        problems.append(f"system.cpu_cores={list(cores)} holds a core this process may not run on; {fix}")
    for key in ("num_threads", "interop_threads"):
        if cfg[key] is not None and cfg[key] < 1:
            problems.append(f"system.{key}={cfg[key]} must be >= 1, or null (torch's own)")
    return problems


def taskset_list(cores: list[int]) -> str:
    """Cores as taskset and cpusets write them: runs of consecutive cores as first-last (0-3,6)."""
    # consecutive cores share core - position: one group per run
    runs = [[c for _, c in g] for _, g in itertools.groupby(enumerate(sorted(cores)), lambda p: p[1] - p[0])]
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def apply_system(cfg: DictConfig, device: torch.device) -> dict[str, dict]:
    """Records per switch, since each can apply or not on its own."""
    given_cores, given_threads = given()
    records = {}
    if cfg.cpu_cores is None:
        if hasattr(os, "sched_setaffinity") and usable_cores() != given_cores:
            os.sched_setaffinity(0, given_cores)  # an earlier job of this process pinned it
        records["cpu_affinity"] = skipped("system.cpu_cores=null: the process keeps the cores it was given")
    elif not hasattr(os, "sched_setaffinity"):
        records["cpu_affinity"] = skipped("this OS has no sched_setaffinity")
    else:
        os.sched_setaffinity(0, list(cfg.cpu_cores))  # e.g. leave a core to the dataloader workers
        records["cpu_affinity"] = applied(cores=usable_cores())
    if cfg.num_threads is not None or cfg.cpu_cores is not None:
        # One intra-op thread per usable core: more only time-slice the same cores.
        torch.set_num_threads(cfg.num_threads or core_budget())
        records["threads"] = thread_record(None)
    else:
        records["threads"] = thread_record(threads_for_quota(given_threads))
    if cfg.interop_threads is not None:
        try:
            torch.set_num_interop_threads(cfg.interop_threads)  # allowed once, before any parallel work
            records["threads"]["inter_op"] = cfg.interop_threads
        except RuntimeError as exc:
            records["threads"]["inter_op_note"] = f"unchanged: {exc}"
    records["allocator"] = allocator_record(cfg.allocator)
    records["malloc"] = malloc_record(cfg.reuse_freed_memory)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        records["cudnn_benchmark"] = applied(enabled=cfg.cudnn_benchmark)
    else:
        records["cudnn_benchmark"] = skipped(f"no cuDNN on {device.type}")
    torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)
    records["deterministic"] = applied() if cfg.deterministic else skipped("system.deterministic=false")
    return records


def allocator_record(name: str | None, command: Command = TRAIN) -> dict:
    """The record of the allocator `name` that `command`'s config (its `command.key`) asks for."""
    have = in_process()
    if name is None:
        where = f"{have}, preloaded when it started" if have else "the C library's"
        return skipped(f"{command.key}=null: malloc as the process has it ({where})")
    if have == name:
        settings = {k: os.environ.get(k) for k in ALLOCATORS[name].settings}
        return applied(name=name, preloaded=os.environ.get("LD_PRELOAD"), settings=settings)
    why = why_not_restarted(name, sweeping(), command) or "not preloaded"
    return skipped(f"{command.key}={name}: {why}: malloc as the process has it")


def malloc_record(reuse: bool) -> dict:
    """reuse_freed_memory's record: glibc's thresholds (apply_malloc), or why they do not apply."""
    preloaded = in_process()
    if preloaded:
        return skipped(f"malloc is {preloaded} here: glibc's thresholds do not apply")
    return apply_malloc(reuse)


# glibc's mallopt parameters, and their values when glibc starts (its own defaults)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
GLIBC_DEFAULT_BYTES = 128 * 1024
# Blocks up to this size come from the heap and stay there when freed, and the heap keeps up to this much
# free memory at its top: a step's activations (tens of MiB each at the headline's shapes) reuse the last
# step's pages instead of mapping new ones and faulting each page in again.
REUSE_BYTES = 1 << 30
_malloc_changed = False  # an earlier job of this process set the thresholds


def glibc_version() -> str | None:
    """ "glibc 2.36", or None where the C library is another (musl, macOS, Windows)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None


def apply_malloc(reuse: bool) -> dict:
    """system.reuse_freed_memory: glibc returns each freed block above its mmap threshold (128 KiB,
    rising to 32 MiB as blocks are freed) to the OS, so every larger tensor of every step maps fresh pages
    and faults them in again. `experiments/headline/step_parts.py` (AMD EPYC, AVX2, 2 cores; 8 alternating
    pairs in one process): x * scale over an fp32 [38656, 512] 14.3 ms with glibc's thresholds, 10.8 ms
    with reuse (1.31x); forward + backward of two headline blocks 1.12x (pairs 0.69-1.71x). The price:
    freed memory stays with the process, holes in the heap included: ultra's peak RSS at the memory
    study's batch 0.98-1.10x the baseline's with it, 0.84-0.91x without; its headline step took 1.47x as
    long without reuse and with a leaner FFN since reverted, the two not separated (experiments/memory/,
    experiments/headline/)."""
    global _malloc_changed
    if not reuse:
        if _malloc_changed:  # an earlier job of an in-process sweep asked for reuse: glibc's values again
            _mallopt(GLIBC_DEFAULT_BYTES)
            release_freed_memory()  # the free memory the heap kept, back to the OS
            _malloc_changed = False
            return skipped(
                "system.reuse_freed_memory=false: glibc's starting thresholds (128 KiB) set again and the "
                "kept free memory returned, after an earlier job of this process raised them (glibc's "
                "dynamic mmap threshold stays off)"
            )
        return skipped("system.reuse_freed_memory=false: malloc as the C library has it")
    libc = glibc_version()
    if libc is None:
        return skipped("not glibc: its mallopt thresholds do not exist here, malloc as the C library has it")
    if not _mallopt(REUSE_BYTES):
        return skipped(f"{libc} refused mallopt's thresholds of {REUSE_BYTES} bytes: malloc as it was")
    _malloc_changed = True
    return applied(libc=libc, mmap_threshold=REUSE_BYTES, trim_threshold=REUSE_BYTES)


def _mallopt(nbytes: int) -> bool:
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes)) and bool(mallopt(M_TRIM_THRESHOLD, nbytes))


def threads_for_quota(given_threads: int) -> str | None:
    """torch's own thread count (`given_threads`: the process's, before any job changed it), at most a
    cgroup CPU quota rounded up unless OMP_NUM_THREADS chose it: torch counts the cores it sees, not the
    time the cgroup grants, and the threads beyond that are throttled. Returns the note saying so."""
    quota, budget = cpu_quota(), core_budget()
    if quota is not None and given_threads > budget and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(budget)
        return (
            f"cgroup CPU quota {quota:g} cores: intra-op threads {budget}, not torch's {given_threads} "
            "(system.num_threads sets them)"
        )
    if torch.get_num_threads() != given_threads:
        torch.set_num_threads(given_threads)  # an earlier job of this process set its own
    return None


def thread_record(note: str | None) -> dict:
    """The threads as they are now, the cgroup's CPU quota beside them, and why where aamperf chose."""
    record = applied(
        intra_op=torch.get_num_threads(), inter_op=torch.get_num_interop_threads(), cpu_quota=cpu_quota()
    )
    return {**record, "note": note} if note else record


def apply_channels_last(model: nn.Module, cfg: DictConfig) -> dict:
    """channels_last only helps convolutions on 4-D activations; AAM has none, and we say so."""
    if not cfg.channels_last:
        return skipped("system.channels_last=false")
    if not any(isinstance(m, nn.Conv2d | nn.BatchNorm2d) for m in model.modules()):
        return skipped("the model has no 4-D activations (no Conv2d / BatchNorm2d): nothing to convert")
    model.to(memory_format=torch.channels_last)
    return applied()
