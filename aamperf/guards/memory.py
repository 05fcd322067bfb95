"""The memory guard: the run's own memory against the limit that applies to it (`memory_limit`), with
a clean-up at `memory.warn_fraction` and a stop at `memory.max_fraction` before the OOM killer."""

import gc
import logging
import math
import os
import time

import psutil
import torch
from omegaconf import DictConfig

from aamperf.cgroups import memory_limits
from aamperf.metrics.monitor import is_logger

log = logging.getLogger(__name__)


def memory_limit() -> tuple[int, str]:
    """(bytes this process may use before it is killed, what sets them): its cgroups' limit (v2
    `memory.max`, v1 `memory.limit_in_bytes`) where one is below the machine's RAM, else the RAM."""
    total = psutil.virtual_memory().total
    limits = [limit for limit in memory_limits() if limit < total]
    return (min(limits), "cgroup") if limits else (total, "machine")


CHILDREN_EVERY_S = 5.0  # dataloader workers are persistent: list them again this often


class MemoryGuard:
    """The run's own memory (this process and its workers, RSS) as a fraction of the limit that applies
    to it (its cgroup's, else the machine's RAM; CUDA: what its caching allocator holds, of the device's
    memory or of its memory.cuda_memory_fraction), checked at every step but
    read at most every `interval_s` (a read costs ~40 us). Above `warn_fraction`: collect garbage and
    empty the CUDA cache, once per crossing, with a warning (never every step: clearing costs time).
    Above `max_fraction`: a message for the trainer, which checkpoints and stops the run before the
    operating system kills it. Other processes' memory never stops the run: a machine over
    `max_fraction` in all is a warning, once per crossing."""

    def __init__(self, cfg: DictConfig, device: torch.device, interval_s: float = 0.1):
        self.warn_fraction, self.max_fraction, self.device = cfg.warn_fraction, cfg.max_fraction, device
        self.interval_s = interval_s
        self.cleanups = 0
        self._above = self._machine_above = False
        self._last_read = -math.inf
        self.last_fraction: float | None = None  # the latest reading (alerts report it)
        if device.type == "cuda":
            share = cfg.cuda_memory_fraction or 1.0
            total = torch.cuda.get_device_properties(device).total_memory
            self.limit_bytes = int(share * total)
            self.limit_source = "device" if share == 1.0 else "device_fraction"
        else:
            self.limit_bytes, self.limit_source = memory_limit()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's ranks on this machine
        if device.type != "cuda" and local_ranks > 1:  # they share the RAM limit: each its share (a GPU each)
            self.limit_bytes //= local_ranks
            self.limit_source += f"/{local_ranks}"
        self._process = psutil.Process()
        self._children: list[psutil.Process] = []
        self._children_at = -math.inf

    def run_bytes(self) -> int:
        """RSS of this process and its children (dataloader workers; not W&B's service process): shared
        pages count in each. The children are listed at most every CHILDREN_EVERY_S (listing scans
        /proc: ~1 ms with 70 processes, more on a busy node); their RSS is read at each check."""
        now = time.perf_counter()
        if now - self._children_at >= CHILDREN_EVERY_S:
            children = [p for p in self._process.children(recursive=True) if not is_logger(p)]
            self._children, self._children_at = children, now
        total = self._process.memory_info().rss
        for child in self._children:
            try:
                total += child.memory_info().rss
            except psutil.Error:  # ended meanwhile
                pass
        return total

    def used_fraction(self) -> float:
        if self.device.type == "cuda":  # not mem_get_info: that counts every process on the GPU
            return torch.cuda.memory_reserved(self.device) / self.limit_bytes
        return self.run_bytes() / self.limit_bytes

    def machine_fraction(self) -> float:
        """How full the machine's RAM, or the whole GPU, is: other processes included."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return 1 - free / total
        vm = psutil.virtual_memory()
        return 1 - vm.available / vm.total

    def check(self) -> str | None:
        """None, or why the run must stop now."""
        now = time.perf_counter()
        if now - self._last_read < self.interval_s:
            return None
        self._last_read = now
        fraction = self.last_fraction = self.used_fraction()
        if fraction >= self.max_fraction:
            kind, _, shared = self.limit_source.partition("/")
            where = {
                "device": "the GPU's memory",
                "device_fraction": "memory.cuda_memory_fraction of the GPU",
                "cgroup": "the cgroup's memory limit",
            }.get(kind, "system RAM")
            where += f" shared by {shared} local ranks" if shared else ""
            return (
                f"memory at {100 * fraction:.0f}% of {where}, over memory.max_fraction="
                f"{self.max_fraction:g}; lower trainer.batch_size (or trainer.batch_size=auto), use "
                "memory=full or precision=bf16, or raise memory.max_fraction"
            )
        machine = self.machine_fraction()
        if machine >= self.max_fraction and not self._machine_above:
            mine = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else self.run_bytes()
            log.warning(
                "the %s is %.0f%% used, by other processes too (this run: %.2f GiB, %.0f%% of its limit): "
                "not stopped, since what other processes use is not this run's",
                "GPU's memory" if self.device.type == "cuda" else "machine's memory",
                100 * machine,
                mine / 2**30,
                100 * fraction,
            )
        self._machine_above = machine >= self.max_fraction
        above = fraction >= self.warn_fraction
        if above and not self._above:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cleanups += 1
            log.warning(
                "memory at %.0f%% (memory.warn_fraction=%.2f): collected garbage and cleared caches",
                100 * fraction,
                self.warn_fraction,
            )
        self._above = above
        return None
