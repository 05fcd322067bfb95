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


def lrs(schedule: str, steps: int = 20, warmup: int = 4, done: int = 0, taken: int | None = None):
    """The lr of each step from step `done` on (a resumed run's), for a schedule over `steps`."""
    tc = OmegaConf.create(
        {"lr_schedule": schedule, "warmup_steps": warmup, "max_steps": steps, "lr": 0.01, "min_lr_ratio": 0.1}
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
    cosine, linear, constant, onecycle = (lrs(s) for s in LrSchedule)
    for path in (cosine, linear, constant):
        assert path[0] == pytest.approx(0.01 / 4) and path[4] == pytest.approx(0.01)  # warm-up to the lr
        assert all(a < b for a, b in zip(path[:4], path[1:5], strict=True))
    assert cosine[-1] == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert linear[-1] == pytest.approx(0.01 * (1 - 0.9 * 15 / 16))
    assert constant[4:] == [pytest.approx(0.01)] * 16
    # its rise over the warm-up: torch peaks at step pct_start x total_steps - 1
    assert max(onecycle) == pytest.approx(0.01) and onecycle.index(max(onecycle)) == 3
    assert onecycle[-1] < 1e-4


@pytest.mark.parametrize("schedule", LrSchedule)
def test_a_resumed_schedule_goes_on_with_the_same_lr_values(schedule):
    whole = lrs(schedule)
    assert lrs(schedule, done=7) == whole[7:]  # replayed to step 7: bit for bit the rest


@pytest.mark.parametrize("schedule", ["onecycle", "warmup_cosine"])
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
