"""Mixed precision: autocast on the run's device, a GradScaler for fp16, matmul precision switches."""

import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from aamperf.metrics.flops import DTYPES  # one home: precision.dtype -> the torch dtype
from aamperf.model.layers import LayerNorm, Transformer
from aamperf.phases.record import applied, skipped
from aamperf.probe_measures import timed


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


def apply_residual(model: nn.Module, cfg: DictConfig) -> dict[str, Any]:
    """precision.residual=autocast: each Transformer stack of `model` carries its residual stream in the
    autocast dtype and each aamperf LayerNorm normalizes in it (`aamperf.model.layers`), where autocast
    would keep both in fp32 (4 bytes an element, a cast before every Linear that reads a norm). Decided at
    each forward by whether autocast is on, so fp32 steps (precision=fp32, or a low precision declined by
    `confirm_low_precision`) stay fp32. The fields it adds to the precision phase's record."""
    if cfg.residual == "fp32":
        return {"residual": "fp32"}
    stacks = [m for m in model.modules() if isinstance(m, Transformer)]
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    for module in stacks:
        module.autocast_stream = True
    for module in norms:
        module.in_autocast_dtype = True
    fields = {"residual": "autocast", "residual_stacks": len(stacks), "residual_norms": len(norms)}
    if not stacks and not norms:
        fields["residual_note"] = "the model has no aamperf Transformer or LayerNorm: nothing changed"
    elif cfg.dtype == "fp32":
        fields["residual_note"] = "precision fp32: no autocast dtype, the stream stays fp32"
    return fields


# A low-precision step must be this much faster than fp32's to be kept: it may cost quality, fp32 not.
MIN_STEP_GAIN = 1.05


def step_times(
    step: Callable[[Callable, torch.amp.GradScaler, int], None],
    cfg: DictConfig,
    device: torch.device,
    dtypes: list[str],
    batches: int,
) -> dict[str, Any]:
    """Median seconds of a training step (forward + backward of batch i, `step(autocast, scaler, i)`)
    under each of `dtypes`, after a warm-up pass over the trial batches (a GPU's kernels and plans for
    each new shape are made then). {step_s: {dtype: s}, batches}; fp32's None where its step ran out of
    the device's memory (a batch that fits in 2-byte activations need not fit in fp32's)."""
    figures: dict[str, float | None] = {}
    for dtype in dtypes:
        autocast, scaler, _ = apply_precision(OmegaConf.merge(cfg, {"dtype": dtype}), device)

        def one_pass(autocast=autocast, scaler=scaler) -> None:
            for i in range(batches):
                step(autocast, scaler, i)

        try:
            figures[dtype] = statistics.median(timed(one_pass, device, trials=3)) / batches
        except torch.OutOfMemoryError:
            if dtype != "fp32":
                raise  # the dtype the run would train in does not fit: its first step would fail alike
            figures[dtype] = None
        if figures[dtype] is None and device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's blocks, back to the GPU
    return {"step_s": figures, "batches": batches}


def confirm_precision(decision: dict, figures: dict[str, Any]) -> bool:
    """Keep precision=auto's low-precision choice only where the trial's steps gain MIN_STEP_GAIN over
    fp32's; else turn `decision` to fp32, saying why. True where it changed."""
    low, step_s = decision["chose"], figures["step_s"]
    decision["step_trial"] = figures
    if step_s["fp32"] is None:
        decision["reason"] = decision["reason"].removesuffix(f": {low}") + (
            f"; a training step in fp32 ran out of the device's memory at this batch, one under {low}"
            f" autocast did not: {low}"
        )
        return False
    gain = step_s["fp32"] / step_s[low]
    keep = gain >= MIN_STEP_GAIN
    verdict = (
        f"; a training step under {low} autocast ran {1 / gain:.2f}x fp32's time here "
        f"({step_s[low]:.3g} s vs {step_s['fp32']:.3g} s over {figures['batches']} batches; "
        f"{'>=' if keep else '<'} {MIN_STEP_GAIN}x faster): {low if keep else 'fp32'}"
    )
    decision["reason"] = decision["reason"].removesuffix(f": {low}") + verdict
    if not keep:
        decision["chose"] = "fp32"
    return not keep
