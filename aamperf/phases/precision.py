"""Mixed precision: autocast on the run's device, a GradScaler for fp16, matmul precision switches."""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from omegaconf import DictConfig

from aamperf.metrics.flops import DTYPES  # one home: precision.dtype -> the torch dtype
from aamperf.phases.record import applied, skipped


def check_precision(cfg: DictConfig, device: torch.device) -> list[str]:
    if cfg.dtype == "fp16" and device.type != "cuda":
        return [
            f"precision=fp16 needs a CUDA GPU (loss scaling for fp16 is a GPU technique, and {device.type} "
            "has no fast fp16 matmul); use precision=bf16"
        ]
    if cfg.dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["precision=bf16: this GPU has no bfloat16 support; use precision=fp16"]
    return []


def apply_precision(
    cfg: DictConfig, device: torch.device
) -> tuple[Callable[[], AbstractContextManager], torch.amp.GradScaler, dict]:
    """(autocast context factory, GradScaler, record). fp32: a do-nothing context and a disabled scaler."""
    torch.set_float32_matmul_precision(cfg.matmul_precision)  # "high" lets CUDA use TF32 for fp32 matmuls
    # A disabled scaler is an identity (scale, unscale_, step, update pass through): the loop never branches.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
    if cfg.dtype == "fp32":
        return nullcontext, scaler, skipped("precision=fp32", matmul_precision=cfg.matmul_precision)
    autocast = partial(torch.autocast, device_type=device.type, dtype=DTYPES[cfg.dtype])
    return (
        autocast,
        scaler,
        applied(dtype=cfg.dtype, grad_scaler=scaler.is_enabled(), matmul_precision=cfg.matmul_precision),
    )
