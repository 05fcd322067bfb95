"""Fine-tuning targets through real runs: each regression loss and target transform, a classification of
the simulated environments (aamperf/targets.py, AAMLoss's target part), their validation figures against
scikit-learn's on the samples validated, and the refusals of a target that cannot be learnt."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import read_metrics, read_summary
from hydra.utils import instantiate

from aamperf.data import build_data
from aamperf.data.loaders import split_batch
from aamperf.device import to_device
from aamperf.errors import UserError
from aamperf.model.loss import pinball
from aamperf.run import train
from aamperf.targets import TRANSFORMS, fit_regression, learn_target
from aamperf.weights import load_model

# 99 samples after rarefaction, 20 of them validated, all of them at every validation (5 batches of 4);
# the simulated metadata's `environment` column holds env0..env3 (data.n_envs)
MORE = ["data.n_samples=100", "data.rarefy_depth=300", "trainer.val_batches=5"]
STEP = 1
CPU = torch.device("cpu")


def target_setup(make_cfg, *overrides: str, batch_size: int = 8):
    """(data, model in eval mode, loss told the data's target, a training batch) as a run builds them."""
    cfg = make_cfg(*MORE, *overrides)
    data = build_data(cfg.data, batch_size=batch_size, seed=cfg.seed, loader=cfg.dataloader)
    loss_fn = instantiate(cfg.loss)
    learn_target(cfg, loss_fn, data.target, {})
    torch.manual_seed(0)
    model = instantiate(cfg.model).eval()  # no dropout: the same outputs at every call
    return data, model, loss_fn, to_device(next(iter(data.train_loader)), CPU)


def target_part_of(loss_fn, model, batch) -> torch.Tensor:
    """The batch's target part, with its graph (AAMLoss.forward's parts are detached)."""
    out, _ = loss_fn.outputs(model, batch, STEP)
    total, weight, _ = loss_fn.target_sums(out["target"], batch["target"])
    return total / weight


def predicted_again(make_cfg, overrides: list[str], run_dir) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(the target output of model.pt on every validation sample, their observed targets, the loss that
    knows the target): what the run's last validation saw, predicted again."""
    data, _, loss_fn, _ = target_setup(make_cfg, *overrides, batch_size=4)
    model, _ = load_model(run_dir)
    outputs, observed = [], []
    with torch.no_grad():
        for batch in data.val_loader:
            outputs.append(loss_fn.evaluate(model, to_device(batch, CPU), 0)[2])
            observed.append(batch["target"].squeeze(1))
    return torch.cat(outputs), torch.cat(observed), loss_fn


@pytest.mark.parametrize("loss", ["mse", "huber", "mae", "quantile", "asymmetric"])
def test_each_regression_loss_is_torch_s_formula_on_a_batch_and_micro_batches_share_it(make_cfg, loss):
    weights = ["loss.over_weight=3", "loss.under_weight=0.5"]  # asymmetric's; the others do not read them
    data, model, loss_fn, batch = target_setup(
        make_cfg, f"loss.target_loss={loss}", "model.dropout=0", *weights
    )
    _, parts = loss_fn(model, batch, STEP)
    out, _ = loss_fn.outputs(model, batch, STEP)
    predicted = out["target"]
    assert predicted.shape == (8, 3 if loss == "quantile" else 1)  # one output per quantile
    standard = (batch["target"] - data.target.shift) / data.target.scale
    want = {
        "mse": lambda: F.mse_loss(predicted, standard),
        "huber": lambda: F.huber_loss(predicted, standard, delta=1.0),
        "mae": lambda: F.l1_loss(predicted, standard),
        "quantile": lambda: pinball(predicted, standard, [0.1, 0.5, 0.9]).mean(),
        # the original AAM's compute_asymmetric_loss with over_penalty 3, under_penalty 0.5
        "asymmetric": lambda: (
            3 * (predicted - standard).clamp(min=0) + 0.5 * (standard - predicted).clamp(min=0)
        ).mean(),
    }[loss]()
    torch.testing.assert_close(parts["target"], want)
    # gradient caching: the micro-batches' shares of the target part add up to the whole batch's
    micro = split_batch(batch, 2, 1)
    counts = loss_fn.step_counts(micro, STEP)
    shares = [loss_fn.micro_loss(model, m, STEP, None, counts)[1] for m in micro]
    torch.testing.assert_close(sum(s["target"] for s in shares), parts["target"])
    torch.testing.assert_close(sum(s["target_mae"] for s in shares), parts["target_mae"])
    # it trains: a step down its gradient lowers it
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    before = parts["target"]
    optimizer.zero_grad()
    target_part_of(loss_fn, model, batch).backward()
    optimizer.step()
    assert loss_fn(model, batch, STEP)[1]["target"] < before


def test_the_pinball_loss_charges_each_quantile_its_asymmetric_price():
    """Predicting 1 for a target of 0 (over) costs (1 - q), predicting -1 (under) costs q."""
    q = [0.1, 0.9]
    over = pinball(torch.ones(1, 2), torch.zeros(1, 1), q)
    under = pinball(-torch.ones(1, 2), torch.zeros(1, 1), q)
    torch.testing.assert_close(over, torch.tensor([(0.9 + 0.1) / 2]))
    torch.testing.assert_close(under, torch.tensor([(0.1 + 0.9) / 2]))
    torch.testing.assert_close(
        pinball(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 1), q), torch.tensor([0.45])
    )


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_transform_is_fitted_on_the_training_samples_and_inverted_exactly(transform):
    values = torch.tensor([3.0, 50.0, 7.5, 0.2, 12.0, 900.0], dtype=torch.float64)
    train = torch.tensor([0, 2, 3, 4])  # 50 and 900 are validation samples: the fit must not see them
    spec = fit_regression("y", values, train, transform)
    torch.testing.assert_close(spec.inverse(spec.forward(values)), values)
    fitted = spec.forward(values[train])
    if "zscore" in transform:  # zscore_category's every-sample part (its categories: test_zscore_category.py)
        assert float(fitted.mean()) == pytest.approx(0, abs=1e-12)
        assert float(fitted.std()) == pytest.approx(1)
    elif transform.endswith("minmax"):
        assert (float(fitted.min()), float(fitted.max())) == pytest.approx((0, 1))
    else:
        torch.testing.assert_close(fitted, values[train])


