import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from aamperf.metrics import SystemMonitor


def test_monitor_counts_child_processes_memory():
    """Dataloader workers are children: their RSS must be in the peak of the process tree."""
    size = 300 * 2**20
    code = f"import time; b = bytearray({size}); b[::4096] = b'x' * len(b[::4096]); time.sleep(3)"
    with SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        before = monitor.rss_bytes
        child = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(1.5)
        child.kill()
        child.wait()
    s = monitor.summary()
    assert s["peak_rss_bytes"] >= before + size * 0.9
    assert s["peak_device_bytes"] is None and s["gpu_util_percent"] is None


def test_monitor_measures_cpu_use_of_busy_thread():
    with SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            pass
    assert monitor.summary()["cpu_percent"] > 30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_monitor_reads_gpu_memory_and_utilisation():
    device = torch.device("cuda")
    with SystemMonitor(device, interval_s=0.05) as monitor:
        x = torch.randn(4096, 4096, device=device)
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            x = torch.tanh(x @ x)
            torch.cuda.synchronize()
    s = monitor.summary()
    assert s["peak_device_bytes"] >= 4096 * 4096 * 4
    assert s["gpu_util_percent"] > 10 and s["peak_gpu_used_bytes"] >= s["peak_device_bytes"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the peak-RSS reset is Linux's /proc/self/clear_refs"
)
def test_a_job_does_not_inherit_the_peak_of_an_earlier_job_in_the_same_process():
    earlier_job = np.ones(400 * 2**20 // 8)  # 400 MiB touched, then freed, as a previous multirun job would
    del earlier_job
    with SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        time.sleep(0.2)
    summary = monitor.summary()
    assert summary["peak_rss_bytes"] < psutil.Process().memory_info().rss + 200 * 2**20


def test_a_process_started_by_a_big_one_measures_its_own_peak():
    """A child's ru_maxrss starts at its parent's RSS (Linux keeps it across fork + exec): the peak
    must be the child's own (VmHWM), or every run started by a sweep, torchrun or a test is inflated."""
    parent = np.ones(1024 * 2**20 // 8)  # this process: 1 GiB more than the child will ever hold
    code = (
        "import time, torch; from aamperf.metrics import SystemMonitor\n"
        "with SystemMonitor(torch.device('cpu'), interval_s=0.05) as m: time.sleep(0.1)\n"
        "print(m.summary()['peak_rss_bytes'])"
    )
    child_peak = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    assert child_peak < parent.nbytes
