"""The guards that watch a training run and stop it before it loses its state: non-finite steps and
validations (`nonfinite.py`), memory (`memory.py`) and the alerts' thresholds (aamperf/alerts.py), checked
together. Under torch.distributed the ranks agree: one rank's reason to stop stops them all."""

import math
from typing import Any

import torch
from omegaconf import DictConfig

from aamperf.alerts import Alerts
from aamperf.distributed import all_sum, world_size
from aamperf.guards.memory import MemoryGuard, memory_limit
from aamperf.guards.nonfinite import NonfiniteGuard, nonfinite_validation
from aamperf.metrics.interval import Interval

__all__ = ["Guards", "MemoryGuard", "NonfiniteGuard", "memory_limit", "nonfinite_validation"]


class Guards:
    def __init__(self, cfg: DictConfig, plan, device: torch.device, record: Any):
        self.nonfinite = NonfiniteGuard(plan.optimizer, plan.scaler, device, cfg.trainer.max_nonfinite)
        self.memory: MemoryGuard = plan.memory_guard
        self.alerts = Alerts(cfg, record)
        self.device, self.world = device, world_size()
        self.max_fraction = cfg.memory.max_fraction
        self._memory_stop: str | None = None

    def step(self, step: int, losses: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The optimizer step unless it is not finite; its (device) non-finite flag."""
        return self.nonfinite.step(step, losses, grad_norm)

    def memory_over(self, at_log_line: bool) -> bool:
        """Memory: read every step in one process (at most every 0.1 s); distributed, at log lines, where
        the ranks agree through `end_interval`'s all-reduce. True: the interval must end now."""
        if self.world == 1 or at_log_line:
            self._memory_stop = self.memory.check()
        return self._memory_stop is not None

    def end_interval(
        self, step: int, interval: Interval, losses: torch.Tensor, names: list[str]
    ) -> tuple[dict[str, float], str | None]:
        """The log line's losses (the interval's mean loss of its finite steps, the last step's parts; the
        mean over ranks) and non-finite count, and why the run must stop now (None: it goes on).
        Host sync: one (and, distributed, one all-reduce)."""
        n_bad, stop = self.nonfinite.end_interval(step, names)
        over = torch.tensor([float(self._memory_stop is not None)], device=self.device)
        shares = all_sum(torch.cat([interval.loss_sum[None], losses[1:], over])).tolist()
        shares[0] /= interval.steps - n_bad or math.nan  # NaN: no step of the interval was finite
        memory_stop = self._memory_stop
        if shares.pop() and not memory_stop:
            memory_stop = f"another rank's memory went over memory.max_fraction={self.max_fraction}"
        row = {name: share / self.world for name, share in zip(names, shares, strict=True)}
        return {**row, "nonfinite_steps": n_bad}, stop or memory_stop

    def check_validation(self, step: int, val: dict[str, float | None]) -> str | None:
        """Why the run must stop after this validation (its figures are every rank's, all-reduced: the
        ranks agree without a word)."""
        return nonfinite_validation(step, val)

    def check_alerts(
        self, step: int, row: dict[str, Any], warmed: bool, gpu_util: float | None
    ) -> str | None:
        """The alerts of this log line (throughput only where the interval held no warm-up step); why
        the run must stop, where `alerts.stop_on_critical` says a critical one does."""
        readings = {
            "samples_per_s": row["samples_per_s"] if warmed else None,
            "val_loss": row.get("val_loss"),
            "memory_fraction": self.memory.last_fraction,
            "gpu_util_percent": gpu_util,
        }
        stop = self.alerts.check(step, readings)
        if self.world > 1 and self.alerts.stop_on_critical:  # every rank stops, or none (one all-reduce)
            anyone = all_sum(torch.tensor([float(stop is not None)], device=self.device)).item()
            stop = stop or ("another rank raised a critical alert" if anyone else None)
        return stop
