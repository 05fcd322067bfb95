"""The run record: metrics.jsonl (one line per logged step, flushed) and summary.json (atomic)."""

import json
import os
import socket
import warnings
from pathlib import Path
from typing import Any

import psutil

from aamperf.errors import UserError, disk_full, no_space
from aamperf.files import json_line, json_safe, write_atomic, write_json_atomic

SPACE_FIX = "free space there or set hydra.run.dir elsewhere"
METRICS_FILE, SUMMARY_FILE = "metrics.jsonl", "summary.json"
LOCK = ".running"  # host and pid of the run that holds the directory; removed when it ends


def _row(line: str) -> dict | None:
    row = json_line(line)
    return row if row is not None and "step" in row else None


def claim(run_dir: Path) -> Path:
    """Take the run directory for this process, or refuse: two live runs must not write one directory.
    A lock whose process has ended (killed, or on another machine: unknown) is taken over."""
    lock, me = run_dir / LOCK, f"{socket.gethostname()} {os.getpid()}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        host, _, pid = lock.read_text().partition(" ")
        if (
            host == socket.gethostname()
            and pid.isdigit()
            and int(pid) != os.getpid()
            and _alive(int(pid), lock)
        ):
            raise UserError(
                f"run directory {run_dir} is in use by process {pid}; give this run its own hydra.run.dir "
                f"(or remove {lock} if that process is not a run)"
            ) from None
        lock.write_text(me)
        return lock
    with os.fdopen(fd, "w") as f:
        f.write(me)
    return lock


def _alive(pid: int, lock: Path) -> bool:
    """Is `pid` the process that wrote `lock` (started before it), still running?"""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and process.create_time() <= lock.stat().st_mtime + 1
    except psutil.Error:
        return False


class RunRecord:
    """Files of one run directory that the checks and `aamperf.compare` read, and the extra sinks
    (W&B, TensorBoard: `aamperf/loggers.py`) that get the same rows."""

    def __init__(self, run_dir: Path, sinks: list | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = claim(self.run_dir)
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

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after `step` (a resumed run logs them again): no gap, no duplicate."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        rows = [_row(line) for line in lines]
        if None in rows:  # a line cut short by a crash or a full disk: its step is logged again
            warnings.warn(f"{self.metrics_path}: dropped {rows.count(None)} damaged line(s)", stacklevel=2)
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
        if self._lock is not None:
            self._lock.unlink(missing_ok=True)
            self._lock = None

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
