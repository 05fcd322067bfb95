"""A random forest beside a fine-tuned model, as the original AAM's `aam rf-baseline` gives one: is the
model better than a forest on the same samples' ASV counts?

Matched to the original (aam/cli/rf_baseline.py): scikit-learn's forest of 500 trees, sqrt(features)
tried at each split, all cores, on each sample's count of every ASV of the table (not only the
`data.max_asvs` the model reads), ASVs no training sample has left out, the target in its own units.
Unlike it: the counts are the rarefied ones the model trains on (the original reads the table as
given), the forest's seed is the run's `seed` (its default was 42), and a categorical target gets the
same forest as a classifier (the original is a regressor only). It is fitted on the run's training samples
and scored on exactly the samples of the model's last validation, with the same functions
(aamperf/metrics/target.py), so its figures sit beside the model's `val` figures under the same names."""

import logging
import time
from typing import Any

import numpy as np
import scipy.sparse as sp
from omegaconf import DictConfig

from aamperf.cgroups import core_budget
from aamperf.data.dataset import Data
from aamperf.data.samples import SampleDataset
from aamperf.metrics.target import classification_metrics, regression_metrics
from aamperf.targets import TargetSpec

log = logging.getLogger(__name__)

N_TREES = 500  # aam rf-baseline --n-estimators
MAX_FEATURES = "sqrt"  # --max-features: how many features each split chooses among
FEATURES = "rarefied ASV counts"  # what a sample's feature vector holds: its reads of each ASV
# Features up to this size are handed to the forest as a dense array (its training rows copied once more):
# its trees split them 1.5x (256 simulated samples) to 3.6x (2,000) faster than the sparse matrix, on 2
# cores; larger ones stay sparse.
DENSE_MAX_BYTES = 512 * 2**20


def count_matrix(dataset: SampleDataset, n_observations: int) -> sp.csr_matrix:
    """[samples, observations of the table] float32: each sample's rarefied reads of every ASV it has
    (sparse: a table of thousands of samples and ASVs is mostly zeros)."""
    rows, reads = dataset.rows, dataset.reads
    return sp.csr_matrix(
        (reads.all().astype(np.float32), rows.all(), rows.ptr), shape=(len(dataset), n_observations)
    )


def training_features(counts: sp.csr_matrix, train_idx: list[int]) -> sp.csr_matrix:
    """`counts` without the ASVs that no training sample has (as the original drops its zero-sum
    columns): the forest never splits on them, and they would change which features its seed draws."""
    present = np.flatnonzero(counts[train_idx].getnnz(axis=0))
    return counts[:, present]


def forest_settings(seed: int) -> dict[str, Any]:
    """The forest's keyword arguments: the original's, seeded by the run's `seed`, on the cores this
    process may use (the original's n_jobs=-1; the trees do not depend on it)."""
    cores = core_budget()
    return {"n_estimators": N_TREES, "max_features": MAX_FEATURES, "random_state": seed, "n_jobs": cores}


def fit_rf_baseline(
    dataset: SampleDataset,
    n_observations: int,
    target: TargetSpec,
    train_idx: list[int],
    val_idx: list[int],
    seed: int,
) -> dict[str, Any]:
    """The forest fitted on the samples `train_idx` of `dataset` and its figures on `val_idx` (the model's
    last validation's samples): summary.json's `rf_baseline`. `dataset.target`: a regression's values in
    their own units, or a classification's class indices among `target.classes`."""
    # Imported here: only a run with a target pays scikit-learn's import (1.0 s on a 2-core EPYC)
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

    features = training_features(count_matrix(dataset, n_observations), train_idx)
    dense = features.shape[0] * features.shape[1] * features.dtype.itemsize <= DENSE_MAX_BYTES
    if dense:
        features = features.toarray()
    settings = forest_settings(seed)
    log.info(
        "random forest beside the model: %d trees on %d training samples x %d ASVs "
        "(metrics.rf_baseline=false skips it)",
        N_TREES,
        len(train_idx),
        features.shape[1],
    )
    forest_class = RandomForestClassifier if target.is_classification else RandomForestRegressor
    forest = forest_class(**settings)
    observed = dataset.target.numpy().astype(np.int64 if target.is_classification else np.float64)
    start = time.perf_counter()
    forest.fit(features[train_idx], observed[train_idx])
    fit_s = time.perf_counter() - start
    val_features, val_observed = features[val_idx], observed[val_idx]
    if target.is_classification:
        # every class has training samples (aamperf/targets.py fit_classes): columns are class indices
        assert forest.classes_.tolist() == list(range(len(target.classes)))
        found = classification_metrics(val_observed, forest.predict_proba(val_features))
        figures = {f"val_{k}": found[k] for k in ("accuracy", "macro_f1", "roc_auc")}
    else:
        found = regression_metrics(val_observed, forest.predict(val_features))
        figures = {f"val_target_{k}": v for k, v in found.items()}
    return {
        **figures,
        "n_train": len(train_idx),
        "n_val": len(val_idx),
        "features": FEATURES,
        "n_features": features.shape[1],
        "matrix": "dense" if dense else "sparse",  # as the forest got it: splits tie-break differently
        "settings": {"forest": forest_class.__name__, **settings},
        "fit_s": fit_s,
    }


def add_rf_baseline(summary: dict[str, Any], cfg: DictConfig, data: Data, val_detail: dict) -> None:
    """summary.json's `rf_baseline` of a finished run with a target (`val_detail`: its last validation's
    samples, `validate`'s detail; empty without target predictions), unless metrics.rf_baseline=false."""
    if not cfg.metrics.rf_baseline or data.target is None or not val_detail:
        return
    train_idx = list(data.train_loader.dataset.indices)
    summary["rf_baseline"] = fit_rf_baseline(
        data.dataset, len(data.collate.tokens), data.target, train_idx, val_detail["sample_idx"], cfg.seed
    )


def rf_baseline_line(summary: dict[str, Any]) -> str | None:
    """The line a run prints just above its target line: the forest's figures on the same samples; None
    without a forest."""
    rf = summary.get("rf_baseline")
    if not rf:
        return None

    def fmt(key: str, name: str, digits: str) -> str:
        return "" if rf.get(key) is None else f", {name} {rf[key]:{digits}}"

    if "val_accuracy" in rf:
        figures = f"val accuracy {rf['val_accuracy']:.3f}" + fmt("val_macro_f1", "macro-F1", ".3f")
        figures += fmt("val_roc_auc", "ROC AUC", ".3f")
    else:
        figures = f"val MAE {rf['val_target_mae']:.4g}" + fmt("val_target_rmse", "RMSE", ".4g")
        figures += fmt("val_target_r2", "R^2", ".3f")
    trees = rf["settings"]["n_estimators"]
    return (
        f"  random forest on the same {rf['n_val']} samples: {figures} ({trees} trees on the "
        f"{rf['features']} of {rf['n_train']} training samples, {rf['fit_s']:.1f} s; metrics.rf_baseline)"
    )
