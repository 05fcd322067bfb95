"""aamperf/metrics/target.py: each figure equals scikit-learn's on the same samples, including the cases
that trip hand-written metrics (tied scores, a class never predicted, a class absent from the labels)."""

import numpy as np
import pytest
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    mean_absolute_error,
    mean_squared_error,
    r2_score,
    roc_auc_score,
)

from aamperf.metrics.target import binary_auc, classification_metrics, interval_coverage, regression_metrics


def test_regression_figures_are_sklearn_s():
    rng = np.random.default_rng(0)
    observed = rng.normal(50, 10, 37)
    predicted = observed + rng.normal(0, 4, 37)
    got = regression_metrics(observed, predicted)
    assert got["mae"] == pytest.approx(mean_absolute_error(observed, predicted), rel=1e-12)
    assert got["rmse"] == pytest.approx(np.sqrt(mean_squared_error(observed, predicted)), rel=1e-12)
    assert got["r2"] == pytest.approx(r2_score(observed, predicted), rel=1e-12)
    assert regression_metrics(np.full(4, 2.0), np.arange(4.0))["r2"] is None  # no variance to explain


def test_interval_coverage_counts_the_observed_values_inside_the_interval():
    observed = np.array([0.0, 1.0, 2.0, 3.0])
    assert interval_coverage(observed, np.array([0, 2, 0, 3.5]), np.array([1, 3, 2, 4])) == 0.5


def probabilities(rng, n: int, k: int) -> np.ndarray:
    p = rng.random((n, k)).round(1) + 1e-3  # rounded: tied scores
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("seed", range(5))
def test_multiclass_figures_are_sklearn_s(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, 40)
    labels[:4] = [0, 1, 2, 3]  # every class occurs (sklearn's one-vs-rest AUC needs it)
    p = probabilities(rng, 40, 4)
    got = classification_metrics(labels, p)
    predicted = p.argmax(axis=1)
    assert got["accuracy"] == pytest.approx(accuracy_score(labels, predicted), rel=1e-12)
    assert got["macro_f1"] == pytest.approx(f1_score(labels, predicted, average="macro"), rel=1e-12)
    assert got["roc_auc"] == pytest.approx(
        roc_auc_score(labels, p, multi_class="ovr", average="macro"), rel=1e-12
    )
    assert got["confusion_matrix"] == confusion_matrix(labels, predicted, labels=range(4)).tolist()


def test_binary_auc_is_of_the_second_class_and_ties_count_half():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 50)
    p = probabilities(rng, 50, 2)
    assert classification_metrics(labels, p)["roc_auc"] == pytest.approx(
        roc_auc_score(labels, p[:, 1]), rel=1e-12
    )
    assert binary_auc(np.array([True, False]), np.array([0.5, 0.5])) == 0.5
    assert binary_auc(np.array([True, True]), np.array([0.1, 0.9])) is None  # no negative: undefined


def test_a_class_never_predicted_counts_in_macro_f1_as_sklearn_counts_it():
    labels = np.array([0, 0, 1, 1, 2, 2])
    p = np.array([[0.9, 0.1, 0], [0.8, 0.2, 0], [0.2, 0.8, 0], [0.6, 0.4, 0], [0.3, 0.7, 0], [0.1, 0.9, 0]])
    got = classification_metrics(labels, p)
    predicted = p.argmax(axis=1)
    assert got["macro_f1"] == pytest.approx(f1_score(labels, predicted, average="macro", zero_division=0))
    # a class in neither the labels nor the predictions has no F1: left out, as sklearn leaves it out
    wider = np.hstack([p, np.zeros((6, 1))])
    assert classification_metrics(labels, wider)["macro_f1"] == pytest.approx(got["macro_f1"])
    assert classification_metrics(labels, wider)["confusion_matrix"][3] == [0, 0, 0, 0]
