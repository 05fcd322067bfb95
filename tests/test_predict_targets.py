"""python -m aamperf.predict on fine-tuned runs: a regression's predictions in the target's own units (its
saved transform inverted, one column per quantile of a quantile loss), a classification's class and class
probabilities, their figures against scikit-learn's; a model file of the zscore-only payload predicts as
before, a malformed target payload is refused in one line."""

import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CONF_DIR, read_summary
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from aamperf.data.collate import Collate
from aamperf.data.samples import read_samples
from aamperf.data.tables import resolve_files
from aamperf.errors import UserError
from aamperf.predict.bench import keeps_quality
from aamperf.predict.config import register_predict_configs
from aamperf.predict.masks import hidden_bases, run_masks, sequence_keys
from aamperf.predict.run import predict
from aamperf.run import train
from aamperf.tokens import MASK
from aamperf.weights import load_model

FAST = ["trainer.lr=3e-3", "trainer.max_steps=4"]


def predicted_here(run_dir, out, *overrides: str) -> tuple[pd.DataFrame, dict]:
    """predict(cfg, out) on the run's own samples: (targets.tsv, summary)."""
    register_predict_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("predict", [f"run={run_dir}", "device=cpu", "progress=false", *overrides])
    summary = predict(cfg, out)
    return pd.read_csv(out / "targets.tsv", sep="\t", index_col=0, keep_default_na=False), summary


def model_outputs(run_dir) -> tuple[list[str], torch.Tensor, dict]:
    """(sample ids, the target output of model.pt on every sample of the run's data, the payload): by hand,
    the bases hidden as predict hides them by default (mask=run: as the run's loss hid them at step 0)."""
    model, payload = load_model(run_dir)
    samples = read_samples(OmegaConf.create(payload["config"]["data"]), keep_unlabelled=True)
    batch = Collate(samples.tokens, None, pad_to=None)([samples.dataset[i] for i in range(len(samples.ids))])
    tokens, masks = batch["tokens"], run_masks(payload["config"], "run")
    if masks is not None:  # pass 0's
        tokens = tokens.masked_fill(hidden_bases(batch, sequence_keys(samples.tokens), 0, masks), MASK)
    with torch.no_grad():
        out = model(tokens, batch["counts"], asv_ids=batch["asv_ids"])["target"]
    return samples.ids, out.double(), payload


def sklearn_regression(observed, predicted) -> dict:
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    return {
        "mae": mean_absolute_error(observed, predicted),
        "rmse": mean_squared_error(observed, predicted) ** 0.5,
        "r2": r2_score(observed, predicted),
    }


@pytest.mark.parametrize("transform", ["log_zscore", "minmax", "log1p_minmax"])
def test_a_regression_is_predicted_in_the_target_s_own_units_through_its_saved_transform(
    make_cfg, tmp_path, transform
):
    """The simulated target made positive (data=biom on the simulated files), learnt as log y z-scored,
    min-max scaled, or log(1 + y) min-max scaled: targets.tsv holds the model's output with the transform
    inverted by hand."""
    files = resolve_files(make_cfg().data)
    metadata = pd.read_csv(files["metadata"], sep="\t", index_col=0)
    metadata["target"] = np.exp(metadata["target"]) * 100
    metadata.to_csv(tmp_path / "positive.tsv", sep="\t")
    biom = ["data=biom", f"data.table={files['table']}", f"data.tree={files['tree']}"]
    biom += [f"data.metadata={tmp_path / 'positive.tsv'}", "data.target=target"]
    train(make_cfg(*biom, f"data.target_transform={transform}", *FAST), tmp_path / "run")
    table, summary = predicted_here(tmp_path / "run", tmp_path / "out")
    ids, outputs, payload = model_outputs(tmp_path / "run")
    saved = payload["target"]
    linear = outputs.squeeze(1) * saved["scale"] + saved["shift"]
    own = {"log_zscore": linear.exp(), "log1p_minmax": linear.expm1()}.get(transform, linear)
    assert list(table.index) == ids and list(table.columns) == ["predicted", "observed"]
    np.testing.assert_allclose(table["predicted"], own.numpy(), rtol=1e-5)
    np.testing.assert_allclose(table["observed"], metadata.loc[ids, "target"], rtol=1e-5)
    assert summary["target"]["transform"] == transform and summary["target"]["column"] == "target"
    figures = summary["target_metrics"]
    assert figures["observed"] == len(ids)
    for key, value in sklearn_regression(table["observed"], table["predicted"]).items():
        assert figures[key] == pytest.approx(value, rel=1e-4), key
    assert summary["target_mae"] == figures["mae"]  # the key predict wrote before


