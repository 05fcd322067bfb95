"""Validation metrics of a target, in numpy, all of one set of samples: a regression's errors in the
target's own units, a quantile regression's interval coverage, a classification's accuracy, macro-F1,
ROC AUC and confusion matrix. Each is scikit-learn's definition (tests/metrics/test_target_metrics.py
checks them against sklearn.metrics, which is only a dev dependency)."""

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from aamperf.files import write_atomic


def regression_metrics(observed: np.ndarray, predicted: np.ndarray) -> dict[str, float | None]:
    """MAE, RMSE and R^2 (1 - residual sum of squares / total sum of squares about the mean; None where
    the observed values are all equal) of point predictions, in the target's own units."""
    observed, predicted = np.asarray(observed, np.float64), np.asarray(predicted, np.float64)
    error = predicted - observed
    total = float(np.square(observed - observed.mean()).sum())
    return {
        "mae": float(np.abs(error).mean()),
        "rmse": float(np.sqrt(np.square(error).mean())),
        "r2": 1.0 - float(np.square(error).sum()) / total if total > 0 else None,
    }


def interval_coverage(observed: np.ndarray, low: np.ndarray, high: np.ndarray) -> float:
    """The share of samples whose observed value lies within [low, high]: a calibrated 0.1-0.9 interval
    covers 0.8 of them."""
    observed = np.asarray(observed, np.float64)
    return float(((observed >= low) & (observed <= high)).mean())


def classification_metrics(labels: np.ndarray, probabilities: np.ndarray) -> dict:
    """Accuracy, macro-F1 (the mean F1 over the classes among the labels and predictions, scikit-learn's
    `average="macro"`), ROC AUC (binary: of the second class's probability; more classes: the mean
    one-vs-rest AUC over the classes that have both positive and negative samples; None where none has)
    and the confusion matrix [observed, predicted] over every class. `probabilities` [n, classes]."""
    labels = np.asarray(labels, np.int64)
    probabilities = np.asarray(probabilities, np.float64)
    n_classes = probabilities.shape[1]
    predicted = probabilities.argmax(axis=1)
    confusion = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(confusion, (labels, predicted), 1)
    return {
        "accuracy": float((predicted == labels).mean()),
        "macro_f1": macro_f1(confusion),
        "roc_auc": roc_auc(labels, probabilities),
        "confusion_matrix": confusion.tolist(),
    }


def macro_f1(confusion: np.ndarray) -> float:
    """The unweighted mean of each class's F1 = 2 TP / (2 TP + FP + FN), over the classes that are
    observed or predicted at least once (a class neither is has no F1)."""
    tp = np.diag(confusion).astype(np.float64)
    observed, predicted = confusion.sum(axis=1), confusion.sum(axis=0)
    present = (observed + predicted) > 0
    f1 = 2 * tp[present] / (observed[present] + predicted[present])
    return float(f1.mean())


def roc_auc(labels: np.ndarray, probabilities: np.ndarray) -> float | None:
    """Binary: the AUC of the positive (second) class's probability; more classes: the mean of each
    class's one-vs-rest AUC, over the classes that occur and do not make up every sample."""
    if probabilities.shape[1] == 2:
        return binary_auc(labels == 1, probabilities[:, 1])
    aucs = [binary_auc(labels == k, probabilities[:, k]) for k in range(probabilities.shape[1])]
    aucs = [a for a in aucs if a is not None]
    return float(np.mean(aucs)) if aucs else None


