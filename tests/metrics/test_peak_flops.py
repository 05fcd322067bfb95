"""The device's peak FLOP/s: a CPU calibration robust to load, cached only for the same machine, and
utilizations above 1 reported as errors."""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import skip_where_others_busy

import aamperf.metrics.host as host
from aamperf.metrics import count_flops, null_reason, peak_flops
from aamperf.metrics import flops as flops_module
from aamperf.metrics.flops import SETTLE_ROWS, LoadWatch, calibrate_cpu, time_matmuls
from aamperf.metrics.host import machine_key

CPU = torch.device("cpu")


def test_count_flops_of_a_matmul():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    assert count_flops(lambda: a @ b) == 2 * 64 * 32 * 16


def _cpuinfo_of(family: int, model: int) -> str:
    """/proc/cpuinfo as a hypervisor shows an EPYC: a bare model name (two processors, the same block)."""
    block = (
        "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 sse2\n"
    )
    return "\n".join(block.format(n=n, family=family, model=model) for n in (0, 1))


def test_two_cpus_of_one_bare_name_and_flags_are_told_apart_by_their_generation(monkeypatch):
    """A Zen 4 and a Zen 5 EPYC under KVM both read "AMD EPYC" with the same matmul flags, at bf16 matmul
    rates ~2x apart: the description beside a figure, and the cache key of a peak, must differ."""
    zen4, zen5 = (
        host.parse_cpuinfo(_cpuinfo_of(25, 17)),
        host.parse_cpuinfo(_cpuinfo_of(26, 2)),
    )
    assert zen4 == ("AMD EPYC", ["avx2", "avx512_bf16", "avx512f", "fma"], "family 25 model 17 stepping 1")
    assert zen5[:2] == zen4[:2] and zen5[2] == "family 26 model 2 stepping 1"
    described, keys = [], []
    for info in (zen4, zen5):
        monkeypatch.setattr(host, "cpuinfo", lambda info=info: info)
        described.append(host.cpu_description())
        keys.append(machine_key("bf16", 2))
    assert described == [
        "AMD EPYC (family 25 model 17 stepping 1; avx2, avx512_bf16, avx512f, fma)",
        "AMD EPYC (family 26 model 2 stepping 1; avx2, avx512_bf16, avx512f, fma)",
    ]
    assert keys[0] != keys[1]


def fake_calibration(peak: float, under_load: str | None):
    def calibrate(precision, shapes):
        clean = {
            "spread": 0.01,
            "best_shape": [8, 8, 8],
            "loadavg_before": [0.1] * 3,
            "other_cores_busy": 0.0,
        }
        return {**clean, "peak_flops": peak, "threads": torch.get_num_threads(), "under_load": under_load}

    return calibrate


def test_a_clean_calibration_is_cached_for_this_machine_and_used_when_a_later_one_is_under_load(tmp_path):
    cache = tmp_path / "peak.json"
    peak, record = peak_flops(CPU, "fp32", cache, calibrate=fake_calibration(5e10, None))
    assert peak == 5e10 and record["status"] == "this_run"
    (key,) = json.loads(cache.read_text())
    assert key == machine_key("fp32", torch.get_num_threads())
    assert f"|{','.join(host.cpuinfo()[1])}|" in key  # the matmul flags of this CPU
    # A later run on a busy machine measures less: the clean figure is used, and the record says why.
    peak, record = peak_flops(CPU, "fp32", cache, calibrate=fake_calibration(1e9, "other processes busy"))
    assert peak == 5e10 and record["status"] == "cache" and "under load" in record["reason"]
    assert json.loads(cache.read_text())[key]["peak_flops"] == 5e10  # the busy figure is not stored
    # bf16 is another key: fp32's figure is never used for it
    peak, record = peak_flops(CPU, "bf16", cache, calibrate=fake_calibration(2e9, "busy"))
    assert peak == 2e9 and record["status"] == "this_run_under_load"
    assert list(json.loads(cache.read_text())) == [key]
    assert not list(tmp_path.glob(".*tmp"))  # each writer's temporary file was renamed


