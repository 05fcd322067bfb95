"""Optimization phases, applied in one fixed order; each records what it did in summary.json `phases`.

Order (torchtitan's): system and loader settings before the data is built; then on the model
precision -> attention -> dropout -> AAM ops -> channels_last -> activation checkpointing -> compile
-> distributed wrap (DDP / FSDP2); the optimizer is built last, over the transformed model's parameters.
"""

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import torch
from omegaconf import DictConfig
from torch import nn

from aamperf.allocator import check_allocator
from aamperf.distributed import World, alone, main_decides
from aamperf.errors import UserError
from aamperf.guards import MemoryGuard
from aamperf.phases.aam_ops import apply_aam_ops, collate_pad_to
from aamperf.phases.attention import apply_attention, check_attention
from aamperf.phases.compile import (
    apply_compile,
    auto_compile,
    cached_decision,
    compile_on_ranks,
    trial_context,
)
from aamperf.phases.dataloader import check_dataloader, resolve_dataloader
from aamperf.phases.distributed import check_comm_hook, grad_sync, wrap_model
from aamperf.phases.dropout import apply_dropout
from aamperf.phases.memory import apply_checkpointing, apply_cuda_memory, budget_unused, check_memory
from aamperf.phases.optimizer import build_optimizer
from aamperf.phases.precision import (
    DTYPES,
    apply_precision,
    apply_residual,
    check_precision,
    confirm_precision,
    step_times,
)
from aamperf.phases.record import skipped
from aamperf.phases.system import apply_channels_last, apply_system
from aamperf.probe import Probe, compile_block

TRIAL_BATCHES = 4  # batches of compile=auto's trial (shapes differ per batch: recompiles are in it)


def check_phases(cfg: DictConfig, device: torch.device) -> None:
    """Every problem of the phase choices at once, before anything runs."""
    problems = check_precision(cfg.precision, device)
    problems += check_attention(cfg.attention, device, DTYPES.get(cfg.precision.dtype, torch.float32))
    problems += check_memory(cfg.memory, cfg.compile) + check_dataloader(cfg.dataloader)
    problems += check_comm_hook(cfg.distributed, device) + check_allocator(cfg.system.allocator)
    if problems:
        raise UserError("; ".join(problems))


@dataclass
class Setup:
    """What the phases decide before the data exists."""

    loader: DictConfig
    pad_to: int | str | None
    records: dict[str, dict]


def setup_phases(cfg: DictConfig, device: torch.device) -> Setup:
    records = apply_system(cfg.system, device)
    records["cuda_memory"] = apply_cuda_memory(cfg.memory, device)
    loader, records["dataloader"] = resolve_dataloader(cfg.dataloader, device)
    return Setup(loader, collate_pad_to(cfg.aam_ops, cfg.data.max_asvs), records)


@dataclass
class Plan:
    """What the loop runs with: no flags, only objects that do the right thing (or nothing)."""

    model: nn.Module
    autocast: Callable[[], AbstractContextManager]
    scaler: torch.amp.GradScaler
    optimizer: torch.optim.Optimizer
    memory_guard: MemoryGuard
    records: dict[str, dict]
    grad_sync: Callable[[bool], AbstractContextManager]  # off: gradients stay local (accumulation)
    is_main: bool = True  # rank 0 (or the only process): the one that shows progress
    rank: int = 0


