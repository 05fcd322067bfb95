"""FLOPs of a step and the device's peak FLOP/s, the two halves of MFU / HFU."""

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.flop_counter import FlopCounterMode

from aamperf.cgroups import usable_cores
from aamperf.files import read_json_cache, update_json_cache
from aamperf.metrics.gpu_peaks import gpu_peak
from aamperf.metrics.host import cpuinfo, machine_key

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # precision.dtype -> torch


def square_shape(threads: int) -> tuple[int, int, int]:
    """The large square matmul of every calibration: big enough to keep `threads` cores busy (1024 for
    up to 3 threads, 2048 up to 15, ...), small enough to take a fraction of a second."""
    n = min(4096, 1024 * max(1, round(threads ** (1 / 3))))
    return n, n, n


MAX_ROWS = 16384  # a model-shaped matmul with more rows runs the same kernel at the same rate

# A calibration is taken "under load" (and never cached) when, while it ran, other processes used more
# than this many cores, the hypervisor stole more than this many, the 1-min load average before it
# exceeded 1 (this process, busy before the calibration) + half the CPUs, or its trials spread more than
# MAX_SPREAD around their median.
MAX_OTHER_CORES = 0.25
MAX_SPREAD = 0.25
MIN_WATCH_S = 0.5  # CPU time is counted in 10 ms ticks: over 0.5 s, 2 CPUs' rounding is < 0.1 core


def count_flops(step: Callable[[], None]) -> float:
    """FLOPs torch actually dispatches in `step` (e.g. forward + backward of one batch)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def matmul_dtype(device: torch.device, precision: str, matmul_precision: str) -> str:
    """The dtype the run's matmuls execute in: the autocast dtype, or TF32 for fp32 on a CUDA device
    allowed to use it (matmul_precision high/medium) that has it (Ampere, compute capability 8, on)."""
    if precision == "fp32" and device.type == "cuda" and matmul_precision != "highest":
        return "tf32" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp32"
    return precision


def utilization(flops_per_step: float, step_time_s: float | None, peak: float | None) -> float | None:
    """Achieved FLOP/s / peak FLOP/s, or None where there is no figure (the reason: `null_reason`)."""
    if not peak or not step_time_s:
        return None
    return flops_per_step / step_time_s / peak


def null_reason(mfu: float | None, hfu: float | None, peak: float | None, record: dict[str, Any]) -> dict:
    """{mfu, hfu, mfu_error, hfu_error}: a utilization above 1 is an error, not a figure (null, and why,
    naming the figure that is wrong)."""
    source = record.get("status", "unknown")
    out: dict[str, Any] = {"mfu": mfu, "hfu": hfu, "mfu_error": None, "hfu_error": None}
    if peak is None:
        why = record.get("reason") or "no peak FLOP/s for this device and dtype"
        out["mfu_error"] = out["hfu_error"] = f"no peak: {why}"
        return out
    if mfu is None:
        out["mfu_error"] = out["hfu_error"] = "no timed step (metrics.skip_steps >= the steps run)"
    if hfu is not None and hfu > 1:
        out["hfu"] = None
        out["hfu_error"] = (
            f"hfu={hfu:.3g} > 1: peak_flops={peak:.3g} FLOP/s ({source}) is below the FLOP/s this run "
            "executed, so peak_flops is wrong (a calibration on a loaded or different machine) unless "
            "hardware_flops_per_step overcounts"
        )
    if mfu is not None and mfu > 1:
        out["mfu"] = None
        if hfu is not None and hfu <= 1:
            out["mfu_error"] = (
                f"mfu={mfu:.3g} > 1 with hfu={hfu:.3g}: the run executed fewer FLOPs than the model's math "
                "(hardware_flops_per_step < model_flops_per_step: each distinct ASV encoded once), so "
                "model FLOP/s over the peak is no utilization; compare samples_per_s"
            )
        else:
            out["mfu_error"] = f"mfu={mfu:.3g} > 1: " + (out["hfu_error"] or "peak_flops is too low")
    return out


# ---- peak FLOP/s: a table on GPUs, a calibration on CPU ------------------------------------------


def busy_seconds(times: Any) -> float:
    """Busy CPU seconds of all CPUs (guest time is already counted in user time)."""
    idle = times.idle + getattr(times, "iowait", 0.0) + getattr(times, "steal", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


class _Matmul:
    """One [m, k] x [k, n] matmul in one dtype, warm, and how many calls make a trial of `trial_s`."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, trial_s: float) -> None:
        m, k, n = shape
        self.flop = 2 * m * k * n
        # its own generator: the run's seeded random stream (weights, dropout) must not depend on this
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = (
            torch.randn(m, k, generator=gen).to(dtype),
            torch.randn(k, n, generator=gen).to(dtype),
        )
        torch.mm(self.a, self.b)  # the first call picks kernels and touches the pages
        start = time.perf_counter()
        torch.mm(self.a, self.b)
        self.once_flops = self.flop / max(time.perf_counter() - start, 1e-6)
        self.repeats = max(1, round(trial_s * self.once_flops / self.flop))

    def trial(self) -> float:
        """FLOP/s of `repeats` calls, after an untimed one (its operands back in the caches after the
        other matmuls' trials)."""
        torch.mm(self.a, self.b)
        start = time.perf_counter()
        for _ in range(self.repeats):
            torch.mm(self.a, self.b)
        return self.flop * self.repeats / (time.perf_counter() - start)


