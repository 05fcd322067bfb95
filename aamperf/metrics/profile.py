"""torch.profiler over a few steady-state steps (`metrics.profile_steps`): a trace to open in
Perfetto / chrome://tracing, the ops that took the time, and the share of collective communication;
then a memory snapshot (`metrics.memory_snapshot`, aamperf/metrics/snapshot.py). The loop sees one
object, `step_profilers`, whichever are on."""

import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from aamperf.metrics.snapshot import SNAPSHOT_STEPS, MemorySnapshot

log = logging.getLogger(__name__)

# gloo / NCCL collectives as the profiler names them (gloo:all_reduce, nccl:all_reduce, c10d::allgather_, ...)
COLLECTIVE = re.compile(
    r"^(gloo|nccl|c10d)[:_].*(all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier)", re.I
)


class StepProfiler:
    """Profiles steps skip+1 .. skip+n (after warm-up); does nothing when n is 0."""

    def __init__(self, n_steps: int, skip_steps: int, out_dir: Path | None, rank: int = 0):
        self.first, self.last = skip_steps + 1, skip_steps + n_steps
        self.enabled = n_steps > 0
        self.out_dir, self.rank = out_dir, rank
        self._prof: profile | None = None
        self._start = 0.0
        self.result: dict[str, Any] | None = None

    def covers(self, step: int) -> bool:
        """A profiled step: slower than the others, so the step meter leaves it out."""
        return self.enabled and self.first <= step <= self.last

    def begin(self, step: int) -> None:
        if self.enabled and step == self.first:
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            self._prof = profile(activities=activities)
            self._prof.__enter__()
            self._start = time.perf_counter()

    def end(self, step: int) -> None:
        if self._prof is None or step != self.last:
            return
        wall_s = time.perf_counter() - self._start
        self._prof.__exit__(None, None, None)
        events = self._prof.key_averages()
        comm_s = sum(e.cpu_time_total for e in events if COLLECTIVE.match(e.key)) / 1e6
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        self.result = {
            "profiled_steps": self.last - self.first + 1,
            "wall_s": wall_s,
            # time the profiler saw in collectives over the profiled wall time; gloo runs them on its own
            # threads, so part of it may overlap with backward computation
            "comm_time_frac": comm_s / wall_s if wall_s else None,
            "top_ops": [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in top],
        }
        if torch.cuda.is_available():  # the kernels that took the GPU's time, and how busy it was
            # the kernels, not the ops that launched them (those carry their kernels' time too)
            kernels = [e for e in events if e.device_type == DeviceType.CUDA]
            gpu = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)
            busy_s = sum(e.self_device_time_total for e in kernels) / 1e6
            self.result["device_busy_frac"] = busy_s / wall_s if wall_s else None
            self.result["top_device_ops"] = [
                {"op": e.key, "self_device_s": e.self_device_time_total / 1e6, "calls": e.count}
                for e in gpu[:25]
            ]
        if self.out_dir is not None:
            name = "profile_trace.json" if self.rank == 0 else f"profile_trace_rank{self.rank}.json"
            self._prof.export_chrome_trace(str(self.out_dir / name))
            self.result["trace"] = name
        self._prof = None

    def close(self) -> None:
        """Stops a profile the run left open (it failed or stopped inside the profiled steps); writes
        nothing."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


class StepProfilers:
    """The profiled steps, then the memory snapshot's: after each other, as torch runs one profiler at a
    time. `result`: the profile's record, the snapshot's under `memory_snapshot` (None: neither ran)."""

    def __init__(self, profiler: StepProfiler, snapshot: MemorySnapshot, snapshot_note: dict | None = None):
        self.profiler, self.snapshot, self.snapshot_note = profiler, snapshot, snapshot_note

    def covers(self, step: int) -> bool:
        return self.profiler.covers(step) or self.snapshot.covers(step)

    def begin(self, step: int) -> None:
        self.profiler.begin(step)
        self.snapshot.begin(step)

    def end(self, step: int) -> None:
        self.profiler.end(step)
        self.snapshot.end(step)

    def close(self) -> None:
        """However the loop ended: neither is left running into the next job of this process."""
        self.profiler.close()
        self.snapshot.close()

    @property
    def result(self) -> dict[str, Any] | None:
        snapshot = self.snapshot.result or self.snapshot_note
        if snapshot is None:
            return self.profiler.result
        return {**(self.profiler.result or {}), "memory_snapshot": snapshot}


def step_profilers(
    cfg: DictConfig, device: torch.device, out_dir: Path | None, rank: int = 0, recomputes: bool = False
) -> StepProfilers:
    """metrics.profile_steps's profiler and metrics.memory_snapshot's recording, for the run `cfg`;
    `recomputes`: its model recomputes layers in eager Python (torch.utils.checkpoint)."""
    m = cfg.metrics
    first = m.skip_steps + m.profile_steps + 1
    last = min(first + SNAPSHOT_STEPS - 1, cfg.trainer.max_steps)
    note = None
    if m.memory_snapshot and first > last:
        reason = (
            f"metrics.memory_snapshot=true: no snapshot: trainer.max_steps={cfg.trainer.max_steps} ends "
            f"before step {first}, the first after metrics.skip_steps={m.skip_steps} and "
            f"metrics.profile_steps={m.profile_steps}; lower those or raise trainer.max_steps"
        )
        log.warning(reason)
        note = {"file": None, "reason": reason}
    return StepProfilers(
        StepProfiler(m.profile_steps, m.skip_steps, out_dir, rank),
        MemorySnapshot(m.memory_snapshot, first, last, device, out_dir, rank, recomputes),
        note,
    )
