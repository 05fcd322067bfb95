import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from aamperf.metrics import SystemMonitor, start_job_peak_rss
from aamperf.metrics.monitor import job_peak_rss, peak_rss, pss_bytes, reset_peak_rss


def test_monitor_counts_child_processes_memory():
    """Dataloader workers are children: their pages must be in the peak of the process tree's PSS."""
    size = 300 * 2**20
    code = (
        f"import time; b = bytearray({size}); b[::4096] = b'x' * len(b[::4096]); "
        "print('touched', flush=True); time.sleep(30)"
    )
    with SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        before = monitor.tree_pss_bytes
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "touched"
        # PSS is read at most every cost / PSS_BUDGET seconds (about a second on a loaded machine):
        # the background thread must see the child's pages within a few of its readings
        deadline = time.perf_counter() + 15
        while monitor.tree_pss_bytes < before + size * 0.9 and time.perf_counter() < deadline:
            time.sleep(0.1)
        child.kill()
        child.wait()
    s = monitor.summary()
    assert s["peak_tree_pss_bytes"] >= before + size * 0.9
    assert (
        s["peak_rss_bytes"] < monitor.rss_bytes + size * 0.5
    )  # this process's own peak: not the child's pages
    assert s["peak_device_bytes"] is None and s["gpu_util_percent"] is None


def test_monitor_measures_cpu_use_of_busy_thread():
    with SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            pass
    assert monitor.summary()["cpu_percent"] > 30


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the peak-RSS reset is Linux's /proc/self/clear_refs"
)
def test_a_job_does_not_inherit_the_peak_of_an_earlier_job_in_the_same_process():
    earlier_job = np.ones(400 * 2**20 // 8)  # 400 MiB touched, then freed, as a previous multirun job would
    del earlier_job
    start_job_peak_rss()  # what train() does when an earlier job ran in this process
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and its reset are Linux's")
def test_the_job_peak_survives_the_resets_of_the_batch_size_finder():
    start_job_peak_rss()
    base = psutil.Process().memory_info().rss
    spike = np.ones(300 * 2**20 // 8)  # a trial of the finder: 300 MiB, then freed
    del spike
    reset_peak_rss()  # the finder measures its next trial from here
    assert peak_rss() < base + 150 * 2**20  # the since-reset peak no longer holds the spike ...
    assert job_peak_rss() >= base + 290 * 2**20  # ... the job's peak does


def test_pss_of_a_process_is_what_its_smaps_rollup_says():
    """The figure `smem` / /proc/<pid>/smaps_rollup report (Pss:), read for this process."""
    pss = pss_bytes()
    rollup = {
        k: int(v.split()[0]) * 1024
        for k, v in (line.split(":") for line in open("/proc/self/smaps_rollup").read().splitlines()[1:])
    }
    assert abs(pss - rollup["Pss"]) < 20 * 2**20 and pss <= rollup["Rss"]
