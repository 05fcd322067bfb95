"""The training loop's parts: the LR schedules (torch's schedulers), their replay on resume, and the lr
logged of each step."""

import math

import pytest
import torch
from conftest import read_metrics
from omegaconf import OmegaConf

from aamperf.config import LrSchedule
from aamperf.run import train
from aamperf.trainer import build_scheduler


def lrs(schedule: str, steps: int = 20, warmup: int = 4, done: int = 0, taken: int | None = None, **keys):
    """The lr of each step from step `done` on (a resumed run's), for a schedule over `steps`."""
    tc = OmegaConf.create(
        {"lr_schedule": schedule, "warmup_steps": warmup, "max_steps": steps, "lr": 0.01, "min_lr_ratio": 0.1}
        | {"monitor": "val_loss", "plateau_factor": 0.5, "plateau_patience": 1, "min_delta": 0.0}
        | {"restart_steps": None, "restart_mult": 2}
        | keys
    )
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=tc.lr)
    scheduler = build_scheduler(optimizer, tc, done_steps=done)
    seen = []
    for _ in range(steps - done if taken is None else taken):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_each_schedule_warms_up_then_decays_as_named():
    cosine, linear, constant, onecycle, plateau, _ = (lrs(s) for s in LrSchedule)
    assert plateau == pytest.approx(constant)  # no validation: nothing to reduce on (below)
    for path in (cosine, linear, constant):
        assert path[0] == pytest.approx(0.01 / 4) and path[4] == pytest.approx(0.01)  # warm-up to the lr
        assert all(a < b for a, b in zip(path[:4], path[1:5], strict=True))
    assert cosine[-1] == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert linear[-1] == pytest.approx(0.01 * (1 - 0.9 * 15 / 16))
    assert constant[4:] == [pytest.approx(0.01)] * 16
    # its rise over the warm-up: torch peaks at step pct_start x total_steps - 1
    assert max(onecycle) == pytest.approx(0.01) and onecycle.index(max(onecycle)) == 3
    assert onecycle[-1] < 1e-4


def test_cosine_restarts_warms_up_then_restarts_each_longer_cycle_from_the_lr():
    # no warm-up: the original AAM's --scheduler cosine_restarts (T_0 a quarter of the steps, T_mult 2)
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=0.01)
    torch_s = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10, T_mult=2, eta_min=0.001)
    theirs = []
    for _ in range(40):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        torch_s.step()
    assert lrs("cosine_restarts", steps=40, warmup=0) == pytest.approx(theirs, rel=1e-12)
    # a warm-up of 4, then cycles of 9 (a quarter of the 36 steps after it) and 18 steps
    path = lrs("cosine_restarts", steps=40, warmup=4)
    assert path[:5] == pytest.approx([0.0025, 0.004375, 0.00625, 0.008125, 0.01], rel=1e-9)
    restarts = [s for s in range(5, 40) if path[s] > path[s - 1]]
    assert restarts == [13, 31]
    assert min(path[4:13]) == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 8 / 9)))
    # restart_steps and restart_mult set: equal cycles of 5 steps
    equal = lrs("cosine_restarts", steps=20, warmup=0, restart_steps=5, restart_mult=1)
    assert equal[:5] == pytest.approx(equal[5:10]) and equal[0] == pytest.approx(0.01)


@pytest.mark.parametrize("schedule", LrSchedule)
def test_a_resumed_schedule_goes_on_with_the_same_lr_values(schedule):
    whole = lrs(schedule)
    assert lrs(schedule, done=7) == whole[7:]  # replayed to step 7: bit for bit the rest


def plateau(monitor: str = "val_loss", warmup: int = 2, lr: float = 0.01, done: int = 0):
    """An optimizer and its lr_schedule=plateau (replayed to step `done`)."""
    tc = OmegaConf.create(
        {"lr_schedule": "plateau", "warmup_steps": warmup, "max_steps": 20, "lr": lr, "min_lr_ratio": 0.1}
        | {"monitor": monitor, "plateau_factor": 0.5, "plateau_patience": 1, "min_delta": 0.0}
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=tc.lr)
    return optimizer, build_scheduler(optimizer, tc, done_steps=done)


