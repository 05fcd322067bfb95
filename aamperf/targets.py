"""A metadata target as the model learns it: its kind (regression or classification), the transform of a
regression (`data.target_transform`, fitted on the training samples only) and the classes of a
classification (from the training samples, sorted). Saved with the model (`weights.save_model`'s
`target`, summary.json's `target`), so predictions can be put back in the target's own units."""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from aamperf.errors import UserError

TRANSFORMS = ("none", "zscore", "minmax", "log_zscore", "log1p_zscore", "log1p_minmax")
# the log transforms' prefix -> (g, its inverse): log y, or log(1 + y) (the original AAM's log-*)
LOGS = {"log_": (torch.log, torch.exp), "log1p_": (torch.log1p, torch.expm1)}
KINDS = ("auto", "regression", "classification")


@dataclass
class TargetSpec:
    """model units = (g(y) - shift) / scale, with g = log for log_* transforms, log(1 + y) for log1p_*
    (the original AAM's log-zscore and log-minmax), else the identity: every transform is affine in y or
    in g(y), so one inverse serves all. Classification: the target is the
    class index into `classes`."""

    column: str
    kind: str = "regression"  # regression | classification
    transform: str = "zscore"  # of a regression: one of TRANSFORMS
    shift: float = 0.0
    scale: float = 1.0
    classes: list[str] = field(default_factory=list)  # of a classification, sorted
    class_counts: list[int] = field(default_factory=list)  # training samples of each class

    @property
    def is_classification(self) -> bool:
        return self.kind == "classification"

    def forward(self, y: Tensor) -> Tensor:
        """Own units -> the units the model predicts (a regression's; class indices are left as they are)."""
        if self.is_classification:
            return y
        return (self.g(y) - self.shift) / self.scale

    @property
    def logs(self) -> tuple[Any, Any] | None:
        """(g, its inverse) of a log transform, else None."""
        return next((pair for prefix, pair in LOGS.items() if self.transform.startswith(prefix)), None)

    def g(self, y: Tensor) -> Tensor:
        """The target's values before the affine part: log y, log(1 + y) or y itself."""
        return y if self.logs is None else self.logs[0](y)

    def inverse(self, t: Tensor) -> Tensor:
        """The model's units -> the target's own units."""
        y = t * self.scale + self.shift
        return y if self.logs is None else self.logs[1](y)

    def payload(self) -> dict[str, Any]:
        """What is saved with the model and in summary.json's `target`. `mean` / `std`: the affine part
        (shift, scale) under the names readers of the zscore-only payload know; with log_zscore, of log y
        (log1p_*: of log(1 + y))."""
        out: dict[str, Any] = {"column": self.column, "type": self.kind}
        if self.is_classification:
            return {**out, "classes": self.classes, "train_class_counts": self.class_counts}
        return {**out, "transform": self.transform, "shift": self.shift, "scale": self.scale,
                "mean": self.shift, "std": self.scale}  # fmt: skip


def fit_regression(column: str, values: Tensor, train: Tensor, transform: str) -> TargetSpec:
    """The transform `transform` fitted on the training samples' values `values[train]`; a log transform
    refuses any value <= 0, a log1p one any value <= -1 (of every sample: each is transformed). A constant
    target is only centred."""
    if transform not in TRANSFORMS:
        raise UserError(f"data.target_transform={transform} is not one of {', '.join(TRANSFORMS)}")
    values = values.double()
    spec = TargetSpec(column, "regression", transform)  # its shift and scale fitted below
    if spec.logs is not None:
        low, bound = float(values.min()), (-1 if transform.startswith("log1p_") else 0)
        if low <= bound:
            other = ", log1p_zscore" if low > -1 else ""  # log(1 + y) takes 0 and values above -1
            raise UserError(
                f"data.target_transform={transform}: column {column!r} holds values <= {bound} (lowest "
                f"{low:g}), whose {'log' if bound == 0 else 'log of 1 + y'} is undefined; set "
                f"data.target_transform=zscore (or minmax, none{other})"
            )
        values = spec.g(values)
    fitted = values[train]
    shift, scale = 0.0, 1.0
    if transform.endswith("zscore"):
        shift, scale = float(fitted.mean()), float(fitted.std())  # unbiased: as the original zscore
    elif transform.endswith("minmax"):
        shift, scale = float(fitted.min()), float(fitted.max() - fitted.min())
    if not scale > 0 or not math.isfinite(scale):
        scale = 1.0
    spec.shift, spec.scale = shift, scale
    return spec


def fit_classes(column: str, codes: Tensor, names: list[str], train: Tensor, val: Tensor) -> tuple[
    TargetSpec, Tensor
]:  # fmt: skip
    """(the classes of the training samples, sorted; every sample's index among them). `codes`: each
    sample's index into `names` (the column's distinct values, sorted). Refused: a class with a single
    sample (it cannot be both trained and validated), a validation sample of a class no training sample
    has."""
    codes = codes.long()
    counts = torch.bincount(codes, minlength=len(names))
    single = [names[c] for c in (counts == 1).nonzero().flatten().tolist()]
    if single:
        raise UserError(
            f"data.target={column}: class {single[0]!r} has a single sample"
            + (f" (and {len(single) - 1} more classes)" if len(single) > 1 else "")
            + ", which cannot be both trained and validated; drop it from data.metadata or merge it "
            "into another"
        )
    seen = torch.unique(codes[train])
    unseen = sorted(set(torch.unique(codes[val]).tolist()) - set(seen.tolist()))
    if unseen:
        raise UserError(
            f"data.target={column}: validation samples of class {names[unseen[0]]!r}, which no training "
            "sample has; add samples of it, or change the split (data.seed / data.val_fraction, or the ids "
            "of data.val_samples)"
        )
    index = torch.full((len(names),), -1, dtype=torch.long)
    index[seen] = torch.arange(len(seen))
    spec = TargetSpec(column, "classification", transform="none", classes=[names[c] for c in seen.tolist()])
    spec.class_counts = torch.bincount(index[codes[train]], minlength=len(seen)).tolist()
    return spec, index[codes]


def learn_target(cfg: DictConfig, loss_fn: Any, target: TargetSpec | None, summary: dict[str, Any]) -> None:
    """Tell the loss the data's target (`target`: None without one) and make the model's target head
    fit it (`model.target_dim`: a logit per class, a value per quantile, or one); say it in summary.json's
    `target`. Without a target the model config is left as it is (pretraining)."""
    if target is None or not hasattr(loss_fn, "set_target"):
        return
    activation = cfg.model.get("target_activation", "none")
    if target.is_classification and activation != "none":
        raise UserError(
            f"model.target_activation={activation} bounds a regression's output; {target.column!r} is a "
            "classification (its logits): set model.target_activation=none"
        )
    loss_fn.set_target(target)
    if "target_dim" in cfg.model:  # before the model is built from it (and saved with the run)
        cfg.model.target_dim = loss_fn.target_outputs
    summary["target"] = target.payload()
    if target.is_classification:
        summary["target"]["class_weights"] = (
            None if loss_fn.class_weights is None else loss_fn.class_weights.tolist()
        )
    else:
        summary["target"]["loss"] = loss_fn.target_loss
        if loss_fn.target_loss == "quantile":
            summary["target"]["quantiles"] = loss_fn.quantiles