def binary_auc(positive: np.ndarray, score: np.ndarray) -> float | None:
    """The probability that a random positive scores above a random negative (ties count half): the
    Mann-Whitney U over the product of the two counts. None without both positives and negatives."""
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    # imported here: scipy.stats adds ~0.6 s to a run's start, paid only by classification runs
    from scipy.stats import rankdata

    ranks = rankdata(score)  # ties: their mean rank
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def validation_figures(
    loss_fn, observed: np.ndarray, predicted: np.ndarray, idx: torch.Tensor | None = None
) -> tuple[dict, dict]:
    """(the figures of a validation's target, for metrics.jsonl and summary.json's `val`; what they were
    computed from, for summary.json and val_predictions.tsv) of these samples: `observed` [n] in the
    target's own units (a classification's: class indices), `predicted` the model's target output, [n,
    outputs] or over validation passes [n, passes, outputs] (the mean of the passes' values, as predict's
    `passes`: a class's probabilities, a value in the target's own units), `idx` [n] their indices in the
    data (zscore_category's units are each sample's). `loss_fn`: the AAMLoss that knows the target (its
    transform or classes) and its loss."""
    target = loss_fn.target
    n, passes = len(predicted), predicted.shape[1] if predicted.ndim == 3 else 1
    each = predicted.reshape(n * passes, -1)  # a row per sample and pass
    if target.is_classification:
        shifted = each - each.max(axis=1, keepdims=True)  # softmax, stable
        chances = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        probabilities = chances.reshape(n, passes, -1).mean(axis=1)
        found = classification_metrics(observed.astype(np.int64), probabilities)
        figures = {f"val_{k}": found[k] for k in ("accuracy", "macro_f1", "roc_auc")}
        detail = {"classes": target.classes, "confusion_matrix": found["confusion_matrix"]}
        return figures, {**detail, "observed": observed, "probabilities": probabilities}
    units = None if idx is None or target.sample_units is None else target.sample_units[idx.cpu()]
    each_units = None if units is None else units.repeat_interleave(passes, dim=0)
    outputs = torch.from_numpy(each)
    # every output in the target's own units, then each sample's mean over the passes
    own = target.inverse(outputs, each_units).reshape(n, passes, -1).mean(dim=1).numpy()
    point = target.inverse(loss_fn.point(outputs), each_units).reshape(n, passes).mean(dim=1).numpy()
    figures = {f"val_target_{k}": v for k, v in regression_metrics(observed, point).items()}
    if units is not None:  # zscore_category: what each sample's category's training mean alone scores
        means = units[:, 0].double().numpy()
        figures.update(
            {f"val_target_category_mean_{k}": v for k, v in regression_metrics(observed, means).items()}
        )
    detail: dict = {"observed": observed, "predicted": point}
    if loss_fn.target_loss == "quantile":  # the outermost quantiles' interval (a log transform keeps order)
        low, high = int(np.argmin(loss_fn.quantiles)), int(np.argmax(loss_fn.quantiles))
        figures["val_target_interval_coverage"] = interval_coverage(observed, own[:, low], own[:, high])
        figures["val_target_interval_nominal"] = loss_fn.quantiles[high] - loss_fn.quantiles[low]
        detail["quantiles"] = {q: own[:, k] for k, q in enumerate(loss_fn.quantiles)}
    return figures, detail


def predictions_table(detail: dict, sample_ids: list[str]) -> pd.DataFrame:
    """The last validation's samples as `detail` (`validate`'s) holds them, one row per sample, in the
    target's own units: observed and predicted value (and each quantile's), or observed and predicted
    class with each class's probability."""
    ids = [sample_ids[i] for i in detail["sample_idx"]]
    if "classes" in detail:
        classes, probabilities = detail["classes"], detail["probabilities"]
        table = {
            "observed": [classes[int(k)] for k in detail["observed"]],
            "predicted": [classes[int(k)] for k in probabilities.argmax(axis=1)],
            **{f"p_{name}": probabilities[:, k] for k, name in enumerate(classes)},
        }
    else:
        table = {"observed": detail["observed"], "predicted": detail["predicted"]}
        table.update({f"q{q:g}": values for q, values in detail.get("quantiles", {}).items()})
    return pd.DataFrame(table, index=pd.Index(ids, name="sample_id"))


def write_val_predictions(run_dir: Path, detail: dict, sample_ids: list[str]) -> str | None:
    """val_predictions.tsv in `run_dir`: the samples the last validation's target figures are of (None
    without a target)."""
    if not detail:
        return None
    text = predictions_table(detail, sample_ids).to_csv(sep="\t", float_format="%.9g")
    write_atomic(run_dir / "val_predictions.tsv", text)
    return "val_predictions.tsv"