def apply_phases(
    model: nn.Module,
    cfg: DictConfig,
    device: torch.device,
    warmup: Callable[[nn.Module, Callable, object, int], None],
    records: dict[str, dict],
    world: World,
    micro_batch: int,
    steps: int | None = None,
    precision: dict | None = None,
    least_step_s: float | None = None,
    heads_only: bool = False,
) -> Plan:
    """Transform `model` in the fixed order; `warmup(model, autocast, scaler, i)` runs one forward + backward
    of the run's i-th batch (i < TRIAL_BATCHES); `steps`: those the run will train (compile=auto's stake;
    default trainer.max_steps); `precision`: precision=auto's decision, where it was auto (a GPU's is
    confirmed by timing steps, and changed in place where fp32 is faster); `least_step_s`: a step's FLOPs
    at the device's peak, where known (compile=auto tells a run too short to compile by it); `heads_only`:
    the steps will train the heads on cached embeddings (aamperf/trainer/cached.py), which compile=auto does
    not compile: a trial would time the whole model's steps, which the run never takes."""
    autocast, scaler, records["precision"] = apply_precision(cfg.precision, device)
    records["precision"].update(apply_residual(model, cfg.precision))
    records["attention"] = apply_attention(model, cfg.attention, device)
    records["dropout"] = apply_dropout(model, cfg.dropout, device)  # after attention: reaches its dropout too
    records["aam_ops"] = apply_aam_ops(model, cfg.aam_ops)
    records["channels_last"] = apply_channels_last(model, cfg.system)
    records["checkpointing"] = apply_checkpointing(model, cfg.memory, compiles=cfg.compile.mode != "disabled")
    if precision is not None and precision["chose"] != "fp32" and device.type == "cuda":
        if confirm_low_precision(model, cfg, device, warmup, precision, micro_batch):  # turned to fp32
            autocast, scaler, records["precision"] = apply_precision(cfg.precision, device)
            records["precision"].update(apply_residual(model, cfg.precision))
    step = partial(warmup, model, autocast, scaler)
    if cfg.compile.mode == "auto" and heads_only:
        reason = (
            "the steps train the heads alone, on cached embeddings (finetune.cache_embeddings): a trial "
            "would time the whole model's steps, which the run never takes"
        )
        records["compile"] = skipped(f"compile=auto: {reason}", auto={"chose": "disabled", "reason": reason})
    elif cfg.compile.mode == "auto":
        steps = cfg.trainer.max_steps if steps is None else steps
        records["compile"] = decide_compile(model, cfg, step, world, micro_batch, device, steps, least_step_s)
    else:
        records["compile"] = apply_compile(model, cfg.compile, lambda: step(0))
    records["checkpointing"] = budget_unused(records["checkpointing"], records["compile"])
    param_dtype = DTYPES.get(cfg.precision.dtype, torch.float32)
    model, records["distributed"] = wrap_model(model, cfg, world, device, param_dtype)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer, records["optimizer"] = build_optimizer(named, cfg.trainer, cfg.optimizer)
    guard = MemoryGuard(cfg.memory, device)
    return Plan(
        model, autocast, scaler, optimizer, guard, records, grad_sync(model), world.is_main, world.rank
    )


def confirm_low_precision(
    model: nn.Module,
    cfg: DictConfig,
    device: torch.device,
    warmup: Callable,
    decision: dict,
    micro_batch: int,
) -> bool:
    """precision=auto on a GPU: the matmul rate chose a low-precision dtype; training steps of the model
    (its phases applied, before compile) under it and under fp32 decide; True where they turned it (and
    cfg.precision.dtype) to fp32. A faster matmul did not make a
    faster step on an H100 at the headline's shapes: the steps wait on kernel launches (MFU 0.005) and
    autocast adds a cast kernel per matmul input (experiments/gpu/README.md). On CPUs the matmul rule
    stands (the step studies agree with it there, and a trial would cost seconds a step). The first rank
    times, alone; the figures are cached by device, model, phases and batch shape."""
    probe = Probe(device, cfg.probe.cache, cfg.probe.refresh)
    dtypes = [decision["chose"], "fp32"]

    def trial() -> dict:
        with alone():
            return probe.answer(
                "precision_trial",
                {"context": trial_context(cfg, micro_batch)},
                lambda: {
                    **step_times(partial(warmup, model), cfg.precision, device, dtypes, TRIAL_BATCHES),
                    "under_load": None,
                },
            )

    start = time.perf_counter()
    changed = confirm_precision(decision, main_decides(trial))
    decision["decide_s"] = time.perf_counter() - start  # counted in the run's auto_s
    if changed:
        cfg.precision.dtype = "fp32"
    return changed


def decide_compile(
    model: nn.Module,
    cfg: DictConfig,
    step: Callable[[int], None],
    world: World,
    micro_batch: int,
    device: torch.device,
    steps: int,
    least_step_s: float | None = None,
) -> dict:
    """compile=auto over the `steps` the run will train, decided by the first rank alone (ranks timing
    steps together would each see the others' load) and followed by every rank (`compile_on_ranks`).
    The record's `decide_s`: the seconds spent deciding, but the compile the run keeps (its
    compile_time_s)."""
    start, context = time.perf_counter(), trial_context(cfg, micro_batch)

    def probe() -> Probe:
        return Probe(device, cfg.probe.cache, cfg.probe.refresh)

    def decide() -> dict:
        block = compile_block(cfg.model, micro_batch, cfg.data.max_asvs)
        dtype = DTYPES.get(cfg.precision.dtype, torch.float32)
        return auto_compile(
            model, cfg.compile, step, TRIAL_BATCHES, steps, probe(), context, block, dtype, least_step_s
        )

    def known() -> dict | None:
        return cached_decision(probe(), context, steps)

    record = compile_on_ranks(model, cfg.compile, step, world, known, decide)
    kept = record.get("compile_time_s", 0.0) if record["status"] == "applied" else 0.0
    return {**record, "decide_s": max(0.0, time.perf_counter() - start - kept)}
