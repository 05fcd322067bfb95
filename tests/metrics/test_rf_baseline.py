"""aamperf/metrics/rf_baseline.py through real runs: the random forest beside a fine-tuned model is the
original AAM's `aam rf-baseline` forest, fitted here again the original's way (the rarefied table's
samples x ASVs, zero-sum training columns dropped, 500 trees, sqrt features, the run's seed) on the run's
training samples, and its figures are scikit-learn's on exactly the samples of the model's validation."""

import json
import sys

import numpy as np
import pandas as pd
import pytest
from conftest import read_summary, torchrun
from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor
from sklearn.metrics import accuracy_score, f1_score, mean_absolute_error, mean_squared_error, r2_score

from aamperf.data import build_data
from aamperf.data.dataset import rarefied_table, split_indices
from aamperf.data.samples import read_samples
from aamperf.data.tables import resolve_files
from aamperf.metrics import rf_baseline
from aamperf.run import train

# 99 samples after rarefaction: 79 trained, 20 validated, of which the model's validation covers the
# first 2 batches of 4 (trainer.val_batches=2): the forest must be scored on those 8 and no others
# metrics.rf_baseline: on by default, off in the tests' TINY settings (conftest.py)
MORE = [
    "data.n_samples=100",
    "data.rarefy_depth=300",
    "trainer.val_batches=2",
    "seed=3",
    "metrics.rf_baseline=true",
]


def forest_again(
    cfg, val_ids: list[str], forest_class, dense: bool = True
) -> tuple[np.ndarray, np.ndarray, int]:
    """(observed, predicted) on `val_ids` of the original's forest, fitted here on the training samples of
    the run's split, and the training sample count: features as aam rf-baseline builds them, from the
    rarefied table (samples x ASVs, the ASVs without a read in any training sample dropped)."""
    samples = read_samples(cfg.data)
    train_pos = split_indices(len(samples.ids), cfg.data.val_fraction, cfg.data.seed)[0]
    train_ids = [samples.ids[i] for i in train_pos]
    table = rarefied_table(samples)
    counts = table.matrix_data.T.tocsr().astype(np.float32)  # [samples, ASVs], in table.ids() order
    position = {sid: k for k, sid in enumerate(table.ids())}
    train_rows, val_rows = [position[s] for s in train_ids], [position[s] for s in val_ids]
    assert not set(val_rows) & set(train_rows)
    kept = np.flatnonzero(np.asarray(counts[train_rows].sum(axis=0)).ravel() > 0)
    counts = counts[:, kept]
    # the target as the original reads it: the metadata column, as numbers or (a classifier) class names
    metadata = pd.read_csv(resolve_files(cfg.data)["metadata"], sep="\t", index_col="sample_id")
    y = metadata.loc[list(table.ids()), cfg.data.target].to_numpy()
    if forest_class is RandomForestClassifier:  # class indices among the training samples' classes
        y = np.searchsorted(sorted(set(y[train_rows])), y)
    y = y.astype(np.int64 if forest_class is RandomForestClassifier else np.float64)
    forest = forest_class(n_estimators=500, max_features="sqrt", random_state=cfg.seed, n_jobs=2)
    if dense:  # a small table: the forest gets it dense (rf_baseline.DENSE_MAX_BYTES)
        counts = counts.toarray()
    forest.fit(counts[train_rows], y[train_rows])
    return y[val_rows], forest.predict(counts[val_rows]), len(train_rows)


