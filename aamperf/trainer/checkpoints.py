"""The loop's checkpoints: its state saved every `trainer.checkpoint_every` steps and at a stop, and the
resume from the newest one (`trainer.resume=auto`). How the files are written and read safely:
aamperf/checkpoint.py."""

import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn, optim

from aamperf import checkpoint
from aamperf.distributed import from_main, rank
from aamperf.errors import UserError, one_line
from aamperf.summary import resolved_config

log = logging.getLogger(__name__)

ADDED_STATE = ("best",)  # the loop's state an earlier version's checkpoint lacks: it starts afresh there


def steps_left(tc: DictConfig, run_dir: Path | None) -> int:
    """The optimizer steps this process will train: trainer.max_steps, less the newest checkpoint's
    where trainer.resume=auto goes on from one (what a decision that must pay back over the run counts)."""
    saved = checkpoint.checkpoints(run_dir) if run_dir and tc.resume == "auto" else []
    return max(0, tc.max_steps - (checkpoint.step_of(saved[-1]) if saved else 0))


class Checkpoints:
    """`state`: the loop's objects by name, each with state_dict() / load_state_dict() (scaler, batch
    stream, meter, guards' counters, interval, result so far)."""

    def __init__(
        self,
        run_dir: Path | None,
        cfg: DictConfig,
        model: nn.Module,
        optimizer: optim.Optimizer,
        record,
        **state: Any,
    ):
        self.run_dir, self.tc, self.record = run_dir, cfg.trainer, record
        self.model, self.optimizer, self.state = model, optimizer, state
        self.config = resolved_config(cfg)
        self.kept: dict[str, Any] = {}  # saved to be read, never loaded (the scheduler: a resume rebuilds it)
        self.saved: dict[str, Any] = {}  # ... and what the checkpoint a resume read held of them
        self.resumed_from: int | None = None  # the checkpoint's step, when the run went on from one
        self.changes: dict[str, list] | None = None  # {key: [at the checkpoint, now]} that the resume applied
        self._last: tuple[int, Path] | None = None
        self.save_s = 0.0  # seconds spent writing checkpoints (summary.json duration_parts_s)

    def resume(self) -> int:
        """Go on from the newest checkpoint as if the run had never stopped: its step (0: a fresh run).
        One that cannot be read is set aside (kept) with a warning, and the one before it is used; so is
        one newer than a damaged line of metrics.jsonl, whose step is then logged again."""
        saved = checkpoint.checkpoints(self.run_dir) if self.run_dir and self.tc.resume == "auto" else []
        if not saved:
            if self.tc.resume == "auto":  # an earlier start kept no checkpoint: its rows are logged again
                self.record.truncate_after(0)
            return 0
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        path, loaded = self._newest_readable(saved)
        checkpoint.use_run_hyperparameters(self.optimizer, fresh)
        for name, obj in self.state.items():
            if name in loaded or name not in ADDED_STATE:
                obj.load_state_dict(loaded[name])
        self.resumed_from = loaded["step"]
        self.saved = {name: loaded[name] for name in ("scheduler",) if name in loaded}
        self.record.truncate_after(self.resumed_from)  # lines logged after the checkpoint are logged again
        return self.resumed_from

    def _newest_readable(self, saved: list[Path]) -> tuple[Path, dict[str, Any]]:
        """The newest checkpoint that reads, loaded (a UserError where none does), preferring one no newer
        than the last whole line of metrics.jsonl: the lines lost after it are logged again."""
        whole = from_main(self.record.whole_until())  # rank 0's record: every rank goes on from one step
        if whole is not None:
            before = [p for p in saved if checkpoint.step_of(p) <= whole]
            if not before:
                log.warning(
                    "metrics.jsonl: a line after step %d is damaged and every checkpoint kept (%s) is newer: "
                    "the record of the steps from step %d to the checkpoint's is lost",
                    whole, ", ".join(p.name for p in saved), whole + 1,
                )  # fmt: skip
            saved = before or saved
        damaged: list[tuple[Path, checkpoint.Damaged]] = []
        for path in reversed(saved):
            try:
                loaded = checkpoint.load(path, self.model, self.optimizer, check=partial(self._check, path))
            except checkpoint.Damaged as exc:
                damaged.append((path, exc))
                continue
            break
        else:
            newest, exc = damaged[0]
            raise UserError(
                f"{exc}; no checkpoint of {newest.parent} can be read (each is kept as it is): give this run "
                "its own hydra.run.dir"
            ) from exc
        for bad, exc in damaged if rank() == 0 else []:  # every rank found them damaged: the first says so
            aside, reason = checkpoint.set_aside(bad), one_line(exc.__cause__)[:300]
            log.warning("%s cannot be read (%s): kept as %s; going on from %s", bad, reason, aside.name, path)
        return path, loaded

    def _check(self, path: Path, payload: dict[str, Any]) -> None:
        """Refuse a resume that changes what it may not (`checkpoint.check_resume`), before any weight
        is restored; keep the changes it applies."""
        self.changes = checkpoint.config_changes(payload.get("config", self.config), self.config)
        checkpoint.check_resume(path, self.changes)

    def due(self, step: int) -> bool:
        return bool(self.tc.checkpoint_every) and step % self.tc.checkpoint_every == 0

    def save(self, step: int) -> Path | None:
        """The checkpoint of `step` (every rank calls this; once per step); None without a run directory."""
        if self.run_dir is None:
            return None
        if self._last is None or self._last[0] != step:
            start = time.perf_counter()
            state = {"optimizer": self.optimizer, **self.state, **self.kept, "config": self.config}
            self.record.sync()  # the lines of the steps it holds on disk first: no resume logs them again
            self._last = step, checkpoint.save(self.run_dir, step, self.model, state, self.tc.keep_last)
            self.save_s += time.perf_counter() - start
        return self._last[1]