def test_a_clean_reading_below_the_machines_best_uses_the_best_and_keeps_it(tmp_path):
    """A clean reading can fall short of the machine's peak (here: one core's rate for half a second)
    but not exceed it: the best clean figure is the peak, and only a better one replaces it."""
    cache = tmp_path / "peak.json"
    key = machine_key("bf16", torch.get_num_threads())
    peak_flops(CPU, "bf16", cache, calibrate=fake_calibration(4e11, None))
    peak, record = peak_flops(CPU, "bf16", cache, calibrate=fake_calibration(2e11, None))
    assert peak == 4e11 and record["status"] == "best_cached" and record["peak_flops"] == 2e11
    assert "0.50x the best this machine measured" in record["reason"]
    assert json.loads(cache.read_text())[key]["peak_flops"] == 4e11  # the low reading did not replace it
    peak, record = peak_flops(CPU, "bf16", cache, calibrate=fake_calibration(4.2e11, None))
    assert peak == 4.2e11 and record["status"] == "this_run" and "4e+11 before" in record["reason"]
    assert json.loads(cache.read_text())[key]["peak_flops"] == 4.2e11


@pytest.mark.parametrize(
    "entry",
    [{"peak_flops": "fast"}, {"peak_flops": True}, {"peak_flops": 0}, {"peak_flops": -1e9}, [1e18], 1e18],
)
def test_a_damaged_cache_entry_is_no_peak(tmp_path, entry):
    cache = tmp_path / "peak.json"
    cache.write_text(json.dumps({machine_key("fp32", torch.get_num_threads()): entry}))
    peak, record = peak_flops(CPU, "fp32", cache, calibrate=fake_calibration(1e9, "busy"))
    assert peak == 1e9 and record["status"] == "this_run_under_load"  # not the entry's figure
    peak, record = peak_flops(CPU, "fp32", cache, calibrate=fake_calibration(3e9, None))
    assert peak == 3e9 and record["status"] == "this_run"  # and a clean reading replaces it


def test_a_figure_cached_on_another_machine_is_not_used(tmp_path):
    cache = tmp_path / "peak.json"
    key = machine_key("fp32", torch.get_num_threads())
    other = "another-machine-id|" + key.split("|", 1)[1]  # all the same but the machine
    cache.write_text(json.dumps({other: {"peak_flops": 1e18, "measured_at": "then"}, "junk": 1}))
    peak, record = peak_flops(CPU, "fp32", cache, calibrate=fake_calibration(3e9, "busy"))
    assert peak == 3e9 and record["status"] == "this_run_under_load" and "may be low" in record["reason"]


def _spin(seconds: float, started=None) -> None:
    if started is not None:
        started.set()  # this process is up (its imports done): it spins from here
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_calibration_under_load_is_flagged_and_not_cached(tmp_path):
    """Two busy processes spinning beside the calibration: the reading is never stored as the peak."""
    cache = tmp_path / "peak.json"
    spawn = multiprocessing.get_context("spawn")
    started = [spawn.Event() for _ in range(2)]
    busy = [spawn.Process(target=_spin, args=(60, up)) for up in started]
    for p in busy:
        p.start()
    try:
        # a spawned process imports this module (torch): seconds on a busy machine; wait until both spin
        assert all(up.wait(timeout=120) for up in started)
        time.sleep(0.5)
        peak, record = peak_flops(CPU, "fp32", cache)
    finally:
        for p in busy:
            p.kill()
            p.join()
    # two spinners on this machine's cores: well over the 0.25-core threshold (not a full core each: the
    # calibration competes with them)
    assert record["other_cores_busy"] > 0.5 and "other processes used" in record["under_load"]
    assert record["status"] == "this_run_under_load" and peak == record["peak_flops"] > 1e8
    assert not cache.exists()


