"""The target a model file says its model predicts (its `target` payload: `TargetSpec.payload()` plus the
loss and its quantiles, or the zscore-only `column` / `mean` / `std` of older files), read as data and
checked; and what predict writes of it: the predicted target in its own units (a regression's point and
quantiles, a classification's class and probabilities), beside the observed one, with its figures."""

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from aamperf.data.categorical import metadata_header, read_values
from aamperf.data.metadata import metadata_column
from aamperf.errors import UserError
from aamperf.metrics.target import classification_metrics, interval_coverage, regression_metrics
from aamperf.model.loss_arguments import TARGET_LOSSES, is_number
from aamperf.targets import TRANSFORMS, TargetSpec, group_keys

log = logging.getLogger(__name__)


@dataclass
class SavedTarget:
    """A model file's target: what its model's target output means (`spec`), and with a quantile loss
    which quantile each output column is."""

    spec: TargetSpec
    loss: str | None = None  # a regression's: one of TARGET_LOSSES (None: a file that does not say)
    quantiles: list[float] = field(default_factory=list)  # loss=quantile: one per output column

    @property
    def outputs(self) -> int:
        """The columns of the model's target output: a logit per class, a value per quantile, or one."""
        if self.spec.is_classification:
            return len(self.spec.classes)
        return len(self.quantiles) if self.loss == "quantile" else 1

    def describe(self) -> dict[str, Any]:
        """summary.json's `target`: the payload as training writes it (`mean` / `std` included for a
        regression, the names readers of the older payload know) and the loss."""
        out = self.spec.payload()
        if self.spec.is_classification and not self.spec.class_counts:
            del out["train_class_counts"]  # a file that did not say
        if not self.spec.is_classification:
            out["loss"] = self.loss
            if self.loss == "quantile":
                out["quantiles"] = self.quantiles
        return out


def read_saved_target(payload: dict[str, Any], path: Path) -> SavedTarget | None:
    """The target of a model file's payload (None: the run learned none, a pretraining); a malformed one
    (wrong types, an unknown kind, transform or loss, classes that are not strings, outputs that do not
    match the model's target head) is refused in one line: a model file is data."""
    saved = payload.get("target")
    if saved is None:
        return None
    bad = f"{path}: its target"
    if not isinstance(saved, dict) or not isinstance(saved.get("column"), str):
        raise UserError(f"{bad} is not a mapping with a column name ({str(saved)[:80]}); train the run again")
    kind = saved.get("type", "regression")  # files before classification: a regression
    if kind == "classification":
        classes = saved_classes(saved, bad)
        counts = saved.get("train_class_counts")  # shown again in the summary where it is whole
        counts = counts if isinstance(counts, list) and len(counts) == len(classes) else []
        counts = counts if all(isinstance(c, int) for c in counts) else []
        target = SavedTarget(TargetSpec(saved["column"], kind, "none", classes=classes, class_counts=counts))
    elif kind == "regression":
        target = saved_regression(saved, bad)
    else:
        raise UserError(
            f"{bad} has type {str(kind)[:40]!r}, not regression or classification; train the run again"
        )
    head = (payload.get("config") or {}).get("model", {}).get("target_dim")
    if is_number(head) and head != target.outputs:
        raise UserError(
            f"{bad} needs {target.outputs} outputs but its model.target_dim is {head}; train the run again"
        )
    return target


def saved_classes(saved: dict[str, Any], bad: str) -> list[str]:
    """A classification's class names: a non-empty list of distinct strings."""
    classes = saved.get("classes")
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise UserError(f"{bad}'s classes ({str(classes)[:80]}) are not a list of names; train the run again")
    if len(set(classes)) != len(classes):
        raise UserError(f"{bad}'s classes ({str(classes)[:80]}) name a class twice; train the run again")
    return classes


def saved_regression(saved: dict[str, Any], bad: str) -> SavedTarget:
    """A regression's transform, shift and scale (`mean` / `std` where the file predates `shift` /
    `scale`: a zscore), loss and quantiles."""
    transform = saved.get("transform", "zscore")
    if transform not in TRANSFORMS:
        raise UserError(
            f"{bad} has transform {str(transform)[:40]!r}, not one of {', '.join(TRANSFORMS)}; "
            "train the run again"
        )
    shift, scale = saved.get("shift", saved.get("mean", 0.0)), saved.get("scale", saved.get("std", 1.0))
    for name, value in (("shift", shift), ("scale", scale)):
        if not (is_number(value) and math.isfinite(value)):
            raise UserError(f"{bad}'s {name} ({str(value)[:40]}) is not a finite number; train the run again")
    if scale <= 0:
        raise UserError(f"{bad}'s scale {scale} is not > 0; train the run again")
    loss = saved.get("loss")
    if loss is not None and loss not in TARGET_LOSSES:
        raise UserError(
            f"{bad} has loss {str(loss)[:40]!r}, not one of {', '.join(TARGET_LOSSES)}; train the run again"
        )
    quantiles = saved.get("quantiles") if loss == "quantile" else []
    numbers = isinstance(quantiles, list) and all(is_number(q) and 0 < q < 1 for q in quantiles)
    if not numbers or (loss == "quantile" and not quantiles):
        raise UserError(
            f"{bad}'s quantiles ({str(quantiles)[:80]}) are not numbers between 0 and 1; train the run again"
        )
    spec = TargetSpec(saved["column"], "regression", transform, float(shift), float(scale))
    if transform == "zscore_category":
        spec.normalize_by, spec.groups = saved_groups(saved, bad)
    return SavedTarget(spec, loss, [float(q) for q in quantiles])


