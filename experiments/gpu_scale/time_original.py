"""Run the original AAM's `aam pretrain` (jbk708/aam) with per-step timing, on a CPU or a GPU; its own venv.

As experiments/original/time_original.py, for runs of several epochs on a GPU: a global optimizer step
hook stamps the clock after each optimizer step (on CUDA after a synchronize: the queue drained, so the
stamp is the step's end; the original syncs ~40 times a step anyway), a step's time is from the previous
stamp or its epoch's start (validation and checkpoints between epochs are not steps), and the
training losses, each epoch's val loss and the CUDA allocator's peak are kept.
Usage: python time_original.py RESULT.json -- <aam pretrain options>
Writes {"step_times_s", "losses", "val_losses", "batch_size", "wall_s", "peak_device_bytes", "device"}.
"""

import json
import sys
import time

import torch
from aam.cli.pretrain import pretrain
from aam.training.losses import MultiTaskLoss
from aam.training.trainer import Trainer
from torch.optim.optimizer import register_optimizer_step_post_hook

result_path, args = sys.argv[1], sys.argv[3:]
device = args[args.index("--device") + 1] if "--device" in args else "cuda"  # the CLI's default
cuda = device == "cuda"
step_times: list[float] = []
losses: list[dict] = []
val_losses: list[float] = []
batch_sizes: set[int] = set()
last_stamp = [0.0]

train_epoch = Trainer.train_epoch


def timed_train_epoch(self, loader, *a, **k):
    batch_sizes.add(loader.batch_size)  # the finder's choice where --auto-batch-size ran
    last_stamp[0] = time.perf_counter()  # the epoch's first step is timed from here
    return train_epoch(self, loader, *a, **k)


validate_epoch = Trainer.validate_epoch


def recorded_validate_epoch(self, *a, **k):
    out = validate_epoch(self, *a, **k)
    results = out[0] if isinstance(out, tuple) else out  # (results, predictions, targets) when asked
    val_losses.append(float(results["total_loss"]))
    return out


Trainer.train_epoch = timed_train_epoch
Trainer.validate_epoch = recorded_validate_epoch

loss_forward = MultiTaskLoss.forward


def recorded_forward(self, outputs, *a, **k):
    out = loss_forward(self, outputs, *a, **k)
    if torch.is_grad_enabled():  # training steps only, not validation
        names = {"total": "total_loss", "unifrac": "unifrac_loss", "nuc": "nuc_loss"}
        losses.append({k: out[v].item() for k, v in names.items()})  # host syncs the original does anyway
    return out


MultiTaskLoss.forward = recorded_forward


def stamp(*_) -> None:
    if cuda:
        torch.cuda.synchronize()  # the step's kernels done: its time, not its launch
    now = time.perf_counter()
    step_times.append(now - last_stamp[0])
    last_stamp[0] = now


register_optimizer_step_post_hook(stamp)

start = time.perf_counter()
pretrain.main(args, standalone_mode=False)
json.dump(
    {
        "step_times_s": step_times,
        "losses": losses,
        "val_losses": val_losses,
        "batch_size": sorted(batch_sizes),
        "wall_s": time.perf_counter() - start,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    },
    open(result_path, "w"),
    indent=1,
)