SETTLE_ROWS = 1024  # the rows of the slice a later dtype is first tried on (`settled_x`)


def time_matmuls(
    precisions: Sequence[str],
    shapes: Sequence[tuple[int, int, int]],
    trials: int,
    trial_s: float = 0.03,
    settled_x: float | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """{precision: one record per shape}: FLOP/s of `trials` timed runs of each matmul, each repeated for
    >= trial_s, every precision and shape in turn, so that a slow or quick spell of the machine falls on
    all of them alike (a spell of a few trials, one after the other, took the median of one shape or one
    dtype with it: the ratios precision=auto reads, the peak). `settled_x`: a later precision first runs
    on a slice of the shape's rows (SETTLE_ROWS) beside the first precision; one that runs that many
    times slower there, in the best of two timings, is timed no further (an emulated dtype: seconds a
    call at the full shape, of which the slice costs a sixteenth), its rate the slice's."""
    shapes = list(dict.fromkeys(shapes))  # one record a shape, however often it is named
    settled: dict[tuple[str, tuple[int, int, int]], tuple[float, int]] = {}  # (rate, rows)
    for p in precisions[1:] if settled_x else ():
        for m, k, n in shapes:
            rows = min(m, SETTLE_ROWS)
            first, later = (_Matmul((rows, k, n), DTYPES[q], trial_s) for q in (precisions[0], p))
            rates = [max(case.once_flops, case.trial()) for case in (first, later)]  # noise only slows
            if rates[1] * settled_x < rates[0]:
                settled[p, (m, k, n)] = (rates[1], rows)
    cases = {
        (p, shape): _Matmul(shape, DTYPES[p], trial_s)
        for p in precisions
        for shape in shapes
        if (p, shape) not in settled
    }
    rates: dict[tuple[str, tuple[int, int, int]], list[float]] = {key: [] for key in cases}
    for _ in range(trials + 1):  # the first round untimed: the clocks ramp up over the first tens of ms
        for key, case in cases.items():
            rates[key].append(case.trial())
    records: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
    for p in precisions:
        for shape in shapes:
            trial_rates = [settled[p, shape][0]] if (p, shape) in settled else rates[p, shape][1:]
            median = statistics.median(trial_rates)
            record = {
                "shape": list(shape),
                "median_flops": median,
                "spread": (max(trial_rates) - min(trial_rates)) / median,
                "trials": trial_rates,
                "settled": (p, shape) in settled,
            }
            if (p, shape) in settled:
                record["rows"] = settled[p, shape][1]  # the slice its rate was read on
            records[p].append(record)
    return records


class LoadWatch:
    """How busy the rest of the machine was while a measurement ran: other processes' cores, the
    hypervisor's steal, the load average before. `pause()` / `resume()` leave out what is not the
    measurement (a compile's C++ compiler processes are this run's work, not load). The kernel counts
    CPU time in ticks (10 ms), so a watch needs windows of `MIN_WATCH_S` or more to mean anything.
    `verdict(load, spread)` names every reason not to trust a measurement (`spread`: its trials'
    relative spread, where that is a reason too)."""

    def __init__(self) -> None:
        self.cpus = len(usable_cores())
        self.load_before = os.getloadavg()
        self._me = psutil.Process()
        self._wall = self._other = self._steal = 0.0
        self._start: tuple[Any, float, float] | None = None
        self.resume()

    def resume(self) -> None:
        own = self._me.cpu_times()
        self._start = (psutil.cpu_times(), own.user + own.system, time.perf_counter())

    def pause(self) -> None:
        if self._start is None:
            return
        (cpu0, own0, wall0), self._start = self._start, None
        cpu1, own1 = psutil.cpu_times(), self._me.cpu_times()
        self._wall += time.perf_counter() - wall0
        self._other += busy_seconds(cpu1) - busy_seconds(cpu0) - (own1.user + own1.system - own0)
        self._steal += getattr(cpu1, "steal", 0.0) - getattr(cpu0, "steal", 0.0)

    def stop(self) -> dict[str, Any]:
        self.pause()
        wall = max(self._wall, 1e-9)
        return {
            "cpus": self.cpus,
            "loadavg_before": list(self.load_before),
            "loadavg_after": list(os.getloadavg()),
            "other_cores_busy": max(0.0, self._other / wall),
            "steal_cores": self._steal / wall,
            "wall_s": self._wall,
        }

    @staticmethod
    def verdict(load: dict[str, Any], spread: float = 0.0, use_loadavg: bool = True) -> str | None:
        """None for a quiet measurement, else why it was taken under load. `use_loadavg=False`: judge by
        what was measured while it ran only (a 1-minute average still holds the run before this one)."""
        reasons = []
        if load["other_cores_busy"] > MAX_OTHER_CORES:
            reasons.append(f"other processes used {load['other_cores_busy']:.2f} cores while it ran")
        if load["steal_cores"] > MAX_OTHER_CORES:
            reasons.append(f"the hypervisor stole {load['steal_cores']:.2f} cores")
        if use_loadavg and load["loadavg_before"][0] > 1 + load["cpus"] / 2:
            reasons.append(f"load average {load['loadavg_before'][0]:.2f} before it, on {load['cpus']} CPUs")
        if spread > MAX_SPREAD:
            reasons.append(f"its trials spread {spread:.0%} around the median")
        return "; ".join(reasons) or None


def calibrate_cpu(
    precision: str,
    shapes: Sequence[tuple[int, int, int]] = (),
    trials: int = 5,
    trial_s: float = 0.03,
    square: bool = True,
) -> dict[str, Any]:
    """Median FLOP/s over `trials` of each matmul shape (the model's, and a square one unless
    `square=False` and shapes are given), timed in turn, at the current torch thread count; the peak is
    the best shape's median. The record says whether the machine was busy."""
    threads = torch.get_num_threads()
    watch = LoadWatch()
    model_shapes = [(min(m, MAX_ROWS), k, n) for m, k, n in shapes]
    timed = [*model_shapes, square_shape(threads)] if square or not shapes else model_shapes
    per_shape = time_matmuls([precision], timed, trials, trial_s)[precision]  # a shape twice: timed once
    load = watch.stop()
    best = max(per_shape, key=lambda s: s["median_flops"])
    record = {
        "peak_flops": best["median_flops"],
        "best_shape": best["shape"],
        "spread": best["spread"],
        "shapes": per_shape,
        "trials": trials,
        "dtype": precision,
        "threads": threads,
        **dict(zip(("cpu_model", "cpu_flags", "cpu_generation"), cpuinfo(), strict=True)),
        **load,
    }
    record["under_load"] = LoadWatch.verdict(load, best["spread"])
    return record


def peak_flops(
    device: torch.device,
    precision: str,
    cache_file: str | Path,
    shapes: Sequence[tuple[int, int, int]] = (),
    calibrate: Callable[..., dict[str, Any]] = calibrate_cpu,
) -> tuple[float | None, dict[str, Any]]:
    """(peak FLOP/s for matmuls in `precision` on `device`, the record of where it came from).

    GPU: the data-sheet table (`gpu_peaks.py`). CPU: a calibration in this run (`calibrate_cpu`), and the
    best clean figure this same machine (`machine_key`) measured before it: a machine's peak is the best
    rate it reaches, which a reading can fall short of but not exceed (a third of a sweep's clean
    readings on a 2-core VM ran at one core's rate, between runs whose steps all ran at one speed). A
    clean reading is used and cached where it is the best yet; below the cached best, the best is used
    (`best_cached`). A reading under load is never cached: the cached best is used, or, with none, this
    run's figure, flagged."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), precision)
    if device.type != "cpu" or precision not in DTYPES:
        return None, {
            "status": "unknown",
            "dtype": precision,
            "reason": f"no peak for {device.type} / {precision}",
        }
    record = calibrate(precision, shapes)
    key = machine_key(precision, record["threads"])
    record["cache_key"] = key
    cache_file = Path(cache_file)
    cached = read_json_cache(cache_file).get(key)
    figure = cached.get("peak_flops") if isinstance(cached, dict) else None
    if isinstance(figure, bool) or not isinstance(figure, int | float) or not figure > 0:
        cached = None  # none, or an entry damaged by hand (true is no figure either): not a figure to use
    reading = f"this run's calibration ({record['peak_flops']:.3g} FLOP/s)"
    if record["under_load"] is None and (cached is None or record["peak_flops"] >= cached["peak_flops"]):
        entry = {
            k: record[k] for k in ("peak_flops", "spread", "best_shape", "loadavg_before", "other_cores_busy")
        }
        update_json_cache(cache_file, key, {**entry, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        best = "" if cached is None else f" (the best yet on this machine: {cached['peak_flops']:.3g} before)"
        return record["peak_flops"], {
            **record,
            "status": "this_run",
            "reason": f"calibrated in this run; cached{best}",
        }
    if record["under_load"] is None:
        reason = (
            f"{reading} was clean but {record['peak_flops'] / cached['peak_flops']:.2f}x the best this "
            f"machine measured ({cached['peak_flops']:.3g} at {cached.get('measured_at')}): a machine's "
            "peak is the best it reaches, so the best is used"
        )
        return cached["peak_flops"], {**record, "status": "best_cached", "cached": cached, "reason": reason}
    if cached:
        reason = (
            f"{reading} was under load ({record['under_load']}): not cached; using the best figure a clean "
            f"run measured on this machine, at {cached.get('measured_at')}"
        )
        return cached["peak_flops"], {**record, "status": "cache", "cached": cached, "reason": reason}
    reason = (
        f"under load ({record['under_load']}) and no clean figure cached for this machine: this run's "
        "figure is used but not cached; it may be low (MFU high)"
    )
    return record["peak_flops"], {**record, "status": "this_run_under_load", "reason": reason}