def test_a_log_transform_of_a_target_with_values_at_or_below_zero_is_refused():
    with pytest.raises(UserError, match=r"^data\.target_transform=log_zscore: column 'y' holds values <= 0 "):
        fit_regression("y", torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 2]), "log_zscore")
    with pytest.raises(
        UserError, match=r"holds values <= -1 \(lowest -2\), whose log of 1 \+ y is undefined"
    ):
        fit_regression("y", torch.tensor([1.0, -2.0, 2.0]), torch.tensor([0, 2]), "log1p_zscore")


def test_the_log1p_transforms_are_the_original_aam_s_log_zscore_and_log_minmax():
    """The original's --target-transform log-zscore / log-minmax: log(y + 1), then z-scored (its std
    unbiased) or min-max scaled on the training samples; a target of 0 is taken."""
    values = torch.tensor([0.0, 3.0, 50.0, 7.5, 0.2], dtype=torch.float64)
    train = torch.tensor([0, 1, 3, 4])
    logged = np.log(values.numpy() + 1)
    theirs = {
        "log1p_zscore": (logged - logged[[0, 1, 3, 4]].mean()) / logged[[0, 1, 3, 4]].std(ddof=1),
        "log1p_minmax": (logged - logged[[0, 1, 3, 4]].min()) / np.ptp(logged[[0, 1, 3, 4]]),
    }
    for transform, expected in theirs.items():
        spec = fit_regression("y", values, train, transform)
        np.testing.assert_allclose(spec.forward(values).numpy(), expected, rtol=1e-12)
        torch.testing.assert_close(spec.inverse(spec.forward(values)), values)


def sklearn_regression(observed, predicted) -> dict[str, float]:
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    return {
        "val_target_mae": mean_absolute_error(observed, predicted),
        "val_target_rmse": float(np.sqrt(mean_squared_error(observed, predicted))),
        "val_target_r2": r2_score(observed, predicted),
    }


