"""The run record: metrics.jsonl (one line per logged step, flushed) and summary.json (atomic)."""

import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: a non-finite float is written as null (a bad value is never hidden as 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write to a temp file, fsync, rename: a reader never sees half a file. The temp file's name is
    unique to this writer, so several processes (torchrun ranks) may write the same file at once."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(obj), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunRecord:
    """Files of one run directory that the checks and `aamperf.compare` read, and the extra sinks
    (W&B, TensorBoard: `aamperf/loggers.py`) that get the same rows."""

    def __init__(self, run_dir: Path, sinks: list | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.summary_path = self.run_dir / "summary.json"
        self.sinks = list(sinks or [])
        self._metrics = None

    def log(self, row: dict[str, Any]) -> None:
        if self._metrics is None:
            self._metrics = open(self.metrics_path, "a")
        row = _clean(row)
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()  # a crash loses at most the line being written
        self._to_sinks("log", row)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary_path, summary)
        self._to_sinks("summary", _clean(summary))

    def keep_earlier_summary(self) -> None:
        """Write this run's summary beside the one an earlier run left here (aamperf/callbacks.py)."""
        if self.summary_path.exists():
            self.summary_path = self.run_dir / "summary.refused.json"

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (a resumed run logs them again): no gap, no duplicate."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.metrics_path)

    def close(self, failed: bool = False) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._to_sinks("close", failed)
        self.sinks = []

    def _to_sinks(self, method: str, arg: Any) -> None:
        """A sink that fails is dropped with a warning: the files above are the record, not the sinks."""
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(arg)
            except Exception as exc:
                warnings.warn(f"{type(sink).__name__} switched off: {method} failed: {exc}", stacklevel=2)
                self.sinks.remove(sink)


class NullRecord:
    """The run record of a rank other than the first: everything is recorded by rank 0 only."""

    sinks: list = []

    def log(self, row: dict[str, Any]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def keep_earlier_summary(self) -> None:
        pass

    def write_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass
