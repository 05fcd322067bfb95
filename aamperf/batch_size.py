"""The batch-size finder (`trainer.batch_size=auto`): the largest even batch whose training step fits
a memory budget, measured with the run's own model, phases, optimizer and heaviest samples.

A probe is one full step (forward, backward, optimizer step) on the `m` training samples with the
most ASVs; its peak memory is this process's peak RSS (CPU: the kernel's high-water mark, reset
before each probe) or the CUDA allocator's peak (GPU, where an out-of-memory error is caught and
counts as "does not fit"). The batch doubles while it fits, then a bisection narrows the gap to
within `trainer.auto_batch.tolerance`. On a CPU a batch predicted (linearly, from the last two
probes) to exceed memory.max_fraction is not tried: running out of RAM ends the process instead of
raising; a batch between the budget and that limit is measured, and does not fit.
The model, optimizer state and random generators are put back afterwards, so the run starts as if
its batch size had been given. Under torch.distributed the ranks agree on every decision (the
largest peak of all ranks counts) and split the budget of a machine they share. On several GPUs a
rank that runs out of memory inside a collective (the UniFrac gather, DDP's all-reduce) leaves the
others waiting until distributed.timeout_s: the budget, well under the device's memory, should be
what decides, and an out-of-memory error only the last resort. (The GPU paths have not run here.)
"""

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from aamperf.device import to_device
from aamperf.distributed import world_size
from aamperf.errors import UserError
from aamperf.guards import memory_limit
from aamperf.metrics.monitor import peak_rss, release_freed_memory, reset_peak_rss
from aamperf.phases import Plan
from aamperf.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)


def smallest_batch(world: int) -> int:
    """The smallest global batch: even (UniFrac compares pairs) and split evenly over the ranks."""
    return 2 * world


