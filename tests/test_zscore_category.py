"""data.target_transform=zscore_category (the original AAM's zscore-category, aamperf/targets.py): the target
z-scored within each category of data.normalize_by's columns, fitted on the training samples. The units
against pandas' per-category mean and std, the loss's target part against its formula, a real run's
figures and val_predictions.tsv against the model's outputs put back in each sample's own units, predict
on metadata that moves samples to another category, an unseen one or none, and the refusals."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import read_summary
from hydra.utils import instantiate
from test_categorical import predicted_here
from test_targets import sklearn_regression

from aamperf.checks import check_config
from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.errors import UserError
from aamperf.predict.target import read_saved_target
from aamperf.run import train
from aamperf.targets import fit_groups, fit_regression, group_keys, learn_target
from aamperf.weights import load_model

BY_ENV = ["data.target=target", "data.target_transform=zscore_category", "data.normalize_by=[environment]"]
FAST = ["trainer.lr=3e-3", "trainer.max_steps=6", "trainer.val_every=3", "loss.unifrac_weight=0"]
CPU = torch.device("cpu")


def training_units(data) -> pd.DataFrame:
    """The training samples' mean and standard deviation (unbiased) of the target per environment, by
    pandas from metadata.tsv."""
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0)
    train_ids = [data.sample_ids[i] for i in data.train_loader.dataset.indices]
    return metadata.loc[train_ids].groupby("environment")["target"].agg(["mean", "std"])


def test_each_category_s_units_are_its_training_samples_mean_and_std(make_cfg):
    cfg = make_cfg(*BY_ENV)
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    spec, want = data.target, training_units(data)
    assert spec.normalize_by == ["environment"] and sorted(spec.groups) == [
        f"environment={e}" for e in want.index
    ]
    for env, row in want.iterrows():
        assert spec.groups[f"environment={env}"] == pytest.approx([row["mean"], row["std"]], rel=1e-12)
    # each sample's units are its environment's: its training samples come out z-scored
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0)
    envs = metadata.loc[data.sample_ids, "environment"]
    train = torch.as_tensor(data.train_loader.dataset.indices)
    units = spec.sample_units[train]
    standard = spec.forward(data.dataset.target[train].double(), units)
    for env in want.index:
        rows = torch.from_numpy((envs.iloc[train.numpy()] == env).to_numpy().copy())
        assert float(standard[rows].mean()) == pytest.approx(0, abs=1e-9)
        assert float(standard[rows].std()) == pytest.approx(1, rel=1e-9)
    torch.testing.assert_close(spec.inverse(standard, units), data.dataset.target[train].double())
    assert spec.payload()["groups"] == spec.groups  # saved with the model and in summary.json


def test_a_category_of_one_training_sample_an_unseen_one_and_a_missing_one():
    values = torch.tensor([1.0, 3.0, 5.0, 10.0, 7.0, 100.0], dtype=torch.float64)
    keys = group_keys({"site": ["a", "a", "a", "b", None, "c"]})
    assert keys == ["site=a", "site=a", "site=a", "site=b", None, "site=c"]
    train = torch.tensor([0, 1, 3, 4])  # site=a's 5.0 and site=c only validate: the fit sees neither
    spec = fit_regression("y", values, train, "zscore_category")
    fit_groups(spec, ["site"], values, keys, train)
    everyone = [float(values[train].mean()), float(values[train].std())]
    assert [spec.shift, spec.scale] == pytest.approx(everyone)
    assert spec.groups == {
        "site=a": pytest.approx([2.0, 2**0.5]),
        "site=b": pytest.approx([10.0, spec.scale]),
    }
    units = spec.sample_units  # b: one sample (its scale the target's); c unseen, None missing
    torch.testing.assert_close(units[4], torch.tensor(everyone, dtype=torch.float64))
    torch.testing.assert_close(units[5], torch.tensor(everyone, dtype=torch.float64))
    torch.testing.assert_close(spec.inverse(spec.forward(values, units), units), values)


def test_the_loss_learns_each_sample_z_scored_within_its_category(make_cfg):
    cfg = make_cfg(*BY_ENV)
    data = build_data(cfg.data, batch_size=8, seed=cfg.seed, loader=cfg.dataloader)
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})
    batch = to_device(next(iter(data.train_loader)), CPU)
    predicted = torch.randn(len(batch["sample_idx"]), 1, dtype=torch.float32)
    total, weight, sums = loss_fn.target_sums(predicted, batch["target"], batch["sample_idx"])
    want = training_units(data)
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0)
    envs = metadata.loc[[data.sample_ids[i] for i in batch["sample_idx"].tolist()], "environment"]
    mean = torch.tensor(want.loc[envs, "mean"].to_numpy(), dtype=torch.float32)[:, None]
    std = torch.tensor(want.loc[envs, "std"].to_numpy(), dtype=torch.float32)[:, None]
    standard = (batch["target"] - mean) / std
    torch.testing.assert_close(total / weight, F.mse_loss(predicted, standard))
    own = predicted * std + mean  # the MAE in the target's own units, each sample's
    torch.testing.assert_close(sums["target_mae"], (own - batch["target"]).abs().sum())


def test_a_run_reports_in_the_target_s_units_and_predict_puts_each_sample_in_its_category(make_cfg, tmp_path):
    """The run's val_predictions.tsv and figures are the model's outputs put back with each sample's
    environment's units; predict with the metadata moving a sample to another environment, one to an
    environment training never saw and one to none: their predictions move by exactly those units."""
    summary = train(make_cfg(*BY_ENV, *FAST), tmp_path / "run")
    assert summary["status"] == "completed", summary.get("error")
    table = pd.read_csv(tmp_path / "run" / "val_predictions.tsv", sep="\t", index_col=0)
    want = sklearn_regression(table["observed"], table["predicted"])
    for key, value in want.items():
        assert summary["val"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert read_summary(tmp_path / "run")["target"]["normalize_by"] == ["environment"]
    # beside them, what each sample's environment's training mean alone scores (the means come from metadata)
    files = build_data(make_cfg(*BY_ENV).data, batch_size=4, seed=0, loader=make_cfg().dataloader).files
    envs = pd.read_csv(files["metadata"], sep="\t", index_col=0).loc[table.index.astype(str), "environment"]
    means = [summary["target"]["groups"][f"environment={env}"][0] for env in envs]
    want_means = sklearn_regression(table["observed"], means)
    assert summary["val"]["val_target_category_mean_r2"] == pytest.approx(
        want_means["val_target_r2"], rel=1e-6
    )
    # the predictions written are the model's, each in its sample's environment's units: from model.pt
    cfg = make_cfg(*BY_ENV, *FAST)
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})
    model, _ = load_model(tmp_path / "run")
    with torch.no_grad():
        batches = [to_device(b, CPU) for b in data.val_loader]
        outputs = torch.cat([loss_fn.evaluate(model, b, 0)[2] for b in batches])
    idx = torch.cat([b["sample_idx"] for b in batches])
    own = data.target.inverse(outputs[:, 0].double(), data.target.sample_units[idx])
    np.testing.assert_allclose(table["predicted"], own[: len(table)].numpy(), rtol=1e-5)

    data = build_data(make_cfg(*BY_ENV).data, batch_size=4, seed=0, loader=make_cfg().dataloader)
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0, dtype=str)
    new = metadata.copy()
    ids = data.sample_ids
    moved = "env1" if metadata.loc[ids[0], "environment"] != "env1" else "env2"
    new.loc[ids[0], "environment"] = moved
    new.loc[ids[1], "environment"] = "glacier"
    new.loc[ids[2], "environment"] = ""
    new.to_csv(tmp_path / "new.tsv", sep="\t")
    table_file = f"data.table={data.files['table']}"
    before = predicted_here(
        tmp_path / "run", tmp_path / "before", table_file, f"data.metadata={data.files['metadata']}"
    )
    after = predicted_here(
        tmp_path / "run", tmp_path / "after", table_file, f"data.metadata={tmp_path / 'new.tsv'}"
    )
    assert before["target_groups"] == {"normalize_by": ["environment"], "unseen": 0, "missing": 0}
    assert after["target_groups"] == {"normalize_by": ["environment"], "unseen": 1, "missing": 1}
    groups, everyone = summary["target"]["groups"], [summary["target"]["shift"], summary["target"]["scale"]]
    old = pd.read_csv(tmp_path / "before" / "targets.tsv", sep="\t", index_col=0)["predicted"]
    changed = pd.read_csv(tmp_path / "after" / "targets.tsv", sep="\t", index_col=0)["predicted"]
    for sid, env in ((ids[0], moved), (ids[1], None), (ids[2], None)):
        mean, std = groups[f"environment={metadata.loc[sid, 'environment']}"]
        standard = (old[sid] - mean) / std  # the model's output, the same in both
        mean, std = groups[f"environment={env}"] if env else everyone
        assert changed[sid] == pytest.approx(standard * std + mean, rel=1e-5)  # targets.tsv's digits
    rest = [sid for sid in ids if sid not in ids[:3]]
    np.testing.assert_allclose(changed[rest], old[rest], rtol=1e-12)
    assert changed[ids[0]] != pytest.approx(old[ids[0]])  # another environment: another prediction
    lacking = metadata.drop(columns="environment")
    lacking.to_csv(tmp_path / "lacking.tsv", sep="\t")
    with pytest.raises(UserError, match=r"z-scores its target within the categories of data\.normalize_by="):
        predicted_here(
            tmp_path / "run", tmp_path / "x", table_file, f"data.metadata={tmp_path / 'lacking.tsv'}"
        )


def test_normalize_by_and_zscore_category_go_together_and_refuse_in_one_line(make_cfg, launch_here):
    with pytest.raises(UserError, match=r"data\.normalize_by=\[<column>,\.\.\.\]"):
        check_config(make_cfg("data.target=target", "data.target_transform=zscore_category"))
    with pytest.raises(UserError, match=r"is read by data\.target_transform=zscore_category only"):
        check_config(make_cfg("data.target=target", "data.normalize_by=[environment]"))
    proc, _ = launch_here(
        "data.target=target", "data.target_transform=zscore_category", "data.normalize_by=[site]"
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: data.normalize_by: no column 'site' in ")
    # the original's spelling
    proc, _ = launch_here("data.target=target", "data.target_transform=zscore-category")
    assert proc.returncode == 2 and "data.target_transform=zscore_category data.normalize_by=" in proc.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("groups", {"environment=env0": [0.0, 0.0]}),
        ("groups", {"environment=env0": [0.0, float("nan")]}),
        ("groups", {"environment=env0": "os.system('x')"}),
        ("groups", ["environment=env0"]),
        ("normalize_by", "environment"),
        ("normalize_by", []),
    ],
)
def test_a_model_file_s_malformed_categories_are_refused_in_one_line(tmp_path, field, value):
    saved = {
        "column": "target", "type": "regression", "transform": "zscore_category", "shift": 0.0, "scale": 1.0,
        "normalize_by": ["environment"], "groups": {"environment=env0": [0.5, 2.0]},
    }  # fmt: skip
    assert read_saved_target({"target": saved}, tmp_path).spec.groups == {"environment=env0": [0.5, 2.0]}
    with pytest.raises(UserError, match=f"its target's {field} .*; train the run again$"):
        read_saved_target({"target": {**saved, field: value}}, tmp_path)


def test_the_model_file_keeps_the_categories_units(make_cfg, tmp_path):
    train(make_cfg(*BY_ENV, "trainer.max_steps=2"), tmp_path)
    _, payload = load_model(tmp_path)
    spec = read_saved_target(payload, tmp_path).spec
    assert spec.transform == "zscore_category" and spec.normalize_by == ["environment"]
    assert spec.groups == read_summary(tmp_path)["target"]["groups"] and len(spec.groups) == 4


def test_a_classification_and_columns_no_training_sample_fills_are_refused(make_cfg, tmp_path):
    cfg = make_cfg(
        "data.target=environment", "data.target_transform=zscore_category", "data.normalize_by=[target]"
    )
    with pytest.raises(
        UserError, match=r"zscore_category z-scores a regression; 'environment' is a classification"
    ):
        build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    spec = fit_regression("y", values, torch.arange(4), "zscore_category")
    with pytest.raises(
        UserError, match=r"^data\.normalize_by=\['site'\]: no training sample has a value of it"
    ):
        fit_groups(spec, ["site"], values, [None, None, None, "site=a"], torch.arange(3))


def test_the_last_line_says_the_category_means_score_and_takes_none():
    from aamperf.run import target_line

    val = {"val_target_mae": 1.0, "val_target_r2": 0.5, "val_target_category_mean_r2": 0.25}
    assert "(each category's training mean alone: R^2 0.250)" in target_line({"val": val})
    same = {"val_target_mae": 1.0, "val_target_r2": None, "val_target_category_mean_r2": None}  # all equal
    assert "each category" not in target_line({"val": same})
