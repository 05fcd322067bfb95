"""A whole run through train(cfg, run_dir): the run record is complete and honest."""

import itertools
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import read_metrics, read_summary
from plugin_model import EmbeddingModel

from aamperf.data import build_data
from aamperf.distributed import World
from aamperf.errors import UserError
from aamperf.job import analytic_flops, build, counted_flops, counted_forward
from aamperf.metrics.monitor import pss_bytes
from aamperf.phases import apply_phases, setup_phases
from aamperf.run import train
from aamperf.summary import DURATION_PARTS

# The run record's keys that the checks and `python -m aamperf.compare` read (docs/run-outputs.md).
SUMMARY_KEYS = {
    "status",
    "optim",
    "precision",
    "device",
    "machine",
    "world_size",
    "steps",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "step_time_median_s",
    "flops_per_step",
    "model_flops_per_step",
    "hardware_flops_per_step",
    "mfu",
    "hfu",
    "peak_flops",
    "peak_flops_calibration",
    "peak_rss_bytes",
    "peak_tree_pss_bytes",
    "peak_device_bytes",
    "setup_peak_device_bytes",
    "data_wait_frac",
    "compile_time_s",
    "warmup_excess_s",
    "auto_s",
    "time_to_first_step_s",
    "train_loss",
    "val_loss",
    "nonfinite_steps",
    "phases",
    "error",
}
# Null is allowed only where no such thing exists on this machine (CPU run).
MAY_BE_NULL = {"peak_device_bytes", "setup_peak_device_bytes", "error"}


def test_three_step_run_writes_a_complete_summary(make_cfg, tmp_path):
    train(make_cfg("metrics.peak_flops=null"), tmp_path)  # the CPU's peak calibrated, as a user's run does
    summary = read_summary(tmp_path)
    assert SUMMARY_KEYS <= summary.keys()
    assert [k for k in SUMMARY_KEYS - MAY_BE_NULL if summary[k] is None] == []
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["device"] == "cpu"
    cpu_model = Path("/proc/cpuinfo").read_text().split("model name", 1)[1].split(":", 1)[1].split("\n")[0]
    assert summary["machine"].startswith(f"{platform.node()}: {cpu_model.strip()} (")  # the report names it
    assert summary["samples_per_s"] > 0 and summary["tokens_per_s"] > summary["samples_per_s"]
    assert 0 < summary["mfu"] <= 1 and 0 < summary["hfu"] <= 1
    assert summary["flops_per_step"] == summary["model_flops_per_step"]
    # optim=baseline pads every batch to data.max_asvs: the sample encoder runs over padding slots
    assert summary["hardware_flops_per_step"] > summary["model_flops_per_step"]
    calibration = summary["peak_flops_calibration"]
    statuses = ("this_run", "best_cached", "cache", "this_run_under_load")
    assert calibration["status"] in statuses and calibration["reason"]
    assert (
        calibration["dtype"] == "fp32"
        and calibration["threads"] >= 1
        and len(calibration["loadavg_before"]) == 3
    )
    assert summary["peak_flops"] == (
        calibration["cached"]["peak_flops"]
        if calibration["status"] in ("cache", "best_cached")
        else calibration["peak_flops"]
    )
    assert summary["peak_rss_bytes"] > 100 * 2**20  # torch alone is bigger than this
    assert summary["nonfinite_steps"] == 0
    assert summary["auto_s"] == 0.0  # optim=baseline: no `auto` option, nothing measured to decide one
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
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # the loop below checks these, not no line
    for row in rows:  # every optimizer step saw the whole batch of 8
        assert row["samples_per_s"] * row["step_time_s"] == pytest.approx(8)
    assert summary["steps"] == 4


