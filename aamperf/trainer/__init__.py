"""Training: the loop (`loop.py`), its learning-rate schedule, batch stream and checkpoints."""

from aamperf.trainer.loop import FitResult, LossFn, fit, validate
from aamperf.trainer.schedule import build_scheduler
from aamperf.trainer.stream import BatchStream

__all__ = ["BatchStream", "FitResult", "LossFn", "build_scheduler", "fit", "validate"]