def test_a_regression_run_reports_the_forest_s_figures_on_the_model_s_validation_samples(make_cfg, tmp_path):
    cfg = make_cfg(*MORE)
    summary = train(cfg, tmp_path)
    rf = summary["rf_baseline"]
    table = pd.read_csv(tmp_path / "val_predictions.tsv", sep="\t", index_col=0)
    assert len(table) == summary["val"]["val_samples"] == rf["n_val"] == 8  # of the 20 validation samples
    observed, predicted, n_train = forest_again(cfg, table.index.tolist(), RandomForestRegressor)
    np.testing.assert_allclose(observed, table["observed"], rtol=1e-7)  # the model's samples (float32)
    assert rf["n_train"] == n_train == 79
    assert rf["val_target_mae"] == pytest.approx(mean_absolute_error(observed, predicted), rel=1e-9)
    assert rf["val_target_rmse"] == pytest.approx(np.sqrt(mean_squared_error(observed, predicted)), rel=1e-9)
    assert rf["val_target_r2"] == pytest.approx(r2_score(observed, predicted), rel=1e-9)
    assert rf["settings"] == {
        "forest": "RandomForestRegressor",
        "n_estimators": 500,
        "max_features": "sqrt",
        "random_state": 3,
        "n_jobs": rf["settings"]["n_jobs"],
    }
    assert rf["features"] == "rarefied ASV counts" and 0 < rf["n_features"] <= 64 and rf["fit_s"] > 0
    assert rf["matrix"] == "dense"
    # the model's own figures are untouched beside it
    assert summary["val"]["val_target_mae"] == pytest.approx(
        mean_absolute_error(table["observed"], table["predicted"]), rel=1e-6
    )


def test_a_table_too_large_to_densify_gives_the_forest_the_sparse_counts(make_cfg, monkeypatch):
    """The same forest on the sparse matrix (DENSE_MAX_BYTES: the largest dense one; 0 here): its figures
    are those of a forest fitted here on the sparse table, all 20 validation samples scored."""
    cfg = make_cfg(*MORE)
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    val_idx = list(data.val_loader.dataset.indices)
    monkeypatch.setattr(rf_baseline, "DENSE_MAX_BYTES", 0)
    train_idx = list(data.train_loader.dataset.indices)
    rf = rf_baseline.fit_rf_baseline(
        data.dataset, len(data.collate.tokens), data.target, train_idx, val_idx, cfg.seed
    )
    val_ids = [data.sample_ids[i] for i in val_idx]
    observed, predicted, _ = forest_again(cfg, val_ids, RandomForestRegressor, dense=False)
    assert rf["matrix"] == "sparse" and rf["n_val"] == 20
    assert rf["val_target_mae"] == pytest.approx(mean_absolute_error(observed, predicted), rel=1e-9)
    assert rf["val_target_r2"] == pytest.approx(r2_score(observed, predicted), rel=1e-9)


@pytest.mark.slow  # a real process fitting a classifier: about 9 s on a 2-core EPYC
def test_a_classification_run_reports_the_forest_s_accuracy_and_macro_f1_and_ends_with_both_lines(
    make_cfg, launch
):
    """A real process: data.target=environment (3 classes), every validation sample validated."""
    overrides = [*MORE, "trainer.val_batches=5", "data.target=environment", "data.n_envs=3"]
    proc, run_dir = launch(*overrides)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(run_dir)
    rf = summary["rf_baseline"]
    table = pd.read_csv(run_dir / "val_predictions.tsv", sep="\t", index_col=0)
    assert len(table) == rf["n_val"] == 20 and rf["settings"]["forest"] == "RandomForestClassifier"
    observed, predicted, _ = forest_again(make_cfg(*overrides), table.index.tolist(), RandomForestClassifier)
    classes = summary["target"]["classes"]
    assert [classes[k] for k in observed] == table["observed"].tolist()
    assert rf["val_accuracy"] == pytest.approx(accuracy_score(observed, predicted), rel=1e-12)
    assert rf["val_macro_f1"] == pytest.approx(f1_score(observed, predicted, average="macro"), rel=1e-12)
    lines = proc.stdout.splitlines()
    assert lines[-2] == (
        f"  random forest on the same 20 samples: val accuracy {rf['val_accuracy']:.3f}, macro-F1 "
        f"{rf['val_macro_f1']:.3f}, ROC AUC {rf['val_roc_auc']:.3f} (500 trees on the rarefied ASV counts "
        f"of 79 training samples, {rf['fit_s']:.1f} s; metrics.rf_baseline)"
    )
    assert lines[-1].startswith("  target environment: val accuracy")


