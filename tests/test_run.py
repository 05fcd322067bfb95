"""A whole run through train(cfg, run_dir): the run record is complete and honest."""

import json

import pytest

from aamperf.errors import UserError
from aamperf.run import train

# DESIGN.md section 7: the keys the checks rely on.
SUMMARY_KEYS = {
    "status",
    "optim",
    "precision",
    "device",
    "world_size",
    "steps",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "flops_per_step",
    "mfu",
    "peak_rss_bytes",
    "peak_device_bytes",
    "data_wait_frac",
    "compile_time_s",
    "time_to_first_step_s",
    "train_loss",
    "val_loss",
    "nonfinite_steps",
    "phases",
    "error",
}
# Null is allowed only where no such thing exists on this machine (CPU run).
MAY_BE_NULL = {"peak_device_bytes", "error"}


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_step_run_writes_a_complete_summary(make_cfg, tmp_path):
    train(make_cfg(), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert [k for k in SUMMARY_KEYS - MAY_BE_NULL if summary[k] is None] == []
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["device"] == "cpu"
    assert summary["samples_per_s"] > 0 and summary["tokens_per_s"] > summary["samples_per_s"]
    assert 0 < summary["mfu"] <= 1
    assert summary["peak_rss_bytes"] > 100 * 2**20  # torch alone is bigger than this
    assert summary["nonfinite_steps"] == 0
    assert summary["config"]["trainer"]["max_steps"] == 3
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["samples_per_s"] > 0 and r["loss"] > 0 for r in rows)
    assert "val_loss" in rows[1] and "val_loss" in rows[2] and "val_loss" not in rows[0]
    assert summary["val_loss"] == rows[2]["val_loss"] and summary["train_loss"] == rows[2]["loss"]


def test_same_seed_same_losses_other_seed_other_losses(make_cfg, tmp_path):
    losses = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train(make_cfg(f"seed={seed}"), tmp_path / name)
        losses[name] = [(r["loss"], r.get("val_loss")) for r in read_metrics(tmp_path / name)]
    assert losses["a"] == losses["b"]
    assert losses["a"] != losses["c"]


def test_gradient_accumulation_splits_the_batch_into_micro_batches(make_cfg, tmp_path):
    summary = train(
        make_cfg("trainer.grad_accum_steps=2", "trainer.batch_size=8", "trainer.max_steps=4"), tmp_path
    )
    one = train(make_cfg("trainer.batch_size=4", "trainer.max_steps=4"), tmp_path / "one")
    # two micro-batches of 4: the FLOPs of two forward + backward passes of batch 4 (same batches first)
    assert summary["flops_per_step"] == pytest.approx(2 * one["flops_per_step"], rel=0.25)
    for row in read_metrics(tmp_path):  # every optimizer step saw the whole batch of 8
        assert row["samples_per_s"] * row["step_time_s"] == pytest.approx(8)
    assert summary["steps"] == 4


def test_failed_run_still_writes_summary_with_error(make_cfg, tmp_path):
    with pytest.raises(UserError, match="trainer.batch_size"):
        train(make_cfg("trainer.batch_size=1"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "trainer.batch_size" in summary["error"]


def test_config_problems_are_reported_together(make_cfg, tmp_path):
    with pytest.raises(UserError) as err:
        train(make_cfg("trainer.max_steps=0", "trainer.lr=-1", "data.max_asvs=32"), tmp_path)
    message = str(err.value)
    assert "trainer.max_steps=0" in message and "trainer.lr=-1" in message and "data.max_asvs=32" in message
    assert "\n" not in message


def test_any_nn_module_trains_with_a_matching_loss(make_cfg, tmp_path):
    """model._target_ / loss._target_ plug in another model; its FLOPs are then counted by torch."""
    cfg = make_cfg(
        "~model",
        "+model._target_=plugin_model.MeanPoolModel",
        "+model.dim=8",
        "data.max_asvs=16",
        "~loss",
        "+loss._target_=plugin_model.pair_loss",
        "+loss._partial_=true",
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"
    assert summary["flops_per_step"] > 0 and summary["mfu"] > 0
    assert summary["train_loss"] > 0 and summary["val_loss"] > 0
