"""A memory snapshot of a few steady-state steps (`metrics.memory_snapshot=true`): on a GPU the CUDA caching
allocator's history, memory_snapshot.pickle, to drop onto https://pytorch.org/memory_viz; on a CPU
torch.profiler's memory timeline, memory_timeline.json: [times_us, [bytes per category at each time]],
the categories as `timeline_columns()` names them."""

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

log = logging.getLogger(__name__)

# steps recorded, after warm-up and any profiled ones: a step's allocations and frees, the next one's reuse
SNAPSHOT_STEPS = 2
HISTORY_ENTRIES = 100_000  # CUDA allocator events kept, the oldest dropped beyond: a few steps of AAM's
# what the CUDA allocator's history records with each event (torch.cuda.memory._record_memory_history)
RECORDING = {"context": "all", "stacks": "python"}


def timeline_columns() -> list[str]:
    """The memory timeline's columns, as torch writes them: an empty first one (torch's offset), then its
    categories in its own order, "unknown" for tensors it could not place."""
    columns = ["-"] * (len(_CATEGORY_TO_INDEX) + 1)
    for category, index in _CATEGORY_TO_INDEX.items():
        columns[index + 1] = "unknown" if category is None else category.name.lower()
    return columns


class MemorySnapshot:
    """Records memory over steps first .. last; does nothing when off. `result`: the file and what it
    holds, once written."""

    def __init__(
        self, enabled: bool, first: int, last: int, device: torch.device, out_dir: Path | None, rank: int = 0
    ):
        self.enabled = enabled and out_dir is not None and first <= last
        self.first, self.last = first, last
        self.device, self.out_dir, self.rank = device, out_dir, rank
        self._prof: profile | None = None
        self._recording = False
        self._start = 0.0
        self.result: dict[str, Any] | None = None

    def covers(self, step: int) -> bool:
        """A recorded step: slower than the others (the profiler's stacks), so the meter leaves it out."""
        return self.enabled and self.first <= step <= self.last

    def begin(self, step: int) -> None:
        if not self.enabled or step != self.first:
            return
        self._start = time.perf_counter()
        if self.device.type == "cuda":
            # Python frames only: C++ stacks cost each allocation an unwind, and memory_viz names the
            # Python lines. With the default stacks="all", torch 2.11+cu130 on an H200 failed inside
            # checkpointing's recompute in backward (SystemError from dropout, 2026-11-27), and with
            # stacks="python" too on another H200 the same day: tests/gpu/test_cuda_runs.py's snapshot test
            # fails there (experiments/gpu_scale/README.md, "Left for the next GPU session")
            torch.cuda.memory._record_memory_history(**RECORDING, max_entries=HISTORY_ENTRIES)
            self._recording = True
        else:
            self._prof = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
            )
            self._prof.__enter__()

    def close(self) -> None:
        """Stops a recording the run left open (it failed or stopped inside the recorded steps): left on,
        it would go on recording, and slowing, the next job of this process. Writes nothing."""
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def end(self, step: int) -> None:
        if not (self._recording or self._prof is not None) or step != self.last:
            return
        suffix = "" if self.rank == 0 else f"_rank{self.rank}"
        if self._recording:
            name = f"memory_snapshot{suffix}.pickle"
            torch.cuda.memory._dump_snapshot(str(self.out_dir / name))
            torch.cuda.memory._record_memory_history(enabled=None)  # stop recording
            self._recording = False
            self.result = {"file": name, "kind": "CUDA allocator history (pytorch.org/memory_viz)"}
        else:
            self._prof.__exit__(None, None, None)
            name = f"memory_timeline{suffix}.json"
            path = self.out_dir / name
            with warnings.catch_warnings():  # deprecated in favour of the CUDA history, which a CPU lacks
                warnings.simplefilter("ignore", FutureWarning)
                self._prof.export_memory_timeline(str(path), device="cpu")
            self._prof = None
            times, sizes = json.loads(path.read_text())
            self.result = {
                "file": name,
                "kind": "torch.profiler memory timeline (CPU)",
                "columns": timeline_columns(),
                "peak_bytes": max((sum(s) for s in sizes), default=0),
                "events": len(times),
            }
        self.result.update(steps=[self.first, self.last], wall_s=time.perf_counter() - self._start)
        log.info("memory snapshot of steps %d-%d written to %s", self.first, self.last, self.out_dir / name)
