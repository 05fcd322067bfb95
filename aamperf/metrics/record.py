"""The run record: metrics.jsonl (one line per logged step, flushed) and summary.json (atomic)."""

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from aamperf.errors import disk_full, no_space
from aamperf.files import Claim, json_line, json_safe, write_atomic, write_json_atomic

log = logging.getLogger(__name__)

SPACE_FIX = "free space there or set hydra.run.dir elsewhere"
METRICS_FILE, SUMMARY_FILE = "metrics.jsonl", "summary.json"


def _row(line: str) -> dict | None:
    row = json_line(line)
    return row if row is not None and "step" in row else None


class RunRecord:
    """Files of one run directory that the checks and `aamperf.compare` read, and the extra sinks
    (W&B, TensorBoard: `aamperf/loggers.py`) that get the same rows."""

    def __init__(self, run_dir: Path, sinks: list | None = None):
        self.run_dir = Path(run_dir)
        self._claim = Claim(self.run_dir)  # held already where the run's callbacks took it (a plain run)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.summary_path = self.run_dir / SUMMARY_FILE
        self.sinks = list(sinks or [])
        self._metrics = None

    def log(self, row: dict[str, Any]) -> None:
        if self._metrics is None:
            self._metrics = open(self.metrics_path, "a")
        row = json_safe(row)
        try:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()  # a crash loses at most the line being written
        except OSError as exc:
            if disk_full(exc, self.metrics_path):
                raise no_space(self.run_dir, "metrics.jsonl", SPACE_FIX) from exc
            raise
        self._to_sinks("log", row)

    def alert(self, alert: dict[str, Any]) -> None:
        """An alert (aamperf/alerts.py) for the sinks that raise them (W&B); summary.json lists them all."""
        self._to_sinks("alert", alert)

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary_path, summary, SPACE_FIX)  # on failure no partial file is left
        self._to_sinks("summary", json_safe(summary))

    def keep_earlier_summary(self) -> None:
        """Write this run's summary beside the one an earlier run left here (aamperf/callbacks.py)."""
        if self.summary_path.exists():
            self.summary_path = self.run_dir / "summary.refused.json"

    def sync(self) -> None:
        """Make the lines logged so far durable: before a checkpoint, so that no step a resume skips can
        have lost its line in a power cut (its page cache gone, the fsynced checkpoint kept)."""
        if self._metrics is not None:
            os.fsync(self._metrics.fileno())

    def whole_until(self) -> int | None:
        """The step of the last whole line before the first damaged one (0: none before it), or None
        where no line is damaged: the steps after it are those a resume must log again."""
        if not self.metrics_path.exists():
            return None
        last = 0
        for line in self.metrics_path.read_text().splitlines():
            row = _row(line)
            if row is None:
                return last
            last = row["step"]
        return None

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (a resumed run logs them again): no gap, no duplicate."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        rows = [_row(line) for line in lines]
        if None in rows:  # a line cut short by a crash or a full disk: its step is logged again
            log.warning(
                "%s: dropped %d damaged line(s); the steps after step %d are logged again",
                self.metrics_path, rows.count(None), step,
            )  # fmt: skip
        kept = [
            line for line, row in zip(lines, rows, strict=True) if row is not None and row["step"] <= step
        ]
        write_atomic(self.metrics_path, "".join(kept), SPACE_FIX)

    def close(self, failed: bool = False) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._to_sinks("close", failed)
        self.sinks = []
        self._claim.release()

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

    def sync(self) -> None:
        pass

    def whole_until(self) -> int | None:
        return None

    def keep_earlier_summary(self) -> None:
        pass

    def write_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass
