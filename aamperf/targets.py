"""A metadata target as the model learns it: its kind (regression or classification), the transform of a
regression (`data.target_transform`, fitted on the training samples only) and the classes of a
classification (from the training samples, sorted). Saved with the model (`weights.save_model`'s
`target`, summary.json's `target`), so predictions can be put back in the target's own units.
`zscore_category` (the original AAM's zscore-category) z-scores each sample within its category of the
metadata columns `data.normalize_by` (`fit_groups`): a shift and scale per category, kept per sample of the
data at hand (`sample_units`) for the loss and validation, and looked up by category at predict."""

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from aamperf.errors import UserError

TRANSFORMS = ("none", "zscore", "minmax", "log_zscore", "log1p_zscore", "log1p_minmax", "zscore_category")
# the log transforms' prefix -> (g, its inverse): log y, or log(1 + y) (the original AAM's log-*)
LOGS = {"log_": (torch.log, torch.exp), "log1p_": (torch.log1p, torch.expm1)}
KINDS = ("auto", "regression", "classification")


@dataclass
class TargetSpec:
    """model units = (g(y) - shift) / scale, with g = log for log_* transforms, log(1 + y) for log1p_*
    (the original AAM's log-zscore and log-minmax), else the identity: every transform is affine in y or
    in g(y), so one inverse serves all. zscore_category: the affine part is the sample's category's
    (`groups`), given as `units` [n, 2] (each row's shift and scale: `units_of`, `sample_units`); `shift` and
    `scale` are then every training sample's, for a category training never saw and a missing value.
    Classification: the target is the class index into `classes`."""

    column: str
    kind: str = "regression"  # regression | classification
    transform: str = "zscore"  # of a regression: one of TRANSFORMS
    shift: float = 0.0
    scale: float = 1.0
    classes: list[str] = field(default_factory=list)  # of a classification, sorted
    class_counts: list[int] = field(default_factory=list)  # training samples of each class
    normalize_by: list[str] = field(default_factory=list)  # zscore_category's metadata columns
    # zscore_category: "column=value,column=value" -> [shift, scale] of the training samples of that category
    groups: dict[str, list[float]] = field(default_factory=dict)
    # zscore_category: [n, 2] float64, each sample of the data at hand's (shift, scale), indexed by the
    # batches' sample_idx (AAMLoss keeps a copy on the device); not saved
    sample_units: Tensor | None = field(default=None, repr=False, compare=False)
    # data.weight_by: the metadata columns whose categories weigh the target part (loss.category_weights);
    # each sample of the data at hand's category of them (None: a missing value), and the training
    # samples of each category (`fit_weight_keys`); not saved with the model
    weight_by: list[str] = field(default_factory=list)
    weight_keys: list[str | None] = field(default_factory=list, repr=False, compare=False)
    weight_counts: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    weight_names: dict[str, str] = field(default_factory=dict, repr=False, compare=False)  # "v1/v2" -> key

    @property
    def is_classification(self) -> bool:
        return self.kind == "classification"

    def forward(self, y: Tensor, units: Tensor | None = None) -> Tensor:
        """Own units -> the units the model predicts (a regression's; class indices are left as they are).
        `units`: [n, 2] the shift and scale of each of y's n rows (zscore_category's), else the target's."""
        if self.is_classification:
            return y
        shift, scale = self.affine(y, units)
        return (self.g(y) - shift) / scale

    def affine(self, like: Tensor, units: Tensor | None) -> tuple[Any, Any]:
        """(shift, scale): the target's, or with `units` [n, 2] each row's, shaped to `like` [n, ...]."""
        if units is None:
            return self.shift, self.scale
        shape = (len(units),) + (1,) * (like.dim() - 1)
        units = units.to(like.dtype)
        return units[:, 0].reshape(shape), units[:, 1].reshape(shape)

    def units_of(self, keys: list[str | None]) -> Tensor | None:
        """[n, 2] float64 the shift and scale of samples of these categories (`group_keys`'): their
        category's, or for a category training never saw and a missing one (None) the target's. None
        unless the transform is zscore_category."""
        if not self.groups:
            return None
        default = [self.shift, self.scale]
        return torch.tensor([self.groups.get(k, default) if k is not None else default for k in keys],
                            dtype=torch.float64)  # fmt: skip

    @property
    def logs(self) -> tuple[Any, Any] | None:
        """(g, its inverse) of a log transform, else None."""
        return next((pair for prefix, pair in LOGS.items() if self.transform.startswith(prefix)), None)

    def g(self, y: Tensor) -> Tensor:
        """The target's values before the affine part: log y, log(1 + y) or y itself."""
        return y if self.logs is None else self.logs[0](y)

    def inverse(self, t: Tensor, units: Tensor | None = None) -> Tensor:
        """The model's units -> the target's own units (`units`: as `forward`'s)."""
        shift, scale = self.affine(t, units)
        y = t * scale + shift
        return y if self.logs is None else self.logs[1](y)

    def payload(self) -> dict[str, Any]:
        """What is saved with the model and in summary.json's `target`. `mean` / `std`: the affine part
        (shift, scale) under the names readers of the zscore-only payload know; with log_zscore, of log y
        (log1p_*: of log(1 + y))."""
        out: dict[str, Any] = {"column": self.column, "type": self.kind}
        if self.is_classification:
            return {**out, "classes": self.classes, "train_class_counts": self.class_counts}
        out.update(
            transform=self.transform, shift=self.shift, scale=self.scale, mean=self.shift, std=self.scale
        )
        if self.groups:
            out.update(normalize_by=self.normalize_by, groups=self.groups)
        return out


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
    if transform.endswith("zscore") or transform == "zscore_category":  # the latter's global part
        shift, scale = float(fitted.mean()), float(fitted.std())  # unbiased: as the original zscore
    elif transform.endswith("minmax"):
        shift, scale = float(fitted.min()), float(fitted.max() - fitted.min())
    if not scale > 0 or not math.isfinite(scale):
        scale = 1.0
    spec.shift, spec.scale = shift, scale
    return spec


