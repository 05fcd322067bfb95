"""The learning-rate schedule (`trainer.lr_schedule`): torch's schedulers, stepped once per optimizer step
(and, for `plateau`, at each validation)."""

import math
import warnings
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig

from aamperf.trainer.best import higher_is_better


def check_schedule(tc: DictConfig) -> list[str]:
    """The problem of a schedule torch's scheduler cannot run, found before the run starts: OneCycleLR
    divides by the steps of its rise (warmup_steps - 1, from its first step to its peak) and of its fall
    (max_steps - warmup_steps), a ZeroDivisionError at the first step where either is 0; the restarts'
    cycle must be a step or more, each next one as long or longer."""
    warmup, steps = tc.warmup_steps, tc.max_steps
    if tc.lr_schedule == "cosine_restarts":
        problems = []
        if tc.restart_steps is not None and tc.restart_steps < 1:
            problems.append(
                f"trainer.restart_steps={tc.restart_steps} must be >= 1 (the first cycle's steps), or null: "
                "a quarter of the steps after the warm-up"
            )
        if tc.restart_mult < 1:
            problems.append(
                f"trainer.restart_mult={tc.restart_mult} must be an integer >= 1 (1: equal cycles)"
            )
        return problems
    if tc.lr_schedule != "onecycle" or warmup <= 0 or steps <= 0 or 2 <= warmup < steps:
        return []  # warmup 0: torch's 30% of max_steps; negative values and no steps: check_config's
    fix = "trainer.warmup_steps=0 (torch's 30%)"
    if steps >= 3:
        fix += f" or {2 if steps == 3 else f'2 to {steps - 1}'}"
    return [
        f"trainer.lr_schedule=onecycle cannot rise over trainer.warmup_steps={warmup} of "
        f"trainer.max_steps={steps} (OneCycleLR needs 2 or more steps up and 1 or more down); set {fix}"
    ]


# what a resumed plateau takes from this run's config, not from the checkpoint (ReduceLROnPlateau's names)
RUN_SETTINGS = ("factor", "patience", "min_lrs", "threshold", "threshold_mode")


class OnPlateau:
    """lr_schedule=plateau: a linear warm-up over `warmup_steps`, stepped with the optimizer, then torch's
    ReduceLROnPlateau, stepped at each validation after the warm-up with `trainer.monitor`'s figure
    (`validated`): the lr times `plateau_factor`, down to lr x `min_lr_ratio`, once more than
    `plateau_patience` validations in a row did not improve on the best by more than `trainer.min_delta`
    (absolute, as early stopping counts: a relative threshold turns around for a negative R^2)."""

    def __init__(self, optimizer: torch.optim.Optimizer, tc: DictConfig):
        lrs = torch.optim.lr_scheduler
        self.optimizer, self.steps, self.warmup = optimizer, 0, min(tc.warmup_steps, tc.max_steps)
        self.monitor, self.base = tc.monitor, [group["lr"] for group in optimizer.param_groups]  # this run's
        floor = [lr * tc.min_lr_ratio for lr in self.base]
        self.warm = (
            lrs.LinearLR(optimizer, start_factor=1.0 / self.warmup, end_factor=1.0, total_iters=self.warmup)
            if self.warmup
            else None
        )
        mode = "max" if higher_is_better(tc.monitor) else "min"
        self.plateau = lrs.ReduceLROnPlateau(
            optimizer, mode=mode, factor=tc.plateau_factor, patience=tc.plateau_patience, min_lr=floor,
            threshold=tc.min_delta, threshold_mode="abs",
        )  # fmt: skip

    def step(self) -> None:  # once per optimizer step: the warm-up's
        self.steps += 1
        if self.warm is not None and self.steps <= self.warmup:
            self.warm.step()

    def validated(self, value: float | None) -> None:
        """After a validation: its `trainer.monitor` figure (None: the validation had none, the lr stays)."""
        if self.steps > self.warmup and value is not None and math.isfinite(value):
            self.plateau.step(value)

    def state_dict(self) -> dict[str, Any]:
        # the reductions so far, as a share of the run's lr (1 during the warm-up: none yet)
        groups = zip(self.optimizer.param_groups, self.base, strict=True)
        reduced = [group["lr"] / lr if self.steps > self.warmup else 1.0 for group, lr in groups]
        return {
            "schedule": "plateau", "monitor": self.monitor, "steps": self.steps,
            "plateau": self.plateau.state_dict(), "reduced": reduced,
        }  # fmt: skip

    def resume(self, state: dict[str, Any] | None) -> None:
        """Go on from a checkpoint's plateau (its count of validations without improving, and its
        reductions applied to this run's lr), with this run's factor, patience, threshold and floor. Start
        afresh from another schedule's state, one that watched another figure, or within the warm-up."""
        if not state or state.get("schedule") != "plateau" or state.get("monitor") != self.monitor:
            return
        if self.steps <= self.warmup:  # (the replay set the warm-up's lr)
            return
        mine = {k: v for k, v in self.plateau.state_dict().items() if k in RUN_SETTINGS}
        self.plateau.load_state_dict({**state["plateau"], **mine})
        for group, lr, share, floor in zip(
            self.optimizer.param_groups, self.base, state["reduced"], self.plateau.min_lrs, strict=True
        ):
            group["lr"] = max(lr * share, floor)