@pytest.mark.parametrize(
    ("loss", "transform"),
    [
        ("mse", "zscore"),
        ("huber", "minmax"),
        ("mae", "none"),
        ("quantile", "zscore"),
        ("asymmetric", "zscore"),
    ],
)
def test_a_regression_trains_and_reports_sklearn_s_figures_in_the_target_s_own_units(
    make_cfg, tmp_path, loss, transform
):
    """A short real run of each loss, whose MAE / RMSE / R^2 (summary.json,
    metrics.jsonl, the last line) are scikit-learn's of the validation samples, predicted again from
    model.pt and put back in the target's units here."""
    overrides = [
        *MORE,
        f"loss.target_loss={loss}",
        f"data.target_transform={transform}",
        "trainer.max_steps=8",
    ]
    overrides += [
        "trainer.lr=3e-3",
        "trainer.val_every=4",
        "loss.unifrac_weight=0",
        "loss.nucleotide_weight=0",
    ]
    summary = train(make_cfg(*overrides), tmp_path)
    rows = read_metrics(tmp_path)
    assert summary["status"] == "completed" and all(np.isfinite(r["loss_target"]) for r in rows)
    table = pd.read_csv(tmp_path / "val_predictions.tsv", sep="\t", index_col=0)
    val = summary["val"]
    assert len(table) == val["val_samples"] == 20
    # the predictions written are the model's: again from model.pt on the validation samples
    outputs, observed, loss_fn = predicted_again(make_cfg, overrides, tmp_path)
    own = loss_fn.target.inverse(loss_fn.point(outputs.double())).numpy()
    np.testing.assert_allclose(table["predicted"], own, rtol=1e-5)
    np.testing.assert_allclose(table["observed"], observed.double().numpy(), rtol=1e-6)
    want = sklearn_regression(table["observed"], table["predicted"])
    for key, value in want.items():
        assert val[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert rows[-1][key] == val[key]
    if loss == "quantile":
        low, high = table["q0.1"], table["q0.9"]
        inside = ((table["observed"] >= low) & (table["observed"] <= high)).mean()
        assert val["val_target_interval_coverage"] == pytest.approx(inside)
        assert val["val_target_interval_nominal"] == pytest.approx(0.8)
        assert summary["target"]["quantiles"] == [0.1, 0.5, 0.9]
    assert summary["target"]["transform"] == transform and summary["target"]["loss"] == loss
    assert summary["config"]["model"]["target_dim"] == (3 if loss == "quantile" else 1)  # model.pt's too


def test_a_log_zscore_regression_reports_in_the_target_s_units(make_cfg, cache_dir, tmp_path):
    """The simulated target shifted above 0 (data=biom on the simulated files): the model learns log y
    z-scored, every figure is of y itself."""
    cfg = make_cfg(*MORE)
    files = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader).files
    metadata = pd.read_csv(files["metadata"], sep="\t", index_col=0)
    metadata["target"] = np.exp(metadata["target"]) * 100
    metadata.to_csv(tmp_path / "positive.tsv", sep="\t")
    biom = [*MORE, "data=biom", f"data.table={files['table']}", f"data.tree={files['tree']}"]
    biom += [
        f"data.metadata={tmp_path / 'positive.tsv'}",
        "data.target=target",
        "data.target_transform=log_zscore",
    ]
    summary = train(make_cfg(*biom), tmp_path / "run")
    table = pd.read_csv(tmp_path / "run" / "val_predictions.tsv", sep="\t", index_col=0)
    np.testing.assert_allclose(table["observed"], metadata.loc[table.index, "target"], rtol=1e-6)
    outputs, _, loss_fn = predicted_again(make_cfg, biom, tmp_path / "run")
    np.testing.assert_allclose(
        table["predicted"],
        (outputs.double().squeeze(1) * loss_fn.target.scale + loss_fn.target.shift).exp(),
        rtol=1e-5,
    )
    for key, value in sklearn_regression(table["observed"], table["predicted"]).items():
        assert summary["val"][key] == pytest.approx(value, rel=1e-6), key
    train_ids, _ = split(make_cfg, *biom)
    assert summary["target"]["shift"] == pytest.approx(np.log(metadata.loc[train_ids, "target"]).mean())
    # saved with the model, where predict reads the target's scale
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)["target"]
    assert saved == summary["target"] and saved["transform"] == "log_zscore"


