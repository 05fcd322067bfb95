"""A memory snapshot of a few steady-state steps (`metrics.memory_snapshot=true`): on a GPU the CUDA caching
allocator's history, memory_snapshot.pickle, to drop onto https://pytorch.org/memory_viz; on a CPU
torch.profiler's memory timeline, memory_timeline.json: [times_us, [bytes per category at each time]],
the categories as `timeline_columns()` names them."""

import json
import logging
import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

from aamperf.files import write_atomic

log = logging.getLogger(__name__)

# steps recorded, after warm-up and any profiled ones: a step's allocations and frees, the next one's reuse
SNAPSHOT_STEPS = 2
HISTORY_ENTRIES = 100_000  # CUDA allocator events kept, the oldest dropped beyond: a few steps of AAM's
# what the CUDA allocator's history records with each event (torch.cuda.memory._record_memory_history)
RECORDING = {"context": "all", "stacks": "python"}
# where the model recomputes in eager Python (torch.utils.checkpoint: memory=full, ops, every_k), that
# recording fails inside the recompute's dropout (SystemError; torch 2.11+cu130, H200s, 2026-11-27 and 28:
# the recording test in tests/gpu/test_cuda_parts.py); stacks for the allocations alone (none for the
# frees) passed there (2026-11-28, seed 3's H200), and they are all the peak's sources need
RECORDING_UNDER_RECOMPUTE = {"context": "alloc", "stacks": "python"}


PEAK_SOURCES = 12  # the places that allocated the most of what was held at the peak, in the record


def source(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost frame of aamperf's own code (`model/layers.py:95 forward`),
    else the innermost Python frame; none on a thread with no Python frame (autograd's backward on a GPU)."""
    for frame in frames:
        path = frame.get("filename", "")
        if "/aamperf/" in path and not path.endswith("aamperf/metrics/snapshot.py"):
            return f"{path.rsplit('/aamperf/', 1)[1]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        first = frames[0]
        return f"{first.get('filename', '?').rsplit('/', 1)[-1]}:{first.get('line')} {first.get('name')}"
    return "(no Python frame: backward's thread)"


def peak_sources(events: list[dict], start_bytes: int, top: int = PEAK_SOURCES) -> dict:
    """From the CUDA allocator's history of the recorded steps (one device's `device_traces`, oldest first)
    and the bytes allocated as it began: the most bytes allocated at once, and what held them then, by the
    place that allocated each block (`source`); blocks from before the recording (weights, optimizer
    state, the previous step's) as one line. `max_memory_allocated` over the same steps, explained."""
    held = peak = start_bytes
    peak_at = -1  # the event after which the peak was reached; -1: at the start
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            held += event["size"]
        elif event["action"] == "free_completed":
            held -= event["size"]
        if held > peak:
            peak, peak_at = held, i
    live: dict[int, tuple[int, str]] = {}
    before = start_bytes  # what the blocks allocated before the recording still held
    for event in events[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], source(event.get("frames") or []))
        elif event["action"] == "free_completed":
            if event["addr"] in live:
                del live[event["addr"]]
            else:
                before -= event["size"]
    by_source: dict[str, list[int]] = {}
    for size, where in live.values():
        total = by_source.setdefault(where, [0, 0])
        total[0] += size
        total[1] += 1
    ranked = sorted(by_source.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": peak,
        "held_from_before_bytes": before,
        "sources": [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in ranked[:top]],
        "other_sources_bytes": sum(b for _, (b, _) in ranked[top:]),
    }


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
        self,
        enabled: bool,
        first: int,
        last: int,
        device: torch.device,
        out_dir: Path | None,
        rank: int = 0,
        recomputes: bool = False,
    ):
        self.enabled = enabled and out_dir is not None and first <= last
        self.recording = RECORDING_UNDER_RECOMPUTE if recomputes else RECORDING
        self.first, self.last = first, last
        self.device, self.out_dir, self.rank = device, out_dir, rank
        self._prof: profile | None = None
        self._recording = False
        self._start = 0.0
        self._start_bytes = 0  # allocated on the GPU as the recording began
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
            # Python lines (RECORDING_UNDER_RECOMPUTE: why a recomputing model's frees have none)
            self._start_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.memory._record_memory_history(**self.recording, max_entries=HISTORY_ENTRIES)
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
            history = torch.cuda.memory._snapshot()
            # what torch.cuda.memory._dump_snapshot writes, from the history read once here
            write_atomic(self.out_dir / name, lambda f: pickle.dump(history, f))
            torch.cuda.memory._record_memory_history(enabled=None)  # stop recording
            self._recording = False
            self.result = {
                "file": name,
                "kind": "CUDA allocator history (pytorch.org/memory_viz)",
                "recording": self.recording,
            }
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            events = history["device_traces"][index]
            if len(events) < HISTORY_ENTRIES:  # whole: none of the steps' events dropped
                self.result["peak"] = peak_sources(events, self._start_bytes)
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