def test_a_quantile_regression_writes_one_column_per_quantile_in_the_target_s_units(make_cfg, tmp_path):
    train(make_cfg("loss.target_loss=quantile", "loss.quantiles=[0.1,0.5,0.9]", *FAST), tmp_path / "run")
    table, summary = predicted_here(tmp_path / "run", tmp_path / "out")
    _, outputs, payload = model_outputs(tmp_path / "run")
    saved = payload["target"]
    own = (outputs * saved["scale"] + saved["shift"]).numpy()  # zscore: each quantile's output undone
    columns = ["predicted", "observed", "predicted_q0.1", "predicted_q0.5", "predicted_q0.9"]
    assert list(table.columns) == columns
    for k, column in enumerate(columns[2:]):
        np.testing.assert_allclose(table[column], own[:, k], rtol=1e-5, atol=1e-6)
    assert (table["predicted"] == table["predicted_q0.5"]).all()  # the point: the median
    assert summary["target"]["loss"] == "quantile" and summary["target"]["quantiles"] == [0.1, 0.5, 0.9]
    inside = (table["observed"] >= table["predicted_q0.1"]) & (table["observed"] <= table["predicted_q0.9"])
    assert summary["target_metrics"]["interval_coverage"] == pytest.approx(inside.mean())
    assert summary["target_metrics"]["interval_nominal"] == pytest.approx(0.8)