def group_keys(values: dict[str, list[str | None]]) -> list[str | None]:
    """Each sample's category of the columns of `values` (aamperf/data/categorical.py's `read_values`) as
    one key, "column=value,column=value" in the columns' order (the original AAM's); None where a value
    is missing."""
    rows = zip(*values.values(), strict=True)
    columns = list(values)
    return [
        None if None in row else ",".join(f"{c}={v}" for c, v in zip(columns, row, strict=True))
        for row in rows
    ]


def fit_groups(
    spec: TargetSpec, columns: list[str], values: Tensor, keys: list[str | None], train: Tensor
) -> None:
    """zscore_category: each category's mean and standard deviation (unbiased) over its training samples
    into `spec.groups`, and every sample's units into `spec.sample_units` (a category no training sample
    has and a missing one: the target's, `fit_regression`'s). A category of one training sample, or of one
    value, is centred and takes the target's scale."""
    values = values.double()
    spec.normalize_by, spec.groups = list(columns), {}
    by_key: dict[str, list[int]] = {}
    for i in train.tolist():
        if keys[i] is not None:
            by_key.setdefault(keys[i], []).append(i)
    if not by_key:
        raise UserError(
            f"data.normalize_by={list(columns)}: no training sample has a value of "
            f"{'these columns' if len(columns) > 1 else 'it'}, so no category to z-score within; name "
            "columns data.metadata fills, or set data.target_transform=zscore"
        )
    for key in sorted(by_key):
        fitted = values[by_key[key]]
        scale = float(fitted.std()) if len(fitted) > 1 else 0.0
        spec.groups[key] = [float(fitted.mean()), scale if scale > 0 and math.isfinite(scale) else spec.scale]
    spec.sample_units = spec.units_of(keys)


def fit_weight_keys(
    spec: TargetSpec, columns: list[str], values: dict[str, list[str | None]], train: Tensor
) -> None:
    """data.weight_by: each sample's category of `columns` (`group_keys` of their `values`) and the training
    samples of each category into `spec`, for the loss's category weights (`category_weights`), which may
    name a category by its values alone, joined by "/" (`weight_names`: a Hydra override's key holds no =)."""
    keys = group_keys(values)
    spec.weight_by, spec.weight_keys = list(columns), keys
    counts = Counter(keys[i] for i in train.tolist() if keys[i] is not None)
    spec.weight_counts = dict(sorted(counts.items()))
    rows = zip(*values.values(), strict=True)
    spec.weight_names = {"/".join(row): key for row, key in zip(rows, keys, strict=True) if key is not None}


def category_weights(option: str | dict[str, float], target: TargetSpec) -> dict[str, float]:
    """loss.category_weights: each category's weight of the target part, by its key ("column=value",
    several columns joined by ","). `balanced`: n / (categories x count) over the training samples (the
    original AAM's --categorical-loss-weights auto: a rare site weighs as much as a common one, the mean
    weight of a training sample 1); a mapping: its weights, each key a category training has, as its key
    or its values joined by "/" (`{env0: 2.0}`, `{A/dry: 2.0}`)."""
    counts = target.weight_counts
    if option == "balanced":
        n = sum(counts.values())
        return {key: n / (len(counts) * count) for key, count in counts.items()}
    keys = {name: target.weight_names.get(name, name) for name in option}
    unknown = [name for name, key in keys.items() if key not in counts]
    if unknown:
        names = ", ".join(sorted(name for name, key in target.weight_names.items() if key in counts))
        raise UserError(
            f"loss.category_weights names {unknown[0]!r}, not a category of data.weight_by="
            f"{target.weight_by} among the training samples ({names or 'none'}); name those, or "
            "loss.category_weights=balanced"
        )
    return {keys[name]: float(weight) for name, weight in option.items()}


def sample_weights(weights: dict[str, float], target: TargetSpec) -> Tensor:
    """[n] float64 each sample's weight of the target part: its category's; 1 for a category without a
    weight (unnamed, or only validation has it) and for a missing value (the original AAM's default)."""
    return torch.tensor([weights.get(k, 1.0) if k is not None else 1.0 for k in target.weight_keys],
                        dtype=torch.float64)  # fmt: skip


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
    if getattr(loss_fn, "category_weights", None) is not None:  # data.weight_by's, loss.category_weights'
        summary["target"].update(weight_by=target.weight_by, category_weights=loss_fn.category_weights)
    if target.is_classification:
        summary["target"]["class_weights"] = (
            None if loss_fn.class_weights is None else loss_fn.class_weights.tolist()
        )
    else:
        summary["target"]["loss"] = loss_fn.target_loss
        if loss_fn.target_loss == "quantile":
            summary["target"]["quantiles"] = loss_fn.quantiles
