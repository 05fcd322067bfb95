import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch
from conftest import read_summary, skip_where_others_busy

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


SPIN = [sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"]


@contextlib.contextmanager
def spinning(ours: bool, count: int = 1):
    """Processes that keep a core busy each: children of this process (`ours`: the job's own work, e.g.
    loader workers), or another program's (started through a shell that exits: not in this tree)."""
    if ours:
        pids = [subprocess.Popen(SPIN).pid for _ in range(count)]
    else:
        script = '"$0" "$@" >/dev/null 2>&1 & echo $!'
        pids = [int(subprocess.run(["sh", "-c", script, *SPIN], capture_output=True, text=True).stdout)]
        pids += [
            int(subprocess.run(["sh", "-c", script, *SPIN], capture_output=True, text=True).stdout)
            for _ in range(count - 1)
        ]
        assert all(psutil.Process(pid).ppid() != os.getpid() for pid in pids)
    try:
        time.sleep(0.3)  # they are spinning
        yield
    finally:
        for pid in pids:
            psutil.Process(pid).kill()


def spin_here(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_another_programs_load_on_the_cores_is_named_and_the_jobs_own_workers_are_not():
    skip_where_others_busy()  # a third program's load would count as "other" beside the job's own workers
    cores = len(os.sched_getaffinity(0))
    with spinning(ours=False, count=cores), SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        spin_here(1.5)
    load = monitor.summary()["loop_load"]
    assert load["other_cores_busy"] > 0.5 and load["under_load"].startswith("other processes used")
    with spinning(ours=True, count=cores - 1), SystemMonitor(torch.device("cpu"), interval_s=0.05) as monitor:
        spin_here(1.5)
    load = monitor.summary()["loop_load"]
    assert (
        load["own_cores_busy"] > cores - 0.5
        and load["other_cores_busy"] < 0.25
        and load["under_load"] is None
    )


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_run_timed_beside_another_program_says_so(launch):
    with spinning(ours=False, count=len(os.sched_getaffinity(0))):
        proc, run_dir = launch("trainer.max_steps=12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    load = read_summary(run_dir)["loop_load"]
    assert load["under_load"].startswith("other processes used") and load["other_cores_busy"] > 0.5
    assert f"  timed under load: {load['under_load']}; its speed figures" in proc.stdout


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
