"""Measurement: the run record, system monitors, FLOPs and the device's peak FLOP/s."""

from aamperf.metrics.flops import count_flops, matmul_dtype, null_reason, peak_flops, utilization
from aamperf.metrics.host import machine
from aamperf.metrics.monitor import SystemMonitor, release_freed_memory, start_job_peak_rss
from aamperf.metrics.record import NullRecord, RunRecord
from aamperf.metrics.timing import StepMeter, job_origin

__all__ = [
    "NullRecord",
    "RunRecord",
    "StepMeter",
    "SystemMonitor",
    "count_flops",
    "job_origin",
    "machine",
    "matmul_dtype",
    "null_reason",
    "peak_flops",
    "release_freed_memory",
    "start_job_peak_rss",
    "utilization",
]
