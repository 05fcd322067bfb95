"""FLOPs of a step and the device's peak FLOP/s, the two halves of MFU."""

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from aamperf.metrics.record import write_json_atomic

# Dense peak FLOP/s of known GPUs by (name fragment, dtype), from the vendors' data sheets.
# A device not listed gets MFU = null: never a guess.
GPU_PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("H100", "bf16"): 989e12,
    ("H100", "fp16"): 989e12,
    ("H100", "fp32"): 67e12,
    ("A100", "bf16"): 312e12,
    ("A100", "fp16"): 312e12,
    ("A100", "fp32"): 19.5e12,
    ("L4", "bf16"): 121e12,
    ("L4", "fp16"): 121e12,
    ("L4", "fp32"): 30.3e12,
    ("V100", "fp16"): 125e12,
    ("V100", "fp32"): 15.7e12,
    ("T4", "fp16"): 65e12,
    ("T4", "fp32"): 8.1e12,
}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def count_flops(step: Callable[[], None]) -> float:
    """FLOPs torch actually dispatches in `step` (e.g. forward + backward of one batch)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _calibrate_cpu(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """Best-of-`repeats` FLOP/s of an n x n matmul at the current torch thread count."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm-up: the first call picks kernels and touches the pages
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, precision: str, cache_file: str | Path) -> float | None:
    """Peak FLOP/s for `precision` on `device`: a table on GPUs, a calibration on CPU.

    On CPU every run measures again (a fraction of a second) and the cache keeps the best figure
    seen on this machine: one calibration on a busy machine would otherwise understate the peak
    (and overstate MFU) for good."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for (frag, p), v in GPU_PEAK_FLOPS.items() if frag in name and p == precision), None)
    if device.type != "cpu" or precision not in _DTYPES:
        return None
    key = f"{_cpu_name()}|threads={torch.get_num_threads()}|{precision}|torch={torch.__version__}"
    cache_file = Path(cache_file)
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    measured = _calibrate_cpu(_DTYPES[precision])
    if measured > cache.get(key, 0.0):
        cache[key] = measured
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache_file, cache)
    return cache[key]
