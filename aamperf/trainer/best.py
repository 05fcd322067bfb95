"""The run's best validation, and early stopping on it (`trainer.patience`, `trainer.monitor`,
`trainer.min_delta`, `trainer.keep_best`): the run ends after `patience` validations in a row whose
`monitor` figure did not improve on its best by more than `min_delta`, as the original AAM's
`--patience` ends its runs (in epochs there); with `keep_best`, model.pt and the run's validation
figures are those of its best validation, as the original's best_model.pt."""

import copy
import logging
import math
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

from aamperf.errors import UserError
from aamperf.weights import full_weights

log = logging.getLogger(__name__)

HIGHER_IS_BETTER = ("_r2", "accuracy", "_f1", "_auc")  # a figure named so improves upward; any other down
# validation figures that are not a quality: how many samples, and a quantile interval's coverage (best
# near its nominal, not at either end)
NOT_A_QUALITY = ("val_samples", "val_target_interval_coverage", "val_target_interval_nominal")


NEEDS_TARGET = ("val_target", "val_accuracy", "val_macro_f1", "val_roc_auc")  # figures of data.target's


def higher_is_better(figure: str) -> bool:
    return figure.endswith(HIGHER_IS_BETTER)


def monitor_problems(tc: DictConfig, target: str | None) -> list[str]:
    """What is wrong with the keys that watch a validation figure, early stopping's and the plateau
    schedule's (each naming its override); `target`: data.target."""
    problems = []
    if tc.lr_schedule == "plateau" and not 0 < tc.plateau_factor < 1:
        problems.append(f"trainer.plateau_factor={tc.plateau_factor} must be between 0 and 1 (excluded)")
    if tc.lr_schedule == "plateau" and tc.plateau_patience < 0:
        problems.append(f"trainer.plateau_patience={tc.plateau_patience} must be >= 0 (validations)")
    if tc.patience < 0:
        problems.append(f"trainer.patience={tc.patience} must be >= 0 (0: never stop early)")
    if not (tc.min_delta >= 0 and math.isfinite(tc.min_delta)):
        problems.append(f"trainer.min_delta={tc.min_delta} must be a number >= 0")
    if not str(tc.monitor).startswith("val_") or tc.monitor in NOT_A_QUALITY:
        problems.append(
            f"trainer.monitor={tc.monitor} is not a validation figure to improve: val_loss, val_unifrac, "
            "val_nucleotide, val_target, val_target_mae, val_target_rmse, val_target_r2, val_accuracy, "
            "val_macro_f1 or val_roc_auc"
        )
    elif str(tc.monitor).startswith(NEEDS_TARGET) and not target:
        problems.append(
            f"trainer.monitor={tc.monitor} is a figure of a target, and data.target is null: set "
            "data.target, or watch val_loss"
        )
    return problems


def watched(val: dict[str, Any], monitor: str) -> float | None:
    """`monitor`'s figure of a validation (None where it has no value: an R^2 of equal targets); a
    UserError where the validation has no such figure."""
    if monitor not in val:
        shown = ", ".join(k for k in val if k not in NOT_A_QUALITY)
        raise UserError(
            f"trainer.monitor={monitor} is not a figure of this run's validation (it has {shown}): "
            "set trainer.monitor to one of them"
        )
    return val[monitor]


def _portable(value: Any, to_tensor: bool) -> Any:
    """A validation's detail with its numpy arrays as tensors (a checkpoint is read with weights_only), or
    back."""
    if isinstance(value, dict):
        return {k: _portable(v, to_tensor) for k, v in value.items()}
    if to_tensor and isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if not to_tensor and torch.is_tensor(value):
        return value.numpy()
    return value


class Best:
    """The best validation so far by `trainer.monitor`, and whether the run should stop: every rank
    calls `update` after each validation (the figures are the same on every rank: all-reduced), and
    where `keep_best`, each rank takes part in gathering the best weights (FSDP2's shards), which the
    first rank keeps on its CPU."""

    def __init__(self, tc: DictConfig, model: nn.Module):
        self.model, self.monitor, self.patience = model, tc.monitor, tc.patience
        self.min_delta, self.keep = tc.min_delta, tc.keep_best
        self.higher = higher_is_better(self.monitor)
        self.step: int | None = None  # of the best validation
        self.value: float | None = None
        self.since = 0  # validations since the best that did not improve on it
        self.stopped_at: int | None = None
        self.used = False  # model.pt was written from the best weights (a completed run's, run.py)
        self.val: dict[str, Any] = {}  # with keep_best: the best validation's figures and detail
        self.detail: dict[str, Any] = {}
        self.weights: dict[str, torch.Tensor] | None = None  # ... and its weights (first rank, CPU)

    @property
    def on(self) -> bool:
        return self.patience > 0 or self.keep

    def improves(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):  # no figure (R^2 of equal targets): no improvement
            return False
        if self.value is None:
            return True
        return (value - self.value if self.higher else self.value - value) > self.min_delta

    def update(self, step: int, val: dict[str, Any], detail: dict[str, Any]) -> None:
        """After the validation of `step`: keep it where it is the best so far; `stopped_at` is `step`
        where the run stops now (`patience` validations in a row without improving)."""
        if not self.on:
            return
        value = watched(val, self.monitor)
        if self.improves(value):
            self.step, self.value, self.since = step, value, 0
            if self.keep:
                self.val, self.detail = dict(val), copy.deepcopy(detail)
                self.weights = full_weights(self.model)
        else:
            self.since += 1
        if self.patience and self.since >= self.patience:
            self.stopped_at = step
            log.info(
                "stopped early after step %d: %s did not improve on step %s's %s in %d validations "
                "(trainer.patience=%d)",
                step, self.monitor, self.step, self.value, self.since, self.patience,
            )  # fmt: skip

    def resumed_at(self, step: int) -> None:
        """A run resumed at `step` whose count already reaches its patience (the checkpoint of its stop, or
        a patience lowered since) has stopped there: it trains no further step."""
        if self.patience and self.since >= self.patience:
            self.stopped_at = step

    def record(self) -> dict[str, Any] | None:
        """summary.json's `best`: which validation was the best, and whether it ended the run."""
        if not self.on:
            return None
        return {
            "monitor": self.monitor,
            "mode": "max" if self.higher else "min",
            "step": self.step,
            "value": self.value,
            "stopped_early_at": self.stopped_at,
            "patience": self.patience,
            "kept": self.used,  # model.pt and `val` are this validation's
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "step": self.step,
            "value": self.value,
            "since": self.since,
            "val": self.val,
            "detail": _portable(self.detail, to_tensor=True),
            "weights": self.weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume goes on counting, unless it watches another figure now, or keeps the best where the
        checkpoint's run did not (its best's weights unknown): then the next validation is the first."""
        if state["monitor"] != self.monitor or (self.keep and state["step"] is not None and not state["val"]):
            return
        self.step, self.value, self.since = state["step"], state["value"], state["since"]
        if self.keep:  # else none of it is used: not held
            self.val, self.detail = state["val"], _portable(state["detail"], to_tensor=False)
            self.weights = state["weights"]