def saved_groups(saved: dict[str, Any], bad: str) -> tuple[list[str], dict[str, list[float]]]:
    """zscore_category's columns (names) and its categories' [shift, scale] (finite, scale > 0)."""
    columns, groups = saved.get("normalize_by"), saved.get("groups")
    if not (isinstance(columns, list) and columns and all(isinstance(c, str) for c in columns)):
        raise UserError(
            f"{bad}'s normalize_by ({str(columns)[:80]}) is not a list of column names; train the run again"
        )
    units = isinstance(groups, dict) and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2
        and all(is_number(x) and math.isfinite(x) for x in v) and v[1] > 0
        for k, v in groups.items()
    )  # fmt: skip
    if not units:
        raise UserError(
            f"{bad}'s groups ({str(groups)[:80]}) are not category -> [shift, scale > 0]; train the run again"
        )
    return columns, {k: [float(x) for x in v] for k, v in groups.items()}


def sample_units(
    target: SavedTarget | None, metadata: Path | None, ids: list[str], run: str, warn: bool = True
) -> tuple[
    torch.Tensor | None, dict[str, Any] | None
]:  # fmt: skip
    """zscore_category: ([n, 2] each sample's shift and scale, by its category of the run's
    data.normalize_by columns in `metadata`; what summary.json says of them). A sample of a category
    training never saw, or without a value (or without metadata), takes every training sample's and is
    counted, with a warning. (None, None) for any other target."""
    if target is None or not target.spec.groups:
        return None, None
    columns = target.spec.normalize_by
    if metadata is None:
        keys: list[str | None] = [None] * len(ids)
    else:
        header = metadata_header(Path(metadata))
        absent = [c for c in columns if c not in header]
        if absent:
            raise UserError(
                f"run={run} z-scores its target within the categories of data.normalize_by={columns}: "
                f"data.metadata={metadata} has no column {', '.join(map(repr, absent))} (columns: "
                f"{', '.join(header) or 'none'}); give a metadata file with them"
            )
        keys = group_keys(read_values(Path(metadata), columns, ids))
    unseen = sum(k is not None and k not in target.spec.groups for k in keys)
    missing = sum(k is None for k in keys)
    if warn and (unseen or missing):
        log.warning(
            "%d of %d samples have a category of %s that training never saw and %d none: their "
            "predictions use every training sample's mean and std, not their category's",
            unseen, len(ids), ",".join(columns), missing,
        )  # fmt: skip
    record = {"normalize_by": columns, "unseen": unseen, "missing": missing}
    return target.spec.units_of(keys), record


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """[n, classes] each sample's class probabilities: the softmax of its logits."""
    return logits.double().softmax(dim=1)


def point_column(target: SavedTarget) -> int:
    """The output column of a regression's point prediction: the middle quantile (0.5 where it is among
    them) of a quantile loss, as training's validation takes it (AAMLoss.point); else the one output."""
    if target.loss != "quantile":
        return 0
    return target.quantiles.index(0.5) if 0.5 in target.quantiles else len(target.quantiles) // 2


def in_own_units(
    target: SavedTarget, outputs: torch.Tensor, units: torch.Tensor | None = None
) -> torch.Tensor:
    """[n, outputs] a regression's outputs in the target's own units (its transform inverted; `units`: each
    row's zscore_category shift and scale, `sample_units`)."""
    return target.spec.inverse(outputs.double().reshape(len(outputs), -1), units)