def memory_budget(fraction: float, device: torch.device) -> int:
    """Bytes one rank may use: `fraction` of the device's memory (CUDA), or of the RAM this run can
    have (available now + this process's RSS, at most its cgroup's limit: the memory guard's), shared
    by the ranks on this machine (CPU)."""
    if device.type == "cuda":
        return int(fraction * torch.cuda.get_device_properties(device).total_memory)
    usable = min(psutil.virtual_memory().available + psutil.Process().memory_info().rss, memory_limit()[0])
    return int(fraction * usable / int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def rank_memory(device: torch.device) -> tuple[int, str]:
    """(bytes one rank can have at most, what sets them): the GPU's memory, or this process's cgroup
    limit (else the machine's RAM) shared by the ranks on this machine."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    limit, set_by = memory_limit()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    what = "this machine's RAM" if set_by == "machine" else "this process's cgroup limit"
    return limit // ranks, what + (f" shared by its {ranks} ranks" if ranks > 1 else "")


def check_budget(budget_gib: float | None, device: torch.device) -> list[str]:
    """A fixed budget (trainer.auto_batch.budget_gib) more than a rank can have here, refused: capped, the
    finder would answer for this machine's memory, not for the budget asked, the same on every machine
    (a memory study compares the batches found under it)."""
    if budget_gib is None:
        return []
    most, what = rank_memory(device)
    if budget_gib * 2**30 <= most:
        return []
    return [
        f"trainer.auto_batch.budget_gib={budget_gib} is more than a rank can have here ({most / 2**30:.2f} "
        f"GiB: {what}); lower it, or trainer.auto_batch.budget_gib=null for trainer.auto_batch."
        "budget_fraction of that"
    ]


def peak_after(run: Callable[[], None], device: torch.device) -> float:
    """Peak bytes while `run()` runs; inf when the GPU runs out of memory."""
    release_freed_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            run()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return math.inf
        return float(torch.cuda.max_memory_reserved(device))
    reset_peak_rss()
    run()
    return float(peak_rss())


def _largest_of_all_ranks(peak: float, device: torch.device) -> float:
    if world_size() == 1:
        return peak
    value = torch.tensor([peak], device=device, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def largest_fitting(
    fits: Callable[[int], bool], grid: int, cap: int, tolerance: float
) -> tuple[int, int | None]:
    """The largest multiple of `grid` up to `cap` that `fits`, `grid` itself known to: doubling, then a
    bisection of the gap to within `tolerance`. (lo: fits; hi: the smallest tried that does not, or None.)"""
    lo, hi = grid, None
    while hi is None and lo < cap:
        m = min(2 * lo, cap)
        lo, hi = (m, None) if fits(m) else (lo, m)
    while hi is not None and hi - lo > max(grid, tolerance * lo):
        m = (lo + hi) // 2 // grid * grid
        if m == lo:
            break
        lo, hi = (m, hi) if fits(m) else (lo, m)
    return lo, hi


def find_batch_size(
    plan: Plan, loss_fn, data, cfg: DictConfig, device: torch.device, world: int
) -> dict[str, Any]:
    """Search the global micro-batch (a multiple of 2 * world); return what the run should use and
    the probes behind it (for summary.json)."""
    ac = cfg.trainer.auto_batch
    grid = smallest_batch(world)  # the search's step too
    train_idx = list(data.train_loader.dataset.indices)
    heaviest = sorted(train_idx, key=lambda i: -len(data.dataset[i]["asv_idx"]))
    cap = min(ac.max_batch, len(train_idx)) // grid * grid
    budget = memory_budget(ac.budget_fraction, device)
    unsafe = memory_budget(max(cfg.memory.max_fraction, ac.budget_fraction), device)  # never probed on a CPU
    if ac.budget_gib is not None:  # a fixed budget (the memory study's); the RAM limit still stands
        budget = int(ac.budget_gib * 2**30)
    asked = (
        f"trainer.auto_batch.budget_gib={ac.budget_gib}"
        if ac.budget_gib is not None
        else f"trainer.auto_batch.budget_fraction={ac.budget_fraction}"
    )
    model, optimizer = plan.model, plan.optimizer
    params = [p.detach().clone() for p in model.parameters()]
    rngs, optimizer_state = rng_state(), optimizer.state_dict()
    probes: list[dict[str, Any]] = []

    def step(m: int) -> None:
        batch = to_device(data.collate([data.dataset[i] for i in heaviest[:m]]), device, False)
        with plan.autocast():
            loss, _ = loss_fn(model, batch, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def fits(m: int) -> bool:
        peak = _largest_of_all_ranks(peak_after(lambda: step(m), device), device)
        probes.append(
            {"batch": m, "peak_bytes": None if math.isinf(peak) else int(peak), "fits": peak <= budget}
        )
        log.info(
            "batch-size finder: batch %d -> peak %.2f GiB (budget %.2f GiB)", m, peak / 2**30, budget / 2**30
        )
        return peak <= budget

    def predicted_over(m: int) -> bool:
        """CPU: would `m` go over memory.max_fraction, on the line through the last two probes that fit?"""
        done = [(p["batch"], p["peak_bytes"]) for p in probes if p["fits"]][-2:]
        if device.type == "cuda" or len(done) < 2:
            return False
        (m0, p0), (m1, p1) = done
        expected = p1 + (p1 - p0) / (m1 - m0) * (m - m1)
        if expected <= unsafe:
            return False
        probes.append({"batch": m, "predicted_bytes": int(expected), "fits": False})  # not run
        return True

    try:
        if cap < grid or not fits(grid):
            raise UserError(
                f"trainer.batch_size=auto: not even a batch of {grid} fits "
                f"{asked} ({budget / 2**30:.2f} GiB) "
                f"with {len(train_idx)} training samples; raise the budget, use memory=full or "
                "precision=bf16, or give trainer.batch_size"
            )
        lo, hi = largest_fitting(lambda m: not predicted_over(m) and fits(m), grid, cap, ac.tolerance)
    finally:  # the run starts from the state it had before the probes
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params, strict=True):
                p.copy_(saved)
        optimizer.load_state_dict(optimizer_state)
        optimizer.zero_grad(set_to_none=True)
        set_rng_state(rngs)
        release_freed_memory()
    micro, accum = lo, cfg.trainer.grad_accum_steps
    batch_size = micro * accum
    # effective_batch: keep the requested samples per step in micro-batches; exact, not a mean of the
    # micro-batches' losses: the UniFrac part pairs every sample of the step (aamperf/trainer/gradcache.py)
    if ac.effective_batch is not None:
        batch_size = ac.effective_batch
        splits = [a for a in range(1, batch_size // grid + 1) if batch_size % (a * grid) == 0]
        fitting = [a for a in splits if batch_size // a <= lo]
        if not fitting:
            raise UserError(
                f"trainer.auto_batch.effective_batch={batch_size} cannot be split into micro-batches of at "
                f"most {lo} samples that are multiples of {grid}; give a multiple of {grid}"
            )
        accum = fitting[0]
        micro = batch_size // accum
    limit = "memory" if hi is not None else ("data" if cap < ac.max_batch else "max_batch")
    return {
        "batch_size": batch_size,
        "grad_accum_steps": accum,
        "micro_batch": micro,
        "largest_fitting": lo,
        "limited_by": limit,
        "budget_bytes": budget,
        "probes": probes,
    }


def find_forward_batch(
    forward: Callable[[dict], Any], dataset, collate, device: torch.device, ac: DictConfig
) -> dict:
    """Inference (`python -m aamperf.predict batch_size=auto`): the largest batch whose forward pass on
    the samples with the most ASVs fits `ac`'s budget (budget_fraction of the memory this process can
    have, or budget_gib); the ranks agree on the smallest. On a CPU a batch predicted (linearly, from the
    last two probes that fit) to exceed 0.97 of what this process can have is not tried."""
    heaviest = sorted(range(len(dataset)), key=lambda i: -len(dataset[i]["asv_idx"]))
    budget = (
        int(ac.budget_gib * 2**30) if ac.budget_gib is not None else memory_budget(ac.budget_fraction, device)
    )
    unsafe = memory_budget(0.97, device)
    probes: list[dict[str, Any]] = []

    def fits(m: int) -> bool:
        done = [(p["batch"], p["peak_bytes"]) for p in probes if p["fits"]][-2:]
        if device.type != "cuda" and len(done) == 2:
            (m0, p0), (m1, p1) = done
            if p1 + (p1 - p0) / (m1 - m0) * (m - m1) > unsafe:
                probes.append({"batch": m, "fits": False, "predicted_over": True})
                return False
        batch = to_device(collate([dataset[i] for i in heaviest[:m]]), device)
        peak = _largest_of_all_ranks(peak_after(lambda: forward(batch), device), device)
        probes.append(
            {"batch": m, "peak_bytes": None if math.isinf(peak) else int(peak), "fits": peak <= budget}
        )
        return peak <= budget

    cap = min(ac.max_batch, len(dataset))
    if cap < 1 or not fits(1):
        raise UserError(
            f"batch_size=auto: not even one sample's forward pass fits the budget ({budget / 2**30:.2f} "
            "GiB); raise auto_batch.budget_fraction or auto_batch.budget_gib, or give batch_size"
        )
    lo, hi = largest_fitting(fits, 1, cap, ac.tolerance)
    if world_size() > 1:  # the same batches on every rank: the smallest that fits all
        agreed = torch.tensor([lo], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        lo = int(agreed.item())
    release_freed_memory()
    limit = "memory" if hi is not None else ("data" if cap < ac.max_batch else "max_batch")
    return {"batch_size": lo, "limited_by": limit, "budget_bytes": budget, "probes": probes}