def test_a_target_in_thousands_is_standardized_for_the_loss_and_reported_in_its_units(make_cfg, tmp_path):
    """The same samples with the target as it is and as 1000 x target + 5000: the loss standardizes it
    with the training samples' mean and std, so both runs train the same (a raw MSE in thousands would
    swamp UniFrac's part a millionfold); the error is reported in the target's own units."""
    import pandas as pd

    plain = train(make_cfg("trainer.max_steps=4"), tmp_path / "plain")
    cfg = make_cfg()
    files = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader).files  # the simulated files
    metadata = pd.read_csv(files["metadata"], sep="\t", index_col=0)
    metadata["target"] = metadata["target"] * 1000 + 5000
    metadata.to_csv(tmp_path / "thousands.tsv", sep="\t")
    table, tree = files["table"], files["tree"]
    biom = [
        "data=biom",
        f"data.table={table}",
        f"data.tree={tree}",
        f"data.metadata={tmp_path / 'thousands.tsv'}",
    ]
    scaled = train(
        make_cfg("trainer.max_steps=4", *biom, "data.target=target", "data.rarefy_depth=500"),
        tmp_path / "scaled",
    )
    assert 4000 < scaled["target"]["mean"] and scaled["target"]["std"] == pytest.approx(
        1000 * plain["target"]["std"], rel=1e-4
    )
    for key in ("val_loss", "val_unifrac", "val_nucleotide", "val_target"):
        assert scaled["val"][key] == pytest.approx(plain["val"][key], rel=1e-3), key
    assert scaled["val"]["val_target_mae"] == pytest.approx(1000 * plain["val"]["val_target_mae"], rel=1e-3)
    assert scaled["val"]["val_target_r2"] == pytest.approx(plain["val"]["val_target_r2"], abs=1e-3)
    assert scaled["val"]["val_target"] < 10  # standard units: the same order as UniFrac's and nucleotides'


def test_failed_run_still_writes_summary_with_error(make_cfg, tmp_path):
    with pytest.raises(UserError, match="trainer.batch_size"):
        train(make_cfg("trainer.batch_size=1"), tmp_path)
    summary = read_summary(tmp_path)
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


def step_flops(make_cfg, *overrides: str) -> tuple[float, float]:
    """(model, hardware) FLOPs per step of the first batches as train() counts them, under `overrides`."""
    cfg = make_cfg(*overrides)
    device = torch.device("cpu")
    setup = setup_phases(cfg, device)
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=setup.loader, pad_to=setup.pad_to)
    model = build(cfg, "model")
    apply_phases(model, cfg, device, lambda *args: None, setup.records, World(), 4)
    return analytic_flops(model, list(itertools.islice(data.train_loader, 3)))


def test_model_flops_are_the_same_for_every_configuration_of_the_same_batches(make_cfg):
    fewer = "data.mean_richness=8"  # samples of fewer than data.max_asvs=16 ASVs: padding to skip
    flops = {
        name: step_flops(make_cfg, fewer, *overrides)
        for name, overrides in {
            "plain": ["aam_ops=plain", "memory=none"],
            "padding_aware": ["aam_ops=padding_aware", "memory=none"],
            "dedup": ["aam_ops=dedup", "memory=none"],
            "fast": ["aam_ops=fast", "memory=none"],
            "bf16": ["precision=bf16", "memory=none"],
            "checkpointing": ["memory=full"],  # the baseline's: every layer recomputed
        }.items()
    }
    model = {f[0] for f in flops.values()}
    assert len(model) == 1, flops  # MFU is the same work for every configuration
    hardware = {name: f[1] for name, f in flops.items()}
    assert hardware["bf16"] == hardware["plain"]  # the same matmuls, in another dtype
    assert hardware["plain"] > hardware["padding_aware"]  # plain pads every batch to data.max_asvs
    assert hardware["dedup"] < hardware["plain"] and hardware["fast"] < hardware["padding_aware"]
    assert hardware["fast"] < model.pop()  # each distinct ASV once: less executed than the math
    # memory=full: every layer's forward once more (forward = a third of forward + backward)
    assert hardware["checkpointing"] == pytest.approx(hardware["plain"] * 4 / 3, rel=0.03)


