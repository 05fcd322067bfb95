"""Measurement: the run record, system monitors, FLOPs and the device's peak FLOP/s."""

from aamperf.metrics.flops import count_flops, peak_flops
from aamperf.metrics.monitor import SystemMonitor, release_freed_memory
from aamperf.metrics.record import NullRecord, RunRecord
from aamperf.metrics.timing import StepMeter

__all__ = [
    "NullRecord",
    "RunRecord",
    "StepMeter",
    "SystemMonitor",
    "release_freed_memory",
    "count_flops",
    "peak_flops",
]
