"""The run's guards: a non-finite step changes nothing and too many in a row stop the run (status
aborted, the last good state checkpointed); memory over memory.max_fraction stops the run too."""

import math
from pathlib import Path

import psutil
import pytest
import torch
from conftest import holding, read_metrics, read_summary
from omegaconf import OmegaConf

from aamperf.guards import MemoryGuard, NonfiniteGuard
from aamperf.run import train

EVERY_STEP = ["trainer.checkpoint_every=1", "trainer.keep_last=50", "trainer.max_steps=6"]


def poisoned(into: str, **where) -> list[str]:
    """The AAM loss with NaN at the given steps (tests/plugin_model.py)."""
    return ["loss._target_=plugin_model.PoisonedLoss", f"+loss.into={into}"] + [
        f"+loss.{key}={value}" for key, value in where.items()
    ]


def saved(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)


def same_state(a: dict, b: dict) -> bool:
    """Equal model weights and optimizer state (moments and step counts)."""
    flat = [(a["model"], b["model"])] + [
        (a["optimizer"]["state"][i], b["optimizer"]["state"][i]) for i in a["optimizer"]["state"]
    ]
    return all(torch.equal(x[k], y[k]) for x, y in flat for k in x)


def rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir)}


# the host reads the flag (for_loop) or the fused kernel skips the step (found_inf)
@pytest.mark.parametrize("optimizer", ["adamw_for_loop", "adamw_fused"])
@pytest.mark.parametrize("into", ["batch", "grad"])
def test_a_nonfinite_step_is_skipped_and_counted(make_cfg, tmp_path, optimizer, into):
    cfg = make_cfg(*EVERY_STEP, f"optimizer={optimizer}", *poisoned(into, steps="[3,4]"))
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["nonfinite_steps"] == 2
    assert summary["nonfinite_check"] == ("fused_optimizer" if optimizer == "adamw_fused" else "cpu_read")
    assert same_state(saved(tmp_path, 2), saved(tmp_path, 4))  # steps 3 and 4 changed nothing
    assert not same_state(saved(tmp_path, 4), saved(tmp_path, 5))  # step 5 trained again
    logged = rows(tmp_path)
    assert [logged[s]["nonfinite_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 0, 0]
    assert logged[3]["loss"] is None and logged[5]["loss"] is not None  # no finite step to average
    assert summary["val"]["val_loss"] is not None and all(p is not None for p in summary["val"].values())


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_nonfinite_steps_in_a_row_abort_with_the_last_good_state(launch):
    overrides = [*EVERY_STEP, "trainer.max_steps=12", "trainer.max_nonfinite=3", "metrics.log_every=2"]
    proc, run_dir = launch(*overrides, *poisoned("batch", from_step=5))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # steps 5, 6, 7 in a row; seen at the log line of step 8 (metrics.log_every=2)
    assert last.startswith("aborted: 3 non-finite steps in a row from step 5 (trainer.max_nonfinite=3)")
    assert "stopped at step 8" in last and "loss_unifrac=nan" in last and "step_00000008.pt" in last
    summary = read_summary(run_dir)
    assert summary["status"] == "aborted" and summary["nonfinite_steps"] == 4 and summary["steps"] == 8
    assert summary["error"] == last.removeprefix("aborted: ")
    assert same_state(saved(run_dir, 4), saved(run_dir, 8))  # the last good state
    assert max(rows(run_dir)) == 8


def test_a_nonfinite_validation_loss_aborts_the_run_at_that_validation(launch):
    """NaN in the validation batches alone (the loss's step 0; every training step finite): the run stops
    at its validation of step 2 (trainer.val_every=2) as a guard stops it, exit 3, one line naming the
    step and the figures that are not finite, the state of that step kept."""
    proc, run_dir = launch(*poisoned("batch", steps="[0]"))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("aborted: validation of step 2 not finite: val_loss=nan, val_unifrac=nan;")
    assert "step_00000002.pt" in last
    summary = read_summary(run_dir)
    assert summary["status"] == "aborted" and summary["steps"] == 2 and summary["nonfinite_steps"] == 0
    assert summary["error"] == last.removeprefix("aborted: ")
    assert max(rows(run_dir)) == 2 and rows(run_dir)[2]["val_loss"] is None  # logged as seen: NaN is null


def test_grad_scaler_backs_off_on_a_nonfinite_step():
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(layer.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # fp16's scaler; here on CPU
    guard = NonfiniteGuard(optimizer, scaler, torch.device("cpu"), limit=3)
    before = [p.detach().clone() for p in layer.parameters()]
    loss = layer(torch.full((2, 4), float("inf"))).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(list(layer.parameters()), 1.0)
    bad = guard.step(1, loss.detach()[None], grad_norm)
    assert guard.check == "grad_scaler" and bad.item()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    assert scaler.get_scale() == 512.0


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_memory_over_max_fraction_checkpoints_and_stops(launch):
    total = psutil.virtual_memory().total  # the limit: no cgroup limit here (else, adjust)
    used = 0.6 * 2**30 / total  # the run's own memory: ~0.5 GiB at its start
    limit = round(used + 1.5 * 2**30 / total, 4)  # 1.5 GiB more; the loss keeps 256 MiB more each step
    proc, run_dir = launch(
        "trainer.max_steps=60",
        "loss._target_=plugin_model.LeakyLoss",
        "+loss.mb_per_step=256",
        f"memory.warn_fraction={used + 0.5 * 2**30 / total:.4f}",
        f"memory.max_fraction={limit}",
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("aborted: memory at ") and f"memory.max_fraction={limit:g}" in last
    summary = read_summary(run_dir)
    assert summary["status"] == "aborted" and 2 <= summary["steps"] < 60
    assert summary["memory_cleanups"] == 1  # warn_fraction was crossed first: gc and a warning
    assert "memory.warn_fraction" in (run_dir / "train.log").read_text()
    assert (run_dir / "checkpoints" / f"step_{summary['steps']:08d}.pt").exists()


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_another_programs_memory_warns_but_does_not_stop_the_run(launch):
    """The guard measures the run's own memory: a program beside it holding 3 GiB pushes the machine
    over memory.max_fraction, which is a warning, not a stop."""
    with holding("b = bytearray(3 << 30); b[::4096] = b'x' * len(b[::4096])"):  # 3 GiB, touched
        vm = psutil.virtual_memory()
        machine = 1 - vm.available / vm.total
        limit = machine - 2 * 2**30 / vm.total  # the machine is over it (the 3 GiB); the run far below
        proc, run_dir = launch(f"memory.max_fraction={limit:.4f}", "memory.warn_fraction=1.0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["memory_limit_source"] in ("machine", "cgroup")
    assert "by other processes too" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize(("name", "counted"), [(b"wandb-service", False), (b"loader-worker", True)])
def test_the_memory_guard_counts_its_workers_but_not_the_loggers_process(name, counted):
    guard = MemoryGuard(OmegaConf.create({"warn_fraction": 1.0, "max_fraction": 1.0}), torch.device("cpu"))
    alone = guard.run_bytes()
    # a child of this process holding 512 MiB, named (Linux's comm) as W&B's service or a worker is
    child = f"import ctypes; ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0); b = b'x' * (512 << 20)"
    with holding(child):
        guard._children_at = -math.inf  # list the children again now
        grown = guard.run_bytes() - alone
    assert (grown > 400 << 20) is counted, grown


def test_memory_guard_cleans_once_per_crossing():
    limits = OmegaConf.create({"warn_fraction": 1e-6, "max_fraction": 1.0})  # any use crosses warn
    guard = MemoryGuard(limits, torch.device("cpu"), interval_s=0.0)
    assert guard.check() is None
    assert guard.check() is None
    assert guard.cleanups == 1  # still above: no second clean-up, so it never runs every step
    guard.warn_fraction = 1.0
    guard.check()
    guard.warn_fraction = 1e-6
    guard.check()
    assert guard.cleanups == 2


def test_memory_guard_says_stop_above_max_and_reads_at_most_every_interval():
    guard = MemoryGuard(
        OmegaConf.create({"warn_fraction": 1.0, "max_fraction": 1.0}), torch.device("cpu"), interval_s=60
    )
    assert guard.check() is None  # the first read: below 100%
    guard.max_fraction = 1e-6
    assert guard.check() is None  # read 0 s ago: not read again
    guard.interval_s = 0.0
    assert guard.check().startswith("memory at ") and "memory.max_fraction=1e-06" in guard.check()