def plateau_lrs(figures: list[float | None], monitor: str = "val_loss", warmup: int = 2) -> list[float]:
    """lr_schedule=plateau validated after every step from the first: the lr of each next step."""
    optimizer, scheduler = plateau(monitor, warmup)
    seen = []
    for figure in figures:
        optimizer.step()
        scheduler.step()
        scheduler.validated(figure)
        seen.append(optimizer.param_groups[0]["lr"])
    return seen


def test_a_resumed_plateau_applies_its_reductions_to_a_changed_lr_and_a_new_monitor_starts_afresh():
    optimizer, scheduler = plateau(warmup=0)
    for figure in (1.0, 2.0, 2.0):  # one reduction: the lr halved
        optimizer.step()
        scheduler.step()
        scheduler.validated(figure)
    state = scheduler.state_dict()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    assert state["reduced"] == [pytest.approx(0.5)]
    optimizer, resumed = plateau(warmup=0, lr=0.02, done=3)  # trainer.lr changed at the resume
    resumed.resume(state)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)  # the new lr, halved
    resumed.step()
    resumed.validated(2.0)  # the count went on: one more without improving on 1.0 reduces
    resumed.step()
    resumed.validated(2.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)
    optimizer, other = plateau("val_target_r2", warmup=0, done=3)
    other.resume(state)  # watched val_loss: nothing of it applies to R^2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01) and other.plateau.best == -math.inf


def test_a_plateau_halves_the_lr_after_more_than_its_patience_of_validations_without_improving():
    # validations during the warm-up (steps 1 and 2) reduce nothing; then the best is 2.0 at step 3, and
    # the second validation after it that does not improve (step 5) halves the lr, as does step 7's
    lrs_ = plateau_lrs([9.0, 9.0, 2.0, 2.5, 2.1, 3.0, 2.2, 1.0, 1.5])
    assert lrs_ == pytest.approx([0.0075, 0.01, 0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025, 0.0025])
    # down to lr x min_lr_ratio; a validation without the figure changes nothing
    assert plateau_lrs([1.0] + [2.0] * 12, warmup=0)[-1] == pytest.approx(0.001)
    assert plateau_lrs([1.0, None, None, None], warmup=0) == [pytest.approx(0.01)] * 4
    # R^2 improves upward: a falling R^2 is what a plateau is
    assert plateau_lrs([0.1, 0.2, 0.3], "val_target_r2", warmup=0) == [pytest.approx(0.01)] * 3
    assert plateau_lrs([0.3, 0.2, 0.1], "val_target_r2", warmup=0)[-1] == pytest.approx(0.005)


def test_a_resumed_plateau_keeps_its_reductions_and_trains_as_the_whole_run(make_cfg, tmp_path):
    """Stopped after step 4 with the lr reduced, resumed to step 8: every step's lr and loss as the
    uninterrupted run's (the reductions come from the checkpoint, not from a replay of the steps)."""
    same = [
        *("trainer.lr_schedule=plateau", "trainer.plateau_patience=0", "trainer.plateau_factor=0.5"),
        *("trainer.lr=0.05", "trainer.val_every=1", "trainer.checkpoint_every=4", "trainer.resume=auto"),
    ]
    train(make_cfg(*same, "trainer.max_steps=8"), tmp_path / "whole")
    train(make_cfg(*same, "trainer.max_steps=4"), tmp_path / "resumed")
    assert train(make_cfg(*same, "trainer.max_steps=8"), tmp_path / "resumed")["resumed_from_step"] == 4
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert min(row["lr"] for row in whole[:4]) < 0.05  # reduced before the checkpoint
    assert min(row["lr"] for row in whole[4:]) < min(row["lr"] for row in whole[:4])  # and after the resume
    assert [row["lr"] for row in resumed] == [row["lr"] for row in whole]
    assert [row["loss"] for row in resumed] == [row["loss"] for row in whole]


