"""Early stopping and the best model (trainer.patience, trainer.monitor, trainer.min_delta,
trainer.keep_best): a run ends after `patience` validations without improving, and with keep_best its
model.pt and validation figures are its best validation's, across a resume too."""

import pytest
import torch
from conftest import read_metrics, read_summary, weights_of
from omegaconf import OmegaConf

from aamperf.errors import UserError
from aamperf.run import train
from aamperf.trainer.best import Best

# validated every 2 steps; min_delta that no validation clears: the first is the best, every later one
# does not improve on it, whatever the losses are
NEVER_BETTER = ["trainer.max_steps=12", "trainer.val_every=2", "trainer.min_delta=1e9"]


def vals(run_dir) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(run_dir) if "val_loss" in row}


def test_patience_ends_the_run_after_that_many_validations_without_improving(make_cfg, tmp_path):
    summary = train(make_cfg(*NEVER_BETTER, "trainer.patience=2"), tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 6  # the best at 2, then 4 and 6
    assert summary["best"] == {
        "monitor": "val_loss",
        "mode": "min",
        "step": 2,
        "value": vals(tmp_path)[2]["val_loss"],
        "stopped_early_at": 6,
        "patience": 2,
        "kept": False,
    }
    assert max(row["step"] for row in read_metrics(tmp_path)) == 6
    assert summary["val_loss"] == vals(tmp_path)[6]["val_loss"]  # without keep_best: the last validation's


def test_without_patience_the_run_trains_every_step_and_records_no_best(make_cfg, tmp_path):
    summary = train(make_cfg(*NEVER_BETTER), tmp_path)
    assert summary["steps"] == 12 and summary["best"] is None


def test_keep_best_keeps_the_best_validations_weights_and_figures(make_cfg, tmp_path):
    """The step-2 validation is the best: model.pt holds the weights of step 2's checkpoint, and the
    run's val figures are step 2's, though it trained on to step 6."""
    cfg = make_cfg(
        *NEVER_BETTER, "trainer.patience=2", "trainer.keep_best=true", "trainer.checkpoint_every=2",
        "trainer.keep_last=5",
    )  # fmt: skip
    summary = train(cfg, tmp_path)
    assert summary["steps"] == 6 and summary["best"]["step"] == 2 and summary["best"]["kept"]
    at_2 = torch.load(tmp_path / "checkpoints" / "step_00000002.pt", weights_only=True)["model"]
    at_6 = torch.load(tmp_path / "checkpoints" / "step_00000006.pt", weights_only=True)["model"]
    kept = weights_of(tmp_path)
    assert kept.keys() == at_2.keys()
    assert all(torch.equal(kept[name], at_2[name]) for name in kept)
    assert any(not torch.equal(kept[name], at_6[name]) for name in kept)  # trained on after it
    assert summary["val_loss"] == vals(tmp_path)[2]["val_loss"] != vals(tmp_path)[6]["val_loss"]
    # the target figures and the predictions file are that validation's too
    assert summary["val"]["val_target_mae"] == vals(tmp_path)[2]["val_target_mae"]


def test_a_resume_goes_on_counting_and_keeps_the_best_it_had(make_cfg, tmp_path):
    """Stopped after step 4 (a checkpoint there), resumed to its 12 steps: it stops at step 6 as the
    uninterrupted run does, and model.pt holds the same step-2 weights, kept in the checkpoint."""
    same = [*NEVER_BETTER, "trainer.lr_schedule=constant", "trainer.patience=2", "trainer.keep_best=true"]
    whole = train(make_cfg(*same), tmp_path / "whole")
    resumable = [*same, "trainer.checkpoint_every=4", "trainer.resume=auto"]
    first = train(make_cfg(*resumable, "trainer.max_steps=4"), tmp_path / "resumed")
    assert first["steps"] == 4 and first["best"]["stopped_early_at"] is None
    resumed = train(make_cfg(*resumable), tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 4
    assert resumed["best"] == whole["best"] and resumed["steps"] == whole["steps"] == 6
    kept, expected = weights_of(tmp_path / "resumed"), weights_of(tmp_path / "whole")
    assert all(torch.equal(kept[name], expected[name]) for name in expected)
    assert read_summary(tmp_path / "resumed")["val_loss"] == whole["val_loss"]


def test_a_run_started_again_from_the_checkpoint_of_its_early_stop_trains_nothing_more(make_cfg, tmp_path):
    """Killed after the checkpoint of its stop, before its summary (a requeued job): started again, it
    goes on from that checkpoint and ends there, as it had."""
    cfg = make_cfg(*NEVER_BETTER, "trainer.patience=2", "trainer.checkpoint_every=2", "trainer.resume=auto")
    assert train(cfg, tmp_path)["steps"] == 6
    (tmp_path / "summary.json").unlink()
    (tmp_path / "model.pt").unlink()
    again = train(cfg, tmp_path)
    assert again["resumed_from_step"] == 6 and again["steps"] == 6 and again["status"] == "completed"
    assert again["best"]["stopped_early_at"] == 6 and max(row["step"] for row in read_metrics(tmp_path)) == 6
    assert (tmp_path / "model.pt").exists()


def test_kept_says_whether_model_pt_holds_the_best(make_cfg):
    tc = OmegaConf.create({"monitor": "val_roc_auc", "patience": 0, "min_delta": 0.0, "keep_best": True})
    watched = Best(tc, torch.nn.Linear(1, 1))
    watched.update(2, {"val_roc_auc": None}, {})  # no figure at any validation: no best to keep
    assert watched.step is None and watched.record()["kept"] is False


def test_a_monitor_the_validation_does_not_have_is_one_line_naming_those_it_has(make_cfg, tmp_path):
    with pytest.raises(
        UserError, match="trainer.monitor=val_loss_foo is not a figure of this run's validation"
    ):
        train(make_cfg("trainer.patience=1", "trainer.monitor=val_loss_foo"), tmp_path)


@pytest.mark.parametrize(
    ("monitor", "values", "best"),
    [
        ("val_loss", [3.0, 2.0, 2.5], 2.0),
        ("val_target_mae", [0.3, 0.2, 0.25], 0.2),
        ("val_target_r2", [0.1, 0.4, 0.2], 0.4),
        ("val_accuracy", [0.5, 0.7, 0.6], 0.7),
        ("val_macro_f1", [0.5, 0.4, 0.6], 0.6),
        ("val_roc_auc", [0.6, None, 0.5], 0.6),  # no figure (one class validated): no improvement
    ],
)
def test_each_figure_improves_its_own_way(monitor, values, best):
    tc = OmegaConf.create({"monitor": monitor, "patience": 5, "min_delta": 0.0, "keep_best": False})
    watched = Best(tc, torch.nn.Linear(1, 1))
    for step, value in enumerate(values, 1):
        watched.update(step, {monitor: value}, {})
    assert watched.value == best and watched.since == len(values) - values.index(best) - 1