def sklearn_classification(table: pd.DataFrame, classes: list[str]) -> dict:
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, roc_auc_score

    observed, predicted = table["observed"], table["predicted"]
    probabilities = table[[f"p_{c}" for c in classes]].to_numpy()
    auc = (
        roc_auc_score(observed == classes[1], probabilities[:, 1])
        if len(classes) == 2
        else roc_auc_score(observed, probabilities, multi_class="ovr", average="macro", labels=classes)
    )
    return {
        "val_accuracy": accuracy_score(observed, predicted),
        "val_macro_f1": f1_score(observed, predicted, average="macro"),
        "val_roc_auc": auc,
        "matrix": confusion_matrix(observed, predicted, labels=classes).tolist(),
    }


@pytest.mark.parametrize("n_envs", [2, 4])
def test_a_classification_of_a_categorical_column_reports_sklearn_s_figures(make_cfg, tmp_path, n_envs):
    """data.target=environment (not numeric: a classification, auto): a logit per class, cross-entropy,
    and accuracy / macro-F1 / ROC AUC / confusion matrix equal to scikit-learn's on the 20 validation
    samples, whose probabilities are the model's (predicted again from model.pt)."""
    overrides = [*MORE, "data.target=environment", f"data.n_envs={n_envs}", "trainer.max_steps=6"]
    overrides += ["trainer.lr=3e-3", "trainer.val_every=3"]
    summary = train(make_cfg(*overrides), tmp_path)
    classes = [f"env{k}" for k in range(n_envs)]
    assert summary["target"]["type"] == "classification" and summary["target"]["classes"] == classes
    assert summary["config"]["model"]["target_dim"] == n_envs
    table = pd.read_csv(tmp_path / "val_predictions.tsv", sep="\t", index_col=0)
    assert len(table) == 20 and set(table["observed"]) == set(classes)
    logits, observed, _ = predicted_again(make_cfg, overrides, tmp_path)
    assert table["observed"].tolist() == [classes[int(k)] for k in observed]
    np.testing.assert_allclose(table[[f"p_{c}" for c in classes]], logits.softmax(1).numpy(), rtol=1e-4)
    want = sklearn_classification(table, classes)
    val = summary["val"]
    for key in ("val_accuracy", "val_macro_f1", "val_roc_auc"):
        assert val[key] == pytest.approx(want[key], rel=1e-9), key
        assert read_metrics(tmp_path)[-1][key] == val[key]
    assert summary["val_confusion_matrix"] == {"classes": classes, "matrix": want["matrix"]}


def test_class_weights_weigh_the_cross_entropy_as_torch_does(make_cfg):
    _, model, loss_fn, batch = target_setup(
        make_cfg, "data.target=environment", "loss.class_weights=[1.0,2.0,0.5,3.0]", "model.dropout=0"
    )
    _, parts = loss_fn(model, batch, STEP)
    out, _ = loss_fn.outputs(model, batch, STEP)
    labels = batch["target"].squeeze(1).long()
    weights = torch.tensor([1.0, 2.0, 0.5, 3.0])
    torch.testing.assert_close(parts["target"], F.cross_entropy(out["target"], labels, weight=weights))
    assert not torch.allclose(parts["target"], F.cross_entropy(out["target"], labels))
    micro = split_batch(batch, 2, 1)
    counts = loss_fn.step_counts(micro, STEP)
    shares = [loss_fn.micro_loss(model, m, STEP, None, counts)[1]["target"] for m in micro]
    torch.testing.assert_close(sum(shares), parts["target"])
    # balanced: n / (classes x count) of the training samples, scikit-learn's
    from sklearn.utils.class_weight import compute_class_weight

    data, _, balanced, _ = target_setup(make_cfg, "data.target=environment", "loss.class_weights=balanced")
    train_labels = data.dataset.target[data.train_loader.dataset.indices].numpy()
    want = compute_class_weight("balanced", classes=np.arange(4), y=train_labels)
    np.testing.assert_allclose(balanced.class_weights.numpy(), want)