@pytest.mark.parametrize("schedule", ["onecycle", "warmup_cosine", "cosine_restarts"])
def test_each_logged_lr_is_the_one_its_step_used(make_cfg, tmp_path, schedule):
    """metrics.jsonl `lr` of step s: the lr the optimizer stepped with at step s (not step s + 1's)."""
    cfg = make_cfg(
        f"trainer.lr_schedule={schedule}",
        "trainer.max_steps=6",
        "trainer.warmup_steps=2",
        "trainer.lr=0.01",
        "trainer.min_lr_ratio=0.1",
        "trainer.val_every=6",
    )
    train(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert [row["lr"] for row in rows] == pytest.approx(lrs(schedule, steps=6, warmup=2), rel=1e-9)


class QueuedEnd:
    """Stands in for a CUDA event (no GPU here): which step's end was recorded, and waited for."""

    log: list[tuple[str, int]] = []
    step = 0

    def __init__(self):
        self.of = QueuedEnd.step

    def record(self, stream=None) -> None:
        QueuedEnd.log.append(("record", self.of))

    def synchronize(self) -> None:
        QueuedEnd.log.append(("wait", self.of))


def test_overlapped_steps_wait_for_the_step_before_and_drain_before_each_log_line(
    make_cfg, tmp_path, monkeypatch
):
    """trainer.overlap_steps on a GPU (the schedule here; tests/gpu runs it on one): a step waits for the
    one before it, and the GPU's queue is drained (a full sync) at each step a log line, a checkpoint or the
    end follows, so the step times sum to the wall time between those."""
    import aamperf.trainer.loop as loop

    drained = []
    monkeypatch.setattr(loop, "overlaps", lambda tc, device: tc.overlap_steps)
    monkeypatch.setattr(loop.torch.cuda, "Event", QueuedEnd)
    monkeypatch.setattr(loop.torch.cuda, "current_stream", lambda device: None)
    monkeypatch.setattr(loop, "sync", lambda device: drained.append(QueuedEnd.step))
    real_call = loop.TrainStep.__call__

    def call(self, step, drain=True):
        QueuedEnd.step = step
        return real_call(self, step, drain)

    monkeypatch.setattr(loop.TrainStep, "__call__", call)
    QueuedEnd.log = []
    cfg = make_cfg(
        "trainer.max_steps=9", "metrics.log_every=4", "trainer.val_every=100", "trainer.checkpoint_every=6"
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"
    assert drained == [4, 6, 8, 9]  # log lines at 4 and 8, a checkpoint at 6, the end at 9
    # every other step recorded its end and waited for the step before's, if one was in flight
    assert QueuedEnd.log == [("record", 1), ("record", 2), ("wait", 1), ("record", 3), ("wait", 2)] + [
        ("record", 5),
        ("record", 7),
    ]

    drained.clear()
    QueuedEnd.log = []
    train(make_cfg("trainer.max_steps=3", "trainer.overlap_steps=false"), tmp_path / "off")
    assert drained == [1, 2, 3] and QueuedEnd.log == []  # each step waits for its own work


@pytest.mark.parametrize("schedule", LrSchedule)
def test_every_schedule_moves_each_parameter_group_from_its_own_lr(schedule):
    """Two groups (optimizer.categorical_lr's) at 0.01 and 0.1: every step's lrs keep their ratio, so each
    group warms up to and decays from its own lr (torch's cosine schedulers take one eta_min for all)."""
    tc = OmegaConf.create(
        {"lr_schedule": schedule, "warmup_steps": 4, "max_steps": 40, "lr": 0.01, "min_lr_ratio": 0.1}
        | {"monitor": "val_loss", "plateau_factor": 0.5, "plateau_patience": 1, "min_delta": 0.0}
        | {"restart_steps": None, "restart_mult": 2}
    )
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 0.1}], lr=tc.lr)
    scheduler = build_scheduler(optimizer, tc)
    for _ in range(40):
        first, second = (group["lr"] for group in optimizer.param_groups)
        assert second == pytest.approx(10 * first, rel=1e-9)
        optimizer.step()
        scheduler.step()
    kept = schedule in ("constant", "plateau")  # plateau: no validation to reduce on
    assert first == pytest.approx(0.01) if kept else first < 0.01