def cosine(step: int, length: int, ratio: float) -> float:
    """The lr's factor `step` steps into a cosine decay of `length` steps from 1 to `ratio` (torch's
    CosineAnnealingLR's curve, as a factor: each parameter group decays from its own lr to its own lr x
    ratio, where torch's scheduler takes one eta_min for every group)."""
    return ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * min(step, length) / length))


def restarting_cosine(step: int, first: int, mult: int, ratio: float) -> float:
    """The lr's factor `step` steps into cosine cycles restarting from 1, the first `first` steps long and
    each next `mult` times as long (torch's CosineAnnealingWarmRestarts' curve, as a factor)."""
    start, length = 0, first
    while step >= start + length:  # counted in whole steps: a restart falls exactly on its step
        start, length = start + length, length * mult
    return cosine(step - start, length, ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, tc: DictConfig, done_steps: int = 0):
    """torch's schedulers for `trainer.lr_schedule`, stepped once per optimizer step over `max_steps`:
    a linear warm-up over `warmup_steps`, then cosine or linear decay to lr x `min_lr_ratio`, or the lr
    kept (constant); or OneCycleLR (its rise over `warmup_steps`, torch's 30% without one); or the
    warm-up, then cosine cycles, each restarting from the lr (`restart_steps` long, each next
    `restart_mult` times as long); or the warm-up, then the lr reduced on a plateau of validations
    (`OnPlateau`: a resume also gives it the checkpoint's state). A resumed run replays its
    `done_steps`: the lr values it had, or, where the schedule's settings changed, this run's schedule at
    that step (a scheduler's own state would keep the old settings)."""
    lrs = torch.optim.lr_scheduler
    warmup = min(tc.warmup_steps, tc.max_steps)
    rest = max(1, tc.max_steps - warmup)
    if tc.lr_schedule == "plateau":
        scheduler = OnPlateau(optimizer, tc)
    elif tc.lr_schedule == "cosine_restarts":
        cycle = tc.restart_steps if tc.restart_steps is not None else max(1, (tc.max_steps - warmup) // 4)
        restarts = partial(restarting_cosine, first=cycle, mult=tc.restart_mult, ratio=tc.min_lr_ratio)
        scheduler = lrs.LambdaLR(optimizer, restarts)
        if warmup:
            warm = lrs.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
            scheduler = lrs.SequentialLR(optimizer, [warm, scheduler], milestones=[warmup])
    elif tc.lr_schedule == "onecycle":
        rise = warmup / tc.max_steps if warmup else 0.3
        max_lr = [group["lr"] for group in optimizer.param_groups]
        scheduler = lrs.OneCycleLR(optimizer, max_lr=max_lr, total_steps=tc.max_steps, pct_start=rise)
    else:
        if tc.lr_schedule == "warmup_cosine":
            decay = lrs.LambdaLR(optimizer, partial(cosine, length=rest, ratio=tc.min_lr_ratio))
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