def test_counting_a_plug_in_model_s_flops_leaves_the_run_s_random_stream_as_it_was():
    """torch counts another model's step before training; its dropout draws must not shift the run's."""
    from aamperf.model import AAMLoss

    model = EmbeddingModel(8, dropout=0.5)
    batch = {
        "tokens": torch.randint(1, 5, (4, 6, 151)),
        "counts": torch.ones(4, 6, 1),
        "asv_ids": torch.arange(24).view(4, 6),
        "sample_idx": torch.arange(4),
        "unifrac": torch.rand(4, 4),
    }
    before = torch.get_rng_state()
    assert counted_flops(model, AAMLoss(), batch) > 0 and counted_forward(model, AAMLoss(), batch) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_an_mfu_above_one_is_null_with_a_reason(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(
        "aamperf.job.peak_flops", lambda *args: (1e3, {"status": "this_run_under_load", "reason": "loaded"})
    )
    summary = train(make_cfg("trainer.max_steps=2", "metrics.peak_flops=null"), tmp_path)
    assert summary["status"] == "completed" and summary["peak_flops"] == 1e3
    assert summary["mfu"] is None and summary["hfu"] is None
    assert "peak_flops=1e+03" in summary["hfu_error"] and "this_run_under_load" in summary["hfu_error"]
    assert summary["mfu_error"].startswith("mfu=") and "peak_flops" in summary["mfu_error"]
    assert read_summary(tmp_path)["mfu_error"] == summary["mfu_error"]


GNU_TIME = ["/usr/bin/time", "-v", sys.executable]  # `/usr/bin/time -v python -m aamperf.train`


def first_line_seen(proc: subprocess.Popen, metrics: Path, on_poll=lambda: None) -> float:
    """Wall-clock time at which the run's first metrics line appeared, polled from outside."""
    while proc.poll() is None:
        on_poll()
        if metrics.exists() and metrics.read_text().endswith("\n"):
            return time.time()
        time.sleep(0.01)
    raise AssertionError(proc.stderr.read())


@pytest.mark.skipif(not Path("/usr/bin/time").exists(), reason="needs GNU time (/usr/bin/time -v)")
def test_times_and_peak_memory_agree_with_an_outside_clock_and_gnu_time(launch):
    launched = time.time()
    overrides = ("trainer.max_steps=4", "metrics.skip_steps=1", "trainer.checkpoint_every=2")
    proc, run_dir = launch(*overrides, launcher=GNU_TIME, wait=False)
    first_line = first_line_seen(proc, run_dir / "metrics.jsonl") - launched
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    summary = read_summary(run_dir)
    written = (run_dir / "summary.json").stat().st_mtime - launched
    # From the process's start (imports and Hydra's composition included), as the outside clock sees it.
    assert written - 0.5 < summary["duration_s"] <= written + 0.05
    assert first_line - 0.5 < summary["time_to_first_step_s"] <= first_line + 0.05
    rows = read_metrics(run_dir)
    assert rows[0]["elapsed_s"] == pytest.approx(summary["time_to_first_step_s"], abs=0.3)
    assert all("elapsed_s" in r for r in rows) and rows[-1]["elapsed_s"] < summary["duration_s"]
    # Throughput over the timed steps (4 - 1 warm-up) of 4 samples each, by one statistic.
    assert summary["timed_steps"] == 3
    assert summary["samples_per_s"] * summary["timed_s"] == pytest.approx(3 * 4)
    assert summary["samples_per_s"] * summary["step_time_s"] == pytest.approx(4)
    # Where the duration went: parts that add up to it, each timed where it happens.
    parts = summary["duration_parts_s"]
    assert list(parts) == list(DURATION_PARTS) and min(parts.values()) > -0.01
    assert sum(parts.values()) == pytest.approx(summary["duration_s"], abs=0.01)
    assert parts["start"] > 0.5 and parts["validation"] > 0 and parts["checkpoints"] > 0  # torch's import
    assert parts["auto"] == summary["auto_s"] == 0.0  # nothing `auto` at the tests' settings
    assert summary["timed_s"] < parts["steps"] < summary["timed_s"] + 5  # + the warm-up step's
    before_loop = parts["start"] + parts["setup"] + parts["auto"] + parts["data"]
    assert before_loop < summary["time_to_first_step_s"] <= before_loop + parts["steps"] + parts["loop"]
    # peak_rss_bytes is this process's VmHWM: GNU time's "Maximum resident set size" (no children here)
    gnu = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1)) * 1024
    assert summary["peak_rss_bytes"] == pytest.approx(gnu, rel=0.03)


def tree_pss(pid: int) -> int:
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        return sum(pss_bytes(p.pid) for p in procs)
    except (psutil.Error, OSError):
        return 0