def metadata_with(make_cfg, tmp_path, column: dict) -> list[str]:
    """data=biom overrides on the simulated files, with a metadata column `site` of these values by sample
    (the others left empty: left out)."""
    cfg = make_cfg(*MORE)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0)
    metadata["site"] = pd.Series(column)
    metadata.to_csv(tmp_path / "sites.tsv", sep="\t")
    return [
        *MORE, "data=biom", f"data.table={data.files['table']}", f"data.tree={data.files['tree']}",
        f"data.metadata={tmp_path / 'sites.tsv'}", "data.target=site",
    ]  # fmt: skip


def split(make_cfg, *overrides: str) -> tuple[list[str], list[str]]:
    """(training, validation) sample ids of the MORE data set."""
    cfg = make_cfg(*MORE, *overrides)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    ids = data.sample_ids
    return [ids[i] for i in data.train_loader.dataset.indices], [
        ids[i] for i in data.val_loader.dataset.indices
    ]


def test_a_class_with_one_sample_and_a_class_unseen_in_training_are_refused_in_one_line(make_cfg, tmp_path):
    train_ids, val_ids = split(make_cfg)
    sites = {sid: ("gut" if k % 2 else "skin") for k, sid in enumerate(train_ids + val_ids)}
    with pytest.raises(
        UserError, match=r"^data\.target=site: class 'soil' has a single sample, which cannot be"
    ):
        train(make_cfg(*metadata_with(make_cfg, tmp_path, {**sites, val_ids[0]: "soil"})), tmp_path / "one")
    unseen = {**sites, val_ids[0]: "soil", val_ids[1]: "soil"}
    with pytest.raises(
        UserError, match=r"^data\.target=site: validation samples of class 'soil', which no"
    ) as caught:
        train(make_cfg(*metadata_with(make_cfg, tmp_path, unseen)), tmp_path / "unseen")
    assert str(caught.value).endswith("(data.seed / data.val_fraction, or the ids of data.val_samples)")


def test_a_numeric_column_is_a_classification_when_asked(make_cfg, tmp_path):
    train_ids, val_ids = split(make_cfg)
    sites = {sid: str(k % 3 * 10) for k, sid in enumerate(train_ids + val_ids)}  # 0, 10, 20: numbers
    overrides = metadata_with(make_cfg, tmp_path, sites)
    regression = train(make_cfg(*overrides), tmp_path / "auto")
    assert regression["target"]["type"] == "regression" and "val_target_r2" in regression["val"]
    classified = train(make_cfg(*overrides, "data.target_type=classification"), tmp_path / "asked")
    assert classified["target"]["classes"] == ["0", "10", "20"]  # sorted as numbers
    assert "val_accuracy" in classified["val"]


def test_an_id_column_as_target_exits_2_in_one_line(make_cfg, tmp_path, launch_here):
    """Through the real command line: one error line, exit code 2."""
    train_ids, val_ids = split(make_cfg)
    ids = {sid: f"subject-{sid}" for sid in train_ids + val_ids}
    proc, _ = launch_here(*metadata_with(make_cfg, tmp_path, ids))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "column 'site' of" in errors[0] and "is neither numeric nor categorical" in errors[0]


def test_the_run_ends_with_a_line_of_its_target_figures(launch_here):
    proc, run_dir = launch_here(*MORE, "data.target=environment")
    assert proc.returncode == 0, proc.stderr[-2000:]
    val = read_summary(run_dir)["val"]
    assert proc.stdout.splitlines()[-1] == (
        f"  target environment: val accuracy {val['val_accuracy']:.3f}, macro-F1 {val['val_macro_f1']:.3f}, "
        f"ROC AUC {val['val_roc_auc']:.3f}, over 20 of the 20 validation samples (trainer.val_batches=5)"
    )