@pytest.mark.slow  # ~5.5 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_a_run_without_a_target_fits_no_forest_and_never_imports_scikit_learn(launch):
    """metrics.rf_baseline=true asked for, but no target: nothing to fit; -X importtime lists every
    module the process imported."""
    proc, run_dir = launch(
        "data.target=null", "metrics.rf_baseline=true", launcher=(sys.executable, "-X", "importtime")
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rf_baseline" not in read_summary(run_dir)
    assert "| aamperf.run" in proc.stderr  # the listing is there
    assert "sklearn" not in proc.stderr


def test_metrics_rf_baseline_false_skips_the_forest(make_cfg, tmp_path):
    summary = train(make_cfg("metrics.rf_baseline=false"), tmp_path)
    assert summary["status"] == "completed" and summary["val"]["val_target_mae"] is not None
    assert "rf_baseline" not in summary


@pytest.mark.slow  # a two-job sweep and its report: about 10 s on a 2-core EPYC
def test_a_sweep_s_report_shows_the_forest_s_figure_beside_the_model_s(launch):
    """A real sweep of two jobs, one without the forest: comparison.md's target line and comparison.json's
    rows hold each run's own figures (one seed: the medians are the run's)."""
    # Hydra's sweeper writes the override back as `=True`; the report labels it as the command line does
    baseline = 'compare.baseline="metrics.rf_baseline=True"'
    proc, sweep_dir = launch("metrics.rf_baseline=true,false", baseline, multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = {
        s["config"]["metrics"]["rf_baseline"]: s
        for s in (read_summary(path.parent) for path in sweep_dir.glob("*/summary.json"))
    }
    with_forest, without = summaries[True], summaries[False]
    model_r2, forest_r2 = with_forest["val"]["val_target_r2"], with_forest["rf_baseline"]["val_target_r2"]
    rows = {r["config"]: r for r in json.loads((sweep_dir / "comparison.json").read_text())["rows"]}
    fitted = rows["metrics.rf_baseline=true"]
    assert (fitted["target_figure"], fitted["target_value"], fitted["rf_value"]) == (
        "R^2",
        model_r2,
        forest_r2,
    )
    assert rows["metrics.rf_baseline=false"]["rf_value"] is None
    line = (sweep_dir / "comparison.md").read_text().splitlines()[-1]
    assert line.endswith(
        f"`metrics.rf_baseline=true` R^2 {model_r2:.3g} (random forest {forest_r2:.3g}); "
        f"`metrics.rf_baseline=false` R^2 {without['val']['val_target_r2']:.3g} (random forest n/a)."
    )


@pytest.mark.slow  # two processes and a torchrun job: about 30 s on a 2-core EPYC
def test_two_ranks_fit_the_one_process_s_forest_on_every_rank_s_validation_samples(launch):
    """distributed=ddp: the first rank fits the forest, on the validation samples of both ranks (gathered):
    the same figures as the one process's, of the same 16 samples (2 batches of 8)."""
    common = [*MORE, "trainer.batch_size=8"]
    proc, one = launch(*common, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, two = launch(*common, "distributed=ddp", name="two", launcher=torchrun(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone, ranks = read_summary(one)["rf_baseline"], read_summary(two)["rf_baseline"]
    assert ranks["n_val"] == alone["n_val"] == 16
    for key in ("val_target_mae", "val_target_rmse", "val_target_r2", "n_train", "n_features"):
        # the same forest; its figures summed in another order
        assert ranks[key] == pytest.approx(alone[key], rel=1e-12), key
    assert "random forest beside the model" in (two / "train.log").read_text()
    assert "random forest" not in (two / "train_rank1.log").read_text()  # rank 1 fitted none
