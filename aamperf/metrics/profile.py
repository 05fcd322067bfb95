"""torch.profiler over a few steady-state steps (`metrics.profile_steps`): a trace to open in
Perfetto / chrome://tracing, the ops that took the time, and the share of collective communication."""

import re
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

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
        if self.out_dir is not None:
            name = "profile_trace.json" if self.rank == 0 else f"profile_trace_rank{self.rank}.json"
            self._prof.export_chrome_trace(str(self.out_dir / name))
            self.result["trace"] = name
        self._prof = None