def test_a_classification_writes_the_class_its_probabilities_and_sklearn_s_figures(
    make_cfg, tmp_path, launch_here
):
    """data.target=environment: the predicted class is the name of the largest logit's class, the
    probabilities the logits' softmax; the figures on every sample equal scikit-learn's; the printout
    says what the target is."""
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, roc_auc_score

    train(make_cfg("data.target=environment", "data.n_envs=3", *FAST), tmp_path / "run")
    proc, out = launch_here(
        f"run={tmp_path / 'run'}", "device=cpu", name="out", module="aamperf.predict", tiny=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(out / "targets.tsv", sep="\t", index_col=0)
    summary = read_summary(out)
    ids, logits, _ = model_outputs(tmp_path / "run")
    classes = ["env0", "env1", "env2"]
    probability_columns = [f"p_{c}" for c in classes]
    assert list(table.columns) == ["predicted", "observed", *probability_columns]
    chances = table[probability_columns].to_numpy()
    np.testing.assert_allclose(chances.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(chances, logits.softmax(1).numpy(), rtol=1e-4, atol=1e-6)
    assert table["predicted"].tolist() == [classes[k] for k in logits.argmax(1).tolist()]
    metadata = pd.read_csv(resolve_files(make_cfg("data.n_envs=3").data)["metadata"], sep="\t", index_col=0)
    assert table["observed"].tolist() == metadata.loc[ids, "environment"].tolist()
    assert summary["target"]["type"] == "classification" and summary["target"]["classes"] == classes
    figures, observed, predicted = summary["target_metrics"], table["observed"], table["predicted"]
    assert figures["observed"] == len(ids) and figures["observed_unknown_class"] == 0
    assert figures["accuracy"] == pytest.approx(accuracy_score(observed, predicted))
    assert figures["macro_f1"] == pytest.approx(f1_score(observed, predicted, average="macro"))
    exact = logits.softmax(1).numpy()  # the file's 6 digits may tie two samples' probabilities
    auc = roc_auc_score(observed, exact, multi_class="ovr", average="macro", labels=classes)
    assert figures["roc_auc"] == pytest.approx(auc, rel=1e-4)
    assert figures["confusion_matrix"] == confusion_matrix(observed, predicted, labels=classes).tolist()
    assert summary["quality"]["target_probability_max_diff"] == 0  # the baseline level: the model itself
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("  target environment: classification over 3 classes (env0, env1, env2) | ")
    assert f"accuracy {figures['accuracy']:.4g}" in line and f"over {len(ids)} observed samples" in line


def test_a_pretrained_run_writes_embeddings_only_and_its_frozen_fine_tune_the_same_ones(make_cfg, tmp_path):
    """Stage 1 (no target: its target head never trained) writes no targets.tsv; stage 2 from it with the
    encoder frozen writes the same embeddings and its classification's predictions."""
    train(make_cfg("data.target=null", *FAST), tmp_path / "pretrain")
    stage2 = [f"init.from_run={tmp_path / 'pretrain'}", "finetune.freeze=encoder", "data.target=environment"]
    train(make_cfg(*stage2, *FAST), tmp_path / "finetune")
    register_predict_configs()
    summaries = {}
    for stage in ("pretrain", "finetune"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("predict", [f"run={tmp_path / stage}", "device=cpu", "progress=false"])
        summaries[stage] = predict(cfg, tmp_path / f"{stage}_out")
    assert summaries["pretrain"]["target"] is None and "target_metrics" not in summaries["pretrain"]
    assert not (tmp_path / "pretrain_out" / "targets.tsv").exists()
    assert (
        "targets.tsv" not in summaries["pretrain"]["files"]
        and "target_mae" not in summaries["pretrain"]["quality"]
    )
    first, second = (
        pd.read_csv(tmp_path / f"{s}_out" / "embeddings.tsv", sep="\t", index_col=0) for s in summaries
    )
    pd.testing.assert_frame_equal(first, second)  # the frozen encoder's embeddings, bit for bit as written
    table = pd.read_csv(tmp_path / "finetune_out" / "targets.tsv", sep="\t", index_col=0)
    classes = summaries["finetune"]["target"]["classes"]
    assert list(table.columns) == ["predicted", "observed", *(f"p_{c}" for c in classes)]
    assert set(table["predicted"]) <= set(classes) and len(table) == len(first)


@pytest.fixture
def zscore_run(make_cfg, tmp_path):
    """A run of the default target (zscore, mse), trained to completion."""
    train(make_cfg(*FAST), tmp_path / "run")
    return tmp_path / "run"


def test_a_model_file_of_the_zscore_only_payload_predicts_as_a_zscore_regression(zscore_run, tmp_path):
    path = zscore_run / "model.pt"
    payload = torch.load(path, weights_only=True)
    payload["target"] = {"column": "target", "mean": 3.5, "std": 2.0}  # what predict read before
    torch.save(payload, path)
    table, summary = predicted_here(zscore_run, tmp_path / "out")
    _, outputs, _ = model_outputs(zscore_run)
    np.testing.assert_allclose(table["predicted"], (outputs.squeeze(1) * 2.0 + 3.5).numpy(), rtol=1e-5)
    target = summary["target"]
    assert (target["type"], target["transform"], target["shift"], target["scale"]) == (
        "regression",
        "zscore",
        3.5,
        2.0,
    )
    assert (target["mean"], target["std"]) == (3.5, 2.0)  # the keys the older readers know


MALFORMED = {
    "a column that is not a name": (
        {"column": 7, "mean": 0.0, "std": 1.0},
        " is not a mapping with a column",
    ),
    "an unknown kind": ({"column": "target", "type": "ordinal"}, " has type 'ordinal', not regression or"),
    "an unknown transform": ({"column": "target", "transform": "sqrt"}, " has transform 'sqrt', not one of"),
    "a scale that is a string": ({"column": "target", "scale": "2"}, "'s scale (2) is not a finite number"),
    "classes that are not names": (
        {"column": "target", "type": "classification", "classes": [1, 2]},
        "'s classes ([1, 2]) are not a list of names",
    ),
    "outputs the model's head does not have": (
        {"column": "target", "loss": "quantile", "quantiles": [0.1, 0.9]},
        " needs 2 outputs but its model.target_dim is 1",
    ),
    "quantiles that are not numbers": (
        {"column": "target", "loss": "quantile", "quantiles": ["a"]},
        "'s quantiles (['a']) are not numbers between 0 and 1",
    ),
}


def test_a_malformed_target_payload_is_refused_in_one_line(zscore_run, tmp_path, launch_here):
    """The model file is data: each malformed target is refused with what is wrong; through the entry
    point, one `error:` line and exit code 2."""
    path = zscore_run / "model.pt"
    payload = torch.load(path, weights_only=True)
    for why, (target, message) in MALFORMED.items():
        torch.save({**payload, "target": target}, path)
        with pytest.raises(UserError, match=f"^{re.escape(f'{path}: its target{message}')}"):
            predicted_here(zscore_run, tmp_path / "out")
        assert not (tmp_path / "out" / "targets.tsv").exists(), why
    proc, _ = launch_here(f"run={zscore_run}", "device=cpu", name="cli", module="aamperf.predict", tiny=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}: its target's quantiles (['a']) are not numbers between 0 and 1")


def test_the_benchmark_bounds_a_classification_s_probabilities_and_a_regression_in_its_scale():
    """keeps_quality: a classification's largest probability difference, a regression's difference in
    the model's units; a summary written before (target_mae in own units, the target's std) as before."""
    good = {"embedding_cosine_min": 1.0}
    classification = {
        "quality": {**good, "target_probability_max_diff": 0.02},
        "target": {"type": "classification"},
    }
    assert keeps_quality(classification, 0.999, 0.01, max_probability_diff=0.05)
    assert not keeps_quality(classification, 0.999, 0.01, max_probability_diff=0.01)
    regression = {
        "quality": {**good, "target_mae": 5.0, "target_mae_scale": 0.005},
        "target": {"scale": 1000.0},
    }
    assert keeps_quality(regression, 0.999, 0.01) and not keeps_quality(regression, 0.999, 0.001)
    before = {
        "quality": {**good, "target_mae": 5.0},
        "target": {"column": "target", "mean": 0.0, "std": 1000.0},
    }
    assert keeps_quality(before, 0.999, 0.01) and not keeps_quality(before, 0.999, 0.001)
