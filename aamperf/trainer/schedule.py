"""The learning-rate schedule (`trainer.lr_schedule`): torch's schedulers, stepped once per optimizer step."""

import warnings

import torch
from omegaconf import DictConfig


def check_schedule(tc: DictConfig) -> list[str]:
    """The problem of a schedule torch's scheduler cannot run, found before the run starts: OneCycleLR
    divides by the steps of its rise (warmup_steps - 1, from its first step to its peak) and of its fall
    (max_steps - warmup_steps), a ZeroDivisionError at the first step where either is 0."""
    warmup, steps = tc.warmup_steps, tc.max_steps
    if tc.lr_schedule != "onecycle" or warmup <= 0 or steps <= 0 or 2 <= warmup < steps:
        return []  # warmup 0: torch's 30% of max_steps; negative values and no steps: check_config's
    fix = "trainer.warmup_steps=0 (torch's 30%)"
    if steps >= 3:
        fix += f" or {2 if steps == 3 else f'2 to {steps - 1}'}"
    return [
        f"trainer.lr_schedule=onecycle cannot rise over trainer.warmup_steps={warmup} of "
        f"trainer.max_steps={steps} (OneCycleLR needs 2 or more steps up and 1 or more down); set {fix}"
    ]


def build_scheduler(optimizer: torch.optim.Optimizer, tc: DictConfig, done_steps: int = 0):
    """torch's schedulers for `trainer.lr_schedule`, stepped once per optimizer step over `max_steps`:
    a linear warm-up over `warmup_steps`, then cosine or linear decay to lr x `min_lr_ratio`, or the lr
    kept (constant); or OneCycleLR (its rise over `warmup_steps`, torch's 30% without one). A resumed
    run replays its `done_steps`: the lr values it had, or, where the schedule's settings changed, this
    run's schedule at that step (a scheduler's own state would keep the old settings)."""
    lrs = torch.optim.lr_scheduler
    warmup = min(tc.warmup_steps, tc.max_steps)
    rest = max(1, tc.max_steps - warmup)
    if tc.lr_schedule == "onecycle":
        rise = warmup / tc.max_steps if warmup else 0.3
        max_lr = [group["lr"] for group in optimizer.param_groups]
        scheduler = lrs.OneCycleLR(optimizer, max_lr=max_lr, total_steps=tc.max_steps, pct_start=rise)
    else:
        if tc.lr_schedule == "warmup_cosine":
            decay = lrs.CosineAnnealingLR(optimizer, T_max=rest, eta_min=tc.lr * tc.min_lr_ratio)
        elif tc.lr_schedule == "warmup_linear":
            decay = lrs.LinearLR(optimizer, start_factor=1.0, end_factor=tc.min_lr_ratio, total_iters=rest)
        else:
            decay = lrs.ConstantLR(optimizer, factor=1.0, total_iters=0)
        scheduler = decay
        if warmup:
            warm = lrs.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
            scheduler = lrs.SequentialLR(optimizer, [warm, decay], milestones=[warmup])
    with warnings.catch_warnings():  # "step() before optimizer.step()": a replay, no training
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(done_steps):
            scheduler.step()
    return scheduler
