"""One run from a composed config: build data, model and loss, fit, and write the run record."""

import datetime
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from aamperf.checks import check_config
from aamperf.data import build_data
from aamperf.errors import UserError
from aamperf.metrics import RunRecord, StepMeter, SystemMonitor, count_flops, peak_flops
from aamperf.trainer import fit, to_device


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name} but no CUDA device is available here; use device=cpu or device=auto")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(cfg: DictConfig, name: str, **kwargs: Any) -> Any:
    """instantiate() with a user-facing error: a wrong kwarg of `model`/`loss` names the override."""
    try:
        return instantiate(cfg[name], **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        raise UserError(
            f"{name}: cannot build {cfg[name].get('_target_')}: {cause}; fix the {name}.* overrides "
            f"or conf/{name}/"
        ) from exc


def step_flops(model: torch.nn.Module, loss_fn, data, cfg: DictConfig, device: torch.device) -> float:
    """FLOPs of one optimizer step: the model's analytic count, or counted once by torch."""
    batch = next(iter(data.train_loader))
    b, s = batch["tokens"].shape[:2]
    if hasattr(model, "flops_per_step"):
        return model.flops_per_step(b, s) * cfg.trainer.grad_accum_steps
    batch = to_device(batch, device, False)
    flops = count_flops(lambda: loss_fn(model, batch, 0)[0].backward())
    model.zero_grad(set_to_none=True)
    return flops * cfg.trainer.grad_accum_steps


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run one training job into `run_dir`; the summary is written there on success and on failure."""
    record = RunRecord(run_dir)
    meter = StepMeter(skip_steps=cfg.metrics.skip_steps)
    summary: dict[str, Any] = {
        "status": "running",
        "optim": cfg.optim,
        "precision": cfg.precision,
        "device": None,
        "world_size": 1,
        "seed": cfg.seed,
        "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "phases": {},
        "error": None,
    }
    try:
        check_config(cfg)
        device = resolve_device(cfg.device)
        summary["device"] = str(device)
        seed_everything(cfg.seed)
        data = build_data(cfg.data, batch_size=cfg.trainer.batch_size, seed=cfg.seed, loader=cfg.dataloader)
        model = build(cfg, "model").to(device)
        loss_fn = build(cfg, "loss")
        flops = step_flops(model, loss_fn, data, cfg, device)
        peak = peak_flops(device, cfg.precision, cfg.metrics.peak_flops_cache)
        summary.update(
            flops_per_step=flops,
            peak_flops=peak,
            n_params=sum(p.numel() for p in model.parameters()),
            n_train=data.n_train,
            n_val=data.n_val,
            unifrac_cached=data.unifrac_cached,
        )
        with SystemMonitor(device, cfg.metrics.monitor_interval_s) as monitor:
            result = fit(model, loss_fn, data, cfg, device, record, monitor, meter)
        timing = meter.summary()
        step_time = timing["step_time_s"]
        summary.update(timing, **monitor.summary())
        summary.update(
            status="completed",
            steps=result.steps,
            train_loss=result.train_loss,
            val_loss=result.val.get("val_loss"),
            val=result.val,
            nonfinite_steps=result.nonfinite_steps,
            # Achieved FLOP/s over the measured steps against the device's peak for this dtype.
            mfu=flops / step_time / peak if peak and step_time else None,
        )
    except BaseException as exc:
        summary.update(status="failed", error=str(exc) if isinstance(exc, UserError) else repr(exc))
        summary.update(meter.summary())
        raise
    finally:
        summary["duration_s"] = time.perf_counter() - meter.start_time
        summary["config"] = OmegaConf.to_container(cfg, resolve=True)
        summary["pid"] = os.getpid()
        record.write_summary(summary)
        record.close()
    return summary