@pytest.mark.slow  # ~7.5 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_peak_tree_pss_agrees_with_the_tree_polled_from_outside(launch):
    """With a loader worker (dataloader=tuned): the sampled peak of the tree's summed PSS, as a poller
    outside the run (this test, reading /proc/<pid>/smaps_rollup like `smem`) sees it over the loop."""
    proc, run_dir = launch("trainer.max_steps=5", "dataloader=tuned", launcher=GNU_TIME, wait=False)
    python = lambda: next(iter(psutil.Process(proc.pid).children()), None)  # noqa: E731 (under time)
    first_line_seen(proc, run_dir / "metrics.jsonl")
    child = python()
    outside, workers = 0, 0
    while proc.poll() is None and not (run_dir / "summary.json").exists():
        outside = max(outside, tree_pss(child.pid))
        workers = max(workers, len(child.children(recursive=True)))
        time.sleep(0.1)  # the run's own sampling period is 0.2 s (metrics.monitor_interval_s)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    summary = read_summary(run_dir)
    assert workers >= 1  # the worker was there and in both figures
    assert 0.85 * outside < summary["peak_tree_pss_bytes"] < 1.15 * outside


def test_val_target_mae_and_r2_are_those_of_the_samples_validated(make_cfg, launch):
    """A validation runs on whole batches (trainer.val_batches=1: the first batch of 4), not on every
    validation sample (5 here, after rarefaction). Its MAE and R^2 (summary.json and the line the run
    ends with) are scikit-learn's of those 4 samples, predicted again here from model.pt under the
    validation's nucleotide mask (step 0)."""
    import numpy as np
    from sklearn.metrics import mean_absolute_error, r2_score

    from aamperf.model.masking import nucleotide_mask
    from aamperf.tokens import MASK
    from aamperf.weights import load_model

    proc, run_dir = launch("trainer.val_batches=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(run_dir)
    cfg = make_cfg("trainer.val_batches=1")
    data = build_data(cfg.data, batch_size=cfg.trainer.batch_size, seed=cfg.seed, loader=cfg.dataloader)
    batch = next(iter(data.val_loader))
    n_val = summary["n_val"]
    assert len(batch["target"]) == 4 < data.n_val == n_val  # a subset: the R^2 of the issue mixed them
    model, _ = load_model(run_dir)
    hidden = nucleotide_mask(batch["tokens"], batch["asv_ids"], 0, cfg.loss.seed, cfg.loss.mask_fraction)
    with torch.no_grad():
        out = model(batch["tokens"].masked_fill(hidden, MASK), batch["counts"], asv_ids=batch["asv_ids"])
    scale = summary["target"]
    predicted = (out["target"].squeeze(1) * scale["std"] + scale["mean"]).double().numpy()
    observed = batch["target"].squeeze(1).double().numpy()
    mae, r2 = mean_absolute_error(observed, predicted), r2_score(observed, predicted)
    rmse = float(np.sqrt(np.mean((observed - predicted) ** 2)))
    val = summary["val"]
    assert val["val_samples"] == 4
    assert val["val_target_mae"] == pytest.approx(mae, rel=1e-5)
    assert val["val_target_r2"] == pytest.approx(r2, abs=1e-5)
    assert read_metrics(run_dir)[-1]["val_target_r2"] == val["val_target_r2"]  # logged as summarised
    said = [line for line in proc.stdout.splitlines() if line.startswith("  target ")]
    assert said == [
        f"  target target: val MAE {mae:.4g}, RMSE {rmse:.4g} (its own units), R^2 {r2:.3f}, over 4 of "
        f"the {n_val} "
        "validation samples (trainer.val_batches=1)"
    ]


def test_top_level_precision_is_what_the_run_trained_in_and_what_was_asked_is_kept(make_cfg, tmp_path):
    """precision=auto: summary.json `precision` is the dtype the run decided and trained in (as `device`
    is the device it ran on), `requested` what the command asked for."""
    train(make_cfg("precision=auto"), tmp_path)
    summary = read_summary(tmp_path)
    decision = summary["phases"]["precision"]["auto"]
    assert decision["chose"] in ("bf16", "fp32")
    assert summary["precision"] == decision["chose"] == summary["config"]["precision"]["dtype"]
    assert summary["requested"] == {"precision": "auto", "device": "cpu"}