def target_table(
    ids: list[str],
    outputs: torch.Tensor,
    target: SavedTarget,
    observed: pd.Series | None,
    passes: int = 1,
    units: torch.Tensor | None = None,
) -> pd.DataFrame:
    """One row per sample: a regression's `predicted` value (and `predicted_q<q>` per quantile) in the
    target's own units; a classification's `predicted` class and `p_<class>` per class; the `observed`
    value or class where the metadata has the column (NaN for a sample without one). `passes` > 1: the
    outputs of each pass's draw of ASVs, [n, passes, ...]: the mean of the passes' values (a class's
    probabilities), and a regression's `predicted_std`, their standard deviation (the original AAM's
    --output-variance: numpy's, over the passes). `units`: each sample's (zscore_category, `sample_units`)."""
    index = pd.Index(ids, name="sample_id")
    each = outputs.reshape(len(ids) * passes, -1)  # a row per sample and pass
    if target.spec.is_classification:
        chances = probabilities(each).reshape(len(ids), passes, -1).mean(dim=1).numpy()
        classes = target.spec.classes
        table = pd.DataFrame({"predicted": [classes[k] for k in chances.argmax(axis=1)]}, index=index)
        for k, name in enumerate(classes):
            table[f"p_{name}"] = chances[:, k]
    else:
        each_units = None if units is None else units.repeat_interleave(passes, dim=0)  # a row per pass
        own = in_own_units(target, each, each_units).reshape(len(ids), passes, -1)
        point = point_column(target)
        table = pd.DataFrame({"predicted": own[:, :, point].mean(dim=1).numpy()}, index=index)
        for k, q in enumerate(target.quantiles):
            table[f"predicted_q{q:g}"] = own[:, :, k].mean(dim=1).numpy()
        if passes > 1:
            table["predicted_std"] = own[:, :, point].std(dim=1, correction=0).numpy()
    if observed is not None:
        table.insert(1, "observed", observed.to_numpy())
    return table


def observed_values(metadata: Path | None, column: str | None, ids: list[str], target: SavedTarget) -> (
    pd.Series | None
):  # fmt: skip
    """Each sample's observed value of the target's column as the metadata writes it (a class name, or a
    number for a regression), NaN where it has none; None without metadata or the column."""
    if metadata is None or column is None:
        return None
    written = metadata_column(Path(metadata), column).reindex(ids)
    if target.spec.is_classification:
        return written.str.strip()
    return pd.to_numeric(written, errors="coerce")


def target_figures(table: pd.DataFrame, target: SavedTarget) -> dict[str, Any]:
    """aamperf/metrics/target.py's figures of the samples with an observed value: a regression's MAE,
    RMSE, R^2 in its own units (and the outermost quantiles' interval coverage); a classification's
    accuracy, macro-F1, ROC AUC and confusion matrix, of the samples of a class the model knows (the
    others counted apart). {} without observed values."""
    if "observed" not in table or table["observed"].notna().sum() == 0:
        return {}
    known = table.dropna(subset=["observed"])
    if not target.spec.is_classification:
        figures: dict[str, Any] = {"observed": len(known)}
        figures.update(regression_metrics(known["observed"], known["predicted"]))
        if target.loss == "quantile" and len(target.quantiles) > 1:
            low, high = min(target.quantiles), max(target.quantiles)
            bounds = (known[f"predicted_q{q:g}"] for q in (low, high))
            figures.update(interval_coverage=interval_coverage(known["observed"], *bounds))
            figures.update(interval_nominal=high - low)
        return figures
    classes = target.spec.classes
    labelled = known[known["observed"].isin(classes)]
    figures = {"observed": len(labelled), "observed_unknown_class": len(known) - len(labelled)}
    if len(labelled):
        labels = np.array([classes.index(name) for name in labelled["observed"]])
        chances = labelled[[f"p_{name}" for name in classes]].to_numpy()
        figures.update(classification_metrics(labels, chances))
    return figures


def summary_line(summary: dict[str, Any]) -> str | None:
    """predict's printout of the target: what it is, and its figures where observed values exist."""
    target, figures = summary.get("target"), summary.get("target_metrics") or {}
    if not target:
        return None
    if target.get("type") == "classification":
        what = f"classification over {len(target['classes'])} classes ({', '.join(target['classes'][:6])}"
        what += ", ...)" if len(target["classes"]) > 6 else ")"
        shown = {"accuracy": "accuracy", "macro_f1": "macro-F1", "roc_auc": "ROC AUC"}
    else:
        what = f"regression, {target.get('transform', 'zscore')} transform"
        what += f", quantiles {target['quantiles']}" if target.get("loss") == "quantile" else ""
        shown = {"mae": "MAE", "rmse": "RMSE", "r2": "R^2", "interval_coverage": "interval coverage"}
    line = f"  target {target['column']}: {what}"
    values = [f"{label} {figures[key]:.4g}" for key, label in shown.items() if figures.get(key) is not None]
    if values:
        line += f" | {', '.join(values)} over {figures['observed']} observed samples"
    if figures.get("observed_unknown_class"):
        line += f" ({figures['observed_unknown_class']} more of classes the model does not know)"
    return line
