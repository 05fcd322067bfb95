"""loss.category_weights with data.weight_by (the original AAM's --categorical-loss-weights and
--categorical-loss-weight-column): each sample's target part x its category's weight, over the batch's
samples (a weighted cross-entropy: over its class weights). The balanced weights against pandas' counts of
the training samples, the part against its formula on a batch and its micro-batches' shares, a mapping by
value and by key, a real run's record, and the refusals."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import read_summary
from test_targets import STEP, target_setup

from aamperf.checks import check_config
from aamperf.data.loaders import split_batch
from aamperf.errors import UserError
from aamperf.run import train
from aamperf.targets import category_weights

BY_ENV = ["data.weight_by=[environment]"]


def environments(data, idx) -> pd.Series:
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0)
    return metadata.loc[[data.sample_ids[i] for i in idx], "environment"]


def test_balanced_weights_are_n_over_categories_x_count_of_the_training_samples(make_cfg):
    data, _, loss_fn, _ = target_setup(
        make_cfg, "data.target=target", *BY_ENV, "loss.category_weights=balanced"
    )
    counts = environments(data, data.train_loader.dataset.indices).value_counts()
    want = {f"environment={env}": counts.sum() / (len(counts) * n) for env, n in counts.items()}
    assert loss_fn.category_weights == pytest.approx(want)
    assert (
        len(want) == 4 and len(set(round(w, 6) for w in want.values())) > 1
    )  # unequal counts: unequal weights
    every = environments(data, range(len(data.sample_ids)))
    each = torch.tensor([want[f"environment={env}"] for env in every], dtype=torch.float64)
    torch.testing.assert_close(loss_fn.sample_weights, each)
    train = torch.as_tensor(data.train_loader.dataset.indices)
    assert float(loss_fn.sample_weights[train].mean()) == pytest.approx(1.0)  # a training sample's mean: 1


@pytest.mark.parametrize("loss", ["mse", "quantile"])
def test_each_sample_s_part_is_weighed_by_its_category_in_a_batch_and_its_micro_batches(make_cfg, loss):
    weights = "loss.category_weights={env0:4.0,env1:0.25,env2:2.0}"  # by value (a key holds = : in a file)
    data, model, loss_fn, batch = target_setup(
        make_cfg, "data.target=target", *BY_ENV, weights, f"loss.target_loss={loss}", "model.dropout=0"
    )
    _, parts = loss_fn(model, batch, STEP)
    out, _ = loss_fn.outputs(model, batch, STEP)
    standard = (batch["target"] - data.target.shift) / data.target.scale
    each = {"mse": lambda p: F.mse_loss(p, standard, reduction="none")[:, 0],
            "quantile": lambda p: pinball_each(p, standard)}[loss](out["target"])  # fmt: skip
    by_env = {"env0": 4.0, "env1": 0.25, "env2": 2.0, "env3": 1.0}  # env3 unnamed: 1
    w = torch.tensor([by_env[e] for e in environments(data, batch["sample_idx"].tolist())])
    torch.testing.assert_close(parts["target"], (w * each).sum() / len(w))
    assert not torch.allclose(parts["target"], each.mean())
    micro = split_batch(batch, 2, 1)  # gradient caching: the shares add up to the batch's part
    counts = loss_fn.step_counts(micro, STEP)
    shares = [loss_fn.micro_loss(model, m, STEP, None, counts)[1]["target"] for m in micro]
    torch.testing.assert_close(sum(shares), parts["target"])
    # by key, as summary.json writes them (a YAML file's), the same weights
    by_key = category_weights({"environment=env0": 4.0, "env1": 0.25, "environment=env2": 2.0}, data.target)
    assert by_key == loss_fn.category_weights == {
        "environment=env0": 4.0, "environment=env1": 0.25, "environment=env2": 2.0
    }  # fmt: skip


def pinball_each(predicted, standard):
    from aamperf.model.loss import pinball

    return pinball(predicted, standard, [0.1, 0.5, 0.9])


def test_a_classification_s_weights_multiply_its_class_weights(make_cfg, tmp_path):
    """Target: a copy of the environment column (`habitat`); weights by environment and by class at once:
    sum(category weight x class weight x CE) / sum(class weight)."""
    data, *_ = target_setup(make_cfg, "data.target=target")
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0)
    metadata["habitat"] = metadata["environment"]
    metadata.to_csv(tmp_path / "m.tsv", sep="\t")
    files = [f"data.table={data.files['table']}", f"data.tree={data.files['tree']}"]
    data, model, loss_fn, batch = target_setup(
        make_cfg, "data=biom", *files, f"data.metadata={tmp_path / 'm.tsv'}", "data.target=habitat",
        *BY_ENV, "loss.category_weights={env0:3.0}", "loss.class_weights=[1.0,2.0,0.5,1.5]",
        "model.dropout=0",
    )  # fmt: skip
    _, parts = loss_fn(model, batch, STEP)
    out, _ = loss_fn.outputs(model, batch, STEP)
    labels = batch["target"].squeeze(1).long()
    classes = torch.tensor([1.0, 2.0, 0.5, 1.5])
    ce = F.cross_entropy(out["target"], labels, weight=classes, reduction="none")
    w = torch.tensor([3.0 if e == "env0" else 1.0 for e in environments(data, batch["sample_idx"].tolist())])
    assert (w != 1).any() and (w == 1).any()
    torch.testing.assert_close(parts["target"], (w * ce).sum() / classes[labels].sum())


def test_a_run_with_category_weights_records_them(make_cfg, tmp_path):
    overrides = ["data.target=target", *BY_ENV, "loss.category_weights=balanced", "trainer.max_steps=3"]
    summary = train(make_cfg(*overrides), tmp_path)
    assert summary["status"] == "completed", summary.get("error")
    target = read_summary(tmp_path)["target"]
    assert target["weight_by"] == ["environment"] and sorted(target["category_weights"]) == [
        f"environment=env{k}" for k in range(4)
    ]


def test_the_refusals(make_cfg, launch_here):
    with pytest.raises(UserError, match=r"name them, data\.weight_by=\[<column>,\.\.\.\]"):
        check_config(make_cfg("data.target=target", "loss.category_weights=balanced"))
    with pytest.raises(UserError, match=r"is read by loss\.category_weights \(it is null\)"):
        check_config(make_cfg("data.target=target", *BY_ENV))
    with pytest.raises(UserError, match=r"data\.weight_by: 'target' is data\.target itself"):
        check_config(
            make_cfg("data.target=target", "data.weight_by=[target]", "loss.category_weights=balanced")
        )
    for bad in ("{env0:-1.0}", "{env0:heavy}", "often", "[1.0,2.0]"):
        with pytest.raises(UserError, match=r"category_weights=.* must be null, balanced or a mapping"):
            check_config(make_cfg("data.target=target", *BY_ENV, f"loss.category_weights={bad}"))
    with pytest.raises(UserError, match=r"names 'env7', not a category .* \(env0, env1, env2, env3\)"):
        target_setup(make_cfg, "data.target=target", *BY_ENV, "loss.category_weights={env7:2.0}")
    proc, _ = launch_here("data.target=target", "data.weight_by=[site]", "loss.category_weights=balanced")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: data.weight_by: no column 'site' in ")