def test_a_high_load_average_flags_the_calibration(monkeypatch):
    monkeypatch.setattr(flops_module.os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    record = calibrate_cpu("fp32", trials=2, trial_s=0.005)
    assert "load average 40.00" in record["under_load"]
    assert record["loadavg_before"] == [40.0] * 3 and record["threads"] == torch.get_num_threads()
    assert len(record["shapes"]) == 1 and len(record["shapes"][0]["trials"]) == 2


def test_a_matmul_far_below_the_settling_rate_is_timed_once():
    """A later dtype `settled_x` times slower than the first dtype on a slice settles its shape (an
    emulated dtype takes seconds a call); settled_x=1e-9: a threshold every call is below."""
    slow = time_matmuls(["fp32", "bf16"], [(64, 32, 32)], trials=5, trial_s=0.001, settled_x=1e-9)
    timed = time_matmuls(["fp32", "bf16"], [(64, 32, 32)], trials=5, trial_s=0.001)
    assert len(slow["bf16"][0]["trials"]) == 1 and slow["bf16"][0]["settled"] is True
    assert len(slow["fp32"][0]["trials"]) == 5 and slow["fp32"][0]["settled"] is False  # the reference
    assert all(len(r[0]["trials"]) == 5 and not r[0]["settled"] for r in timed.values())


def test_a_settled_dtype_never_runs_the_full_shape():
    """An emulated bf16 takes seconds a call at the model's shapes (a probe of 9.5-9.8 s on an AVX2-only
    EPYC, 2.8 s tried on slices): it is tried on SETTLE_ROWS rows, and where it settles there the full
    shape is never run; where it does not, the full shape is timed as any other."""
    shape = (4 * SETTLE_ROWS, 32, 16)

    def bf16_rows(settled_x):
        with torch.profiler.profile(record_shapes=True) as prof:
            records = time_matmuls(["fp32", "bf16"], [shape], trials=2, trial_s=1e-9, settled_x=settled_x)
        mm = [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::mm"]
        dtypes = [e.input_dtypes[0] for e in prof.events() if e.name == "aten::mm"]
        return {rows for rows, dtype in zip(mm, dtypes, strict=True) if dtype == "c10::BFloat16"}, records

    rows, records = bf16_rows(1e-9)  # every slice below the threshold: settled
    assert rows == {SETTLE_ROWS}
    assert records["bf16"][0]["settled"] and records["bf16"][0]["rows"] == SETTLE_ROWS
    assert records["fp32"][0]["shape"] == list(shape) and not records["fp32"][0]["settled"]
    rows, records = bf16_rows(1e9)  # none below it: the slice, then the full shape's trials
    assert rows == {SETTLE_ROWS, shape[0]}
    assert not records["bf16"][0]["settled"] and len(records["bf16"][0]["trials"]) == 2


def test_every_dtype_and_shape_is_timed_in_turn():
    """Timed one after the other, a slow spell of a few trials took one dtype's (or shape's) median with
    it, and the ratio precision=auto reads: each round times every matmul once (torch.profiler's record
    of the calls)."""
    shapes = [(64, 32, 16), (48, 32, 16)]
    with torch.profiler.profile(record_shapes=True) as prof:
        records = time_matmuls(["fp32", "bf16"], shapes, trials=3, trial_s=1e-9)  # one call a trial
    calls = [(e.input_dtypes[0], tuple(e.input_shapes[0])) for e in prof.events() if e.name == "aten::mm"]
    cases = [(dtype, (m, k)) for dtype in ("float", "c10::BFloat16") for m, k, _ in shapes]
    warm = 2 * len(cases)  # each matmul's first call and its one timed call, made as it is set up
    assert calls[:warm] == [case for case in cases for _ in range(2)]
    # four rounds (the first untimed), each matmul's trial an untimed call, then the timed one
    assert calls[warm:] == [case for _ in range(4) for case in cases for _ in range(2)]
    assert [len(r["trials"]) for rs in records.values() for r in rs] == [3] * 4


def test_the_calibration_times_the_model_shape_and_a_square_one():
    record = calibrate_cpu("fp32", shapes=[(100000, 32, 128)], trials=3, trial_s=0.005)
    shapes = [s["shape"] for s in record["shapes"]]
    assert shapes == [[16384, 32, 128], list(flops_module.square_shape(torch.get_num_threads()))]
    assert record["peak_flops"] == max(s["median_flops"] for s in record["shapes"])
    assert all(s["median_flops"] == sorted(s["trials"])[1] for s in record["shapes"])  # median of 3


def test_unknown_device_or_dtype_has_no_peak(tmp_path):
    assert peak_flops(CPU, "int8", tmp_path / "p.json")[0] is None
    assert peak_flops(torch.device("meta"), "fp32", tmp_path / "p.json")[0] is None
    assert null_reason(None, None, None, {"reason": "no peak for meta / fp32"})["mfu_error"] == (
        "no peak: no peak for meta / fp32"
    )


def test_a_utilization_above_one_is_null_with_the_figure_to_blame():
    record = {"status": "this_run_under_load"}
    out = null_reason(1.8, 1.9, 1e9, record)
    assert out["mfu"] is None and out["hfu"] is None
    assert "peak_flops" in out["hfu_error"] and "this_run_under_load" in out["hfu_error"]
    assert out["mfu_error"].startswith("mfu=1.8 > 1") and "peak_flops" in out["mfu_error"]
    # dedup: fewer FLOPs executed than the model's math; the executed ones are below the peak
    out = null_reason(1.3, 0.6, 1e9, record)
    assert out["mfu"] is None and out["hfu"] == 0.6 and out["hfu_error"] is None
    assert "hardware_flops_per_step < model_flops_per_step" in out["mfu_error"]
    assert null_reason(0.3, 0.4, 1e9, record) == {
        "mfu": 0.3,
        "hfu": 0.4,
        "mfu_error": None,
        "hfu_error": None,
    }


@pytest.mark.parametrize("threads", [1, 2, 8, 64])
def test_the_square_grows_with_the_threads(threads):
    n = flops_module.square_shape(threads)[0]
    assert n == {1: 1024, 2: 1024, 8: 2048, 64: 4096}[threads]


def test_the_calibration_leaves_the_seeded_random_stream_alone():
    """Runs of one seed calibrate at different shapes (trainer.batch_size=auto): same weights anyway."""
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    calibrate_cpu("fp32", shapes=[(64, 8, 8)], trials=1, trial_s=0.001)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow  # ~7.5 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_a_paused_load_watch_leaves_out_what_ran_meanwhile():
    """A spinner busy only while the watch is paused (a compile's C++ compiler) is not load; one busy
    while it watches is."""
    spawn = multiprocessing.get_context("spawn")
    skip_where_others_busy()  # another program's load would count as well
    watch = LoadWatch()
    _spin(0.6)
    watch.pause()
    busy = spawn.Process(target=_spin, args=(1.5,))
    busy.start()
    busy.join()
    quiet = watch.stop()
    # 0.6 s watched; had the paused 1.5 s counted, ~0.7 cores (a margin for the machine's own noise)
    assert quiet["wall_s"] < 1.2 and quiet["other_cores_busy"] < 0.4

    busy = spawn.Process(target=_spin, args=(3,))
    busy.start()
    try:
        time.sleep(1.0)  # the spinner is up
        watch = LoadWatch()
        _spin(1.0)
        loaded = watch.stop()
    finally:
        busy.kill()
        busy.join()
    assert loaded["other_cores_busy"] > 0.5 and "other processes used" in LoadWatch.verdict(loaded)


@pytest.mark.skipif(
    not 2 <= len(os.sched_getaffinity(0)) == os.cpu_count() or not shutil.which("taskset"),
    reason="needs 2 cores, all of them this process's, and taskset",
)
def test_the_machine_names_the_cores_a_process_started_on_where_fewer():
    code = "import torch; from aamperf.metrics import machine; print(machine(torch.device('cpu')))"
    pinned = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True
    )
    assert f"{os.cpu_count()} cores (1 usable" in pinned.stdout, pinned.stderr[-2000:]
    whole = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "usable" not in whole.stdout


def test_a_shape_named_twice_is_timed_and_recorded_once():
    """calibrate_cpu leaves de-duplicating its shapes to time_matmuls: one record a shape and precision."""
    records = time_matmuls(["fp32", "bf16"], [(64, 32, 32)] * 2, trials=2, trial_s=1e-9, settled_x=1e-9)
    assert {p: len(r) for p, r in records.items()} == {"fp32": 1, "bf16": 1}
