"""Measurement: the run record, system monitors, FLOPs and the device's peak FLOP/s."""

from aamperf.metrics.flops import count_flops, peak_flops
from aamperf.metrics.monitor import SystemMonitor
from aamperf.metrics.record import RunRecord
from aamperf.metrics.timing import StepMeter

__all__ = ["RunRecord", "StepMeter", "SystemMonitor", "count_flops", "peak_flops"]
