"""Run the original AAM's `aam pretrain` (jbk708/aam) with per-step timing; run in its own venv.

The original logs no per-step times, so a global optimizer step hook stamps the clock after every
optimizer step (a step's time: from the previous stamp, or the epoch's start, to its own) and
MultiTaskLoss.forward is wrapped to keep each step's losses. Everything else is the unmodified CLI.
Usage: python time_original.py RESULT.json -- <aam pretrain options>
Writes {"step_times_s": [...], "losses": [{"total", "unifrac", "nuc"}, ...], "wall_s", "peak_rss_bytes"}.
"""

import json
import resource
import sys
import time

import torch
from aam.cli.pretrain import pretrain
from aam.training.losses import MultiTaskLoss
from aam.training.trainer import Trainer
from torch.optim.optimizer import register_optimizer_step_post_hook

result_path, args = sys.argv[1], sys.argv[3:]
stamps: list[float] = []
losses: list[dict] = []

train_epoch = Trainer.train_epoch


def timed_train_epoch(self, *a, **k):
    stamps.append(time.perf_counter())  # the epoch's start: the first step is timed from here
    return train_epoch(self, *a, **k)


Trainer.train_epoch = timed_train_epoch

loss_forward = MultiTaskLoss.forward


def recorded_forward(self, outputs, *a, **k):
    out = loss_forward(self, outputs, *a, **k)
    if torch.is_grad_enabled():  # training steps only, not validation
        losses.append(
            {
                "total": out["total_loss"].item(),
                "unifrac": out["unifrac_loss"].item(),
                "nuc": out["nuc_loss"].item(),
            }
        )  # a host sync the original does anyway
    return out


MultiTaskLoss.forward = recorded_forward

register_optimizer_step_post_hook(lambda *_: stamps.append(time.perf_counter()))

start = time.perf_counter()
pretrain.main(args, standalone_mode=False)
wall_s = time.perf_counter() - start
# one epoch: stamps = [epoch start, after step 1, ..., after step n]
steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
json.dump(
    {"step_times_s": steps, "losses": losses, "wall_s": wall_s, "peak_rss_bytes": peak},
    open(result_path, "w"),
    indent=1,
)
