"""trainer.batch_size=auto: the largest batch whose measured step fits the memory budget, with the
requested effective batch kept by accumulation, and a run that starts as if the batch had been given."""

import psutil
import pytest
import torch
from conftest import read_metrics, read_summary

from aamperf.batch_size import check_budget
from aamperf.guards import memory_limit
from aamperf.run import train


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_auto_batch_fits_the_budget_and_keeps_the_effective_batch(launch):
    # A budget of ~0.65 GiB: a few tiny batches fit, a batch of the whole training set does not.
    vm = psutil.virtual_memory()
    fraction = 0.65 * 2**30 / vm.available
    proc, run_dir = launch(
        "trainer.batch_size=auto",
        f"trainer.auto_batch.budget_fraction={fraction:.5f}",
        "trainer.auto_batch.effective_batch=32",
        "data.n_samples=120",  # a step's 32 samples are drawn whole: more than TINY's ~20 training samples
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = read_summary(run_dir)
    found = summary["batch_finder"]
    assert found["limited_by"] == "memory"
    fitting = [p for p in found["probes"] if p["fits"]]
    too_big = [p for p in found["probes"] if not p["fits"]]
    assert all(p["peak_bytes"] <= found["budget_bytes"] for p in fitting)  # measured, not assumed
    assert max(p["batch"] for p in fitting) == found["largest_fitting"] < min(p["batch"] for p in too_big)
    # 32 samples per step, in micro-batches no larger than what fits
    assert found["batch_size"] == 32 and found["micro_batch"] * found["grad_accum_steps"] == 32
    assert found["micro_batch"] <= found["largest_fitting"] and found["grad_accum_steps"] >= 2
    trainer = summary["config"]["trainer"]
    assert (trainer["batch_size"], trainer["grad_accum_steps"]) == (32, found["grad_accum_steps"])
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]  # the check below is of these lines, not of none
    assert all(abs(r["samples_per_s"] * r["step_time_s"] - 32) < 1e-6 for r in rows)  # trained at 32


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_auto_batch_run_trains_like_the_batch_given(make_cfg, tmp_path):
    """The probes leave no trace: weights, optimizer state, random draws and data order as before."""
    train(make_cfg("trainer.batch_size=8", "trainer.max_steps=4"), tmp_path / "given")
    auto = train(
        make_cfg("trainer.batch_size=auto", "trainer.auto_batch.max_batch=8", "trainer.max_steps=4"),
        tmp_path / "auto",
    )
    assert auto["batch_finder"]["batch_size"] == 8 and auto["batch_finder"]["limited_by"] == "max_batch"
    assert [p["batch"] for p in auto["batch_finder"]["probes"]] == [2, 4, 8]

    def losses(run_dir):
        return [(r["loss"], r.get("val_loss")) for r in read_metrics(run_dir)]

    given = losses(tmp_path / "given")
    assert losses(tmp_path / "auto") == given and len(given) == 4


def test_a_fixed_budget_above_what_a_rank_can_have_is_refused(monkeypatch):
    """Refused, not capped: budget_gib is meant to be the same on every machine, and a capped one would
    find the batch this machine fits instead. The ranks of a machine share its memory."""
    limit, set_by = memory_limit()
    what = "this machine's RAM" if set_by == "machine" else "this process's cgroup limit"
    cpu, within = torch.device("cpu"), 0.75 * limit / 2**30
    assert check_budget(within, cpu) == [] and check_budget(None, cpu) == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    [problem] = check_budget(within, cpu)
    assert problem.startswith(
        f"trainer.auto_batch.budget_gib={within} is more than a rank can have here ({limit // 2 / 2**30:.2f} "
        f"GiB: {what} shared by its 2 ranks); lower it"
    )
