"""Run the original AAM's `aam pretrain` or `aam train` (jbk708/aam 6f65d20) unmodified, with a record of it.

The original prints no epoch times and keeps its validation metrics in TensorBoard files; this wraps its
CLI in its own venv as experiments/gpu_scale/time_original.py does: a global optimizer step hook stamps
each step (on CUDA after a synchronize), `Trainer.train_epoch` is timed whole (data, forward, backward,
its checks, optimizer: an epoch without its validation), and each `Trainer.validate_epoch`'s results are
kept (its loss and, for `train`, the target's metrics in the target's units: regression mae / mse / r2,
classification accuracy and its support-weighted f1). The original reports no macro-F1: the last
confusion matrix its classification metrics computed is kept, and summarize.py takes macro-F1 from it.
Two changes to the original, without which its `aam train --classifier` fails at 6f65d20 (both found by
this study's dry run): class_indices_target_loss and class_save_val_predictions.
Usage: python time_aam.py RESULT.json pretrain|train -- <the command's options>
Writes {"command", "epoch_times_s", "step_times_s", "val_results", "confusion_matrix", "wall_s", "device"}.
"""

import json
import sys
import time

import torch
from aam.training.losses import MultiTaskLoss
from aam.training.metrics import StreamingClassificationMetrics
from aam.training.trainer import Trainer
from torch.optim.optimizer import register_optimizer_step_post_hook

result_path, command, args = sys.argv[1], sys.argv[2], sys.argv[4:]
if command == "pretrain":
    from aam.cli.pretrain import pretrain as cli
elif command == "train":
    from aam.cli.train import train as cli
else:
    sys.exit(f"error: time_aam.py: command '{command}' is not pretrain or train")
device = args[args.index("--device") + 1] if "--device" in args else "cuda"  # the CLI's default
cuda = device == "cuda"
record: dict = {"command": command, "epoch_times_s": [], "step_times_s": [], "val_results": []}
record["confusion_matrix"] = None
last_stamp = [0.0]


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()  # the queue drained: a stamp is the work's end, not its launch


train_epoch = Trainer.train_epoch


def timed_train_epoch(self, *a, **k):
    """One training epoch, whole: its first step is timed from its start."""
    sync()
    start = last_stamp[0] = time.perf_counter()
    out = train_epoch(self, *a, **k)
    sync()
    record["epoch_times_s"].append(time.perf_counter() - start)
    return out


validate_epoch = Trainer.validate_epoch


def recorded_validate_epoch(self, *a, **k):
    """Each validation's numbers as the original computed them (floats only: tensors are its plots)."""
    out = validate_epoch(self, *a, **k)
    results = out[0] if isinstance(out, tuple) else out  # (results, predictions, targets) when asked
    record["val_results"].append({k: float(v) for k, v in results.items() if isinstance(v, (int, float))})
    return out


classification_compute = StreamingClassificationMetrics.compute


def recorded_compute(self):
    """The confusion matrix behind the original's accuracy and weighted f1 (rows observed, columns
    predicted): its macro-F1, which the original does not report, comes from it."""
    matrix = getattr(self, "confusion_matrix", None)
    if matrix is not None:
        record["confusion_matrix"] = [[int(x) for x in row] for row in matrix]
    return classification_compute(self)


target_loss = MultiTaskLoss.compute_target_loss


def class_indices_target_loss(self, target_pred, target_true, is_classifier=False, *a, **k):
    """The first change to the original: its dataset gives a classifier's target as float [B, 1], which its
    nll_loss refuses ("0D or 1D target tensor expected, multi-target not supported": `aam train
    --classifier` fails at 6f65d20); passed as the class indices [B] nll_loss takes, as it intends."""
    if is_classifier and target_true.dim() == 2 and target_true.shape[1] == 1:
        target_true = target_true.view(-1).long()
        record["classifier_target_cast"] = True
    return target_loss(self, target_pred, target_true, is_classifier, *a, **k)


save_val_predictions = Trainer._save_val_predictions


def class_save_val_predictions(self, full_predictions, *a, **k):
    """The second change: a classifier's validation predictions are [N, classes] log-probabilities, which its
    TSV writer cannot put in one column (pandas: "Per-column arrays must each be 1-dimensional"); the
    predicted class is written instead. It runs once per best epoch, outside the timed epochs."""
    predictions = full_predictions.get("predictions")
    if predictions is not None and predictions.dim() == 2 and predictions.shape[1] > 1:
        full_predictions = {**full_predictions, "predictions": predictions.argmax(dim=1)}
        record["classifier_predictions_argmax"] = True
    return save_val_predictions(self, full_predictions, *a, **k)


def stamp(*_) -> None:
    sync()
    now = time.perf_counter()
    record["step_times_s"].append(now - last_stamp[0])
    last_stamp[0] = now


Trainer.train_epoch = timed_train_epoch
Trainer.validate_epoch = recorded_validate_epoch
StreamingClassificationMetrics.compute = recorded_compute
MultiTaskLoss.compute_target_loss = class_indices_target_loss
Trainer._save_val_predictions = class_save_val_predictions
register_optimizer_step_post_hook(stamp)

start = time.perf_counter()
cli.main(args, standalone_mode=False)
record["wall_s"] = time.perf_counter() - start
record["device"] = torch.cuda.get_device_name() if cuda else "cpu"
with open(result_path, "w") as f:
    json.dump(record, f, indent=1)
