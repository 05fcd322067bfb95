"""summary.json: what a run says about itself, started when the run starts, filled as it goes and
written once at its end by the same code for every outcome (completed, aborted, interrupted, failed)."""

import datetime
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from aamperf.errors import NoSpace
from aamperf.metrics import StepMeter, null_reason, utilization

log = logging.getLogger(__name__)


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config with interpolations resolved, or as written when one cannot be (a failed run)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    except Exception:  # e.g. ${model.max_asvs} with a model that has none: the error is recorded already
        return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)


# summary.json duration_parts_s: where a run's duration_s went (docs/run-outputs.md says what each holds)
DURATION_PARTS = (
    "start", "setup", "auto", "data", "steps", "validation", "checkpoints", "loop", "end", "other",
)  # fmt: skip


class Summary(dict):
    def __init__(self, cfg: DictConfig, meter: StepMeter, clock_origin: str, loggers: list[dict]):
        super().__init__(
            status="running",
            optim=cfg.optim,
            # what the run did, once decided (`write`): precision=auto's dtype, device=auto's device;
            # until then (a run that failed first) and in `requested`, what was asked
            precision=str(cfg.precision.dtype),  # a plain string, not the schema's enum
            device=None,
            requested={"precision": str(cfg.precision.dtype), "device": str(cfg.device)},
            world_size=1,
            seed=cfg.seed,
            started_at=datetime.datetime.now().isoformat(timespec="seconds"),
            host=platform.node(),
            torch=torch.__version__,
            clock_origin=clock_origin,
            phases={},
            logger=loggers,
            error=None,
        )
        self.meter = meter
        # seconds of the run by what it was doing (`write`: duration_parts_s), as they are measured
        self.parts_s: dict[str, float] = {}
        self.loop_ended_at: float | None = None  # perf_counter when the loop returned

    def trained(self, result, plan=None, monitor=None) -> None:
        """What the loop did, however it ended (`result`: its FitResult; None: it never started)."""
        self.update(self.meter.summary())
        cached = (self.get("finetune") or {}).get("cached_embeddings")
        if cached is not None:  # the steps' time beside what the cache cost (aamperf/trainer/cached.py)
            cached.update(step_time_s=self.get("step_time_s"), samples_per_s=self.get("samples_per_s"))
        if monitor is not None:
            self.update(monitor.summary())
        if plan is not None:
            guard = plan.memory_guard
            self.update(
                memory_cleanups=guard.cleanups,
                memory_limit_bytes=guard.limit_bytes,
                memory_limit_source=guard.limit_source,
            )
        if result is None:
            return
        self.parts_s.update(result.times_s)  # steps, validation, checkpoints, the rest of the loop
        self.update(
            steps=result.steps,
            train_loss=result.train_loss,
            val_loss=result.val.get("val_loss"),
            val=result.val,
            nonfinite_steps=result.nonfinite_steps,
            nonfinite_check=result.nonfinite_check,
            resumed_from_step=result.resumed_from,
            resume_changes=result.resume_changes,
            profile=result.profile,
            alerts=result.alerts,
            best=result.best and result.best.record(),
        )

    def completed(self, job, model_flops: float, hardware_flops: float) -> None:
        """Status completed, with the figures only a whole run has: compile time, MFU / HFU."""
        self["status"] = "completed"
        # A compiled run: the compile phase's warm-up and the warm-up steps' excess over the median step
        # (the lazy compiles of new shapes). An eager one compiled nothing: its warm-up's excess (first
        # allocations, caches) is warmup_excess_s alone. A compile=auto trial whose compile the run did not
        # keep is in auto_s.
        compiled = job.plan.records["compile"]
        self["compile_time_s"] = (
            compiled.get("compile_time_s", 0.0) + (self.get("warmup_excess_s") or 0.0)
            if compiled["status"] == "applied"
            else 0.0
        )
        # Achieved FLOP/s over the timed steps against the peak of the matmuls' dtype; above 1: null + why.
        step_time, peak = self["step_time_s"], job.peak_flops
        mfu, hfu = utilization(model_flops, step_time, peak), utilization(hardware_flops, step_time, peak)
        self.update(null_reason(mfu, hfu, peak, self["peak_flops_calibration"]))

    def ended(self, status: str, error: str) -> None:
        self.update(status=status, error=error)

    def duration_parts(self, duration_s: float) -> dict[str, float]:
        """`duration_s` by what the run did, in DURATION_PARTS' order; what no part measured is "other"
        (a run that ended early has the parts it reached)."""
        parts = dict(self.parts_s)
        if self.loop_ended_at is not None:
            parts["end"] = time.perf_counter() - self.loop_ended_at
        parts["other"] = duration_s - sum(parts.values())
        return {k: round(parts[k], 3) for k in DURATION_PARTS if k in parts}

    def write(self, record, cfg: DictConfig, run_dir: Path) -> None:
        """Into the run record (rank 0); a full disk is said in one line unless the run failed already."""
        # ended_at - duration_s is when the run started: the report finds runs that shared a machine's time
        ended_at = datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")
        duration_s = self.meter.elapsed_s()
        self.update(
            duration_s=duration_s,
            duration_parts_s=self.duration_parts(duration_s),
            ended_at=ended_at,
            config=resolved_config(cfg),
            pid=os.getpid(),
        )
        self["precision"] = str(cfg.precision.dtype)  # precision=auto's choice is written into cfg
        try:
            record.write_summary(dict(self))
        except NoSpace as exc:
            if self["status"] == "completed":
                raise
            log.warning("summary.json not written: no space left in %s (%r)", run_dir, exc.__cause__)
