"""Dense peak FLOP/s of GPUs per matmul dtype, from the vendors' data sheets: MFU's denominator on CUDA.

A device is found by `torch.cuda.get_device_name()`, searched with each rule's pattern in order, the
most specific first: one model name covers several products (an "H100" is an SXM, a PCIe or an NVL
card, 756 to 989 bf16 TFLOP/s), and a short name is part of longer ones ("A10" of "A100", "L4" of
"L40S"). Figures are dense, never the "with sparsity" ones the sheets print first (twice the dense).
A device no rule names, or a rule whose figure no vendor publishes, gives null: never a guess
(`metrics.peak_flops` takes the figure of a sheet you have).
"""

import re
from dataclasses import dataclass
from typing import Any

T = 1e12


@dataclass(frozen=True)
class GpuPeak:
    pattern: str  # regular expression searched in the device's name (case-insensitive)
    model: str  # the product the figures are for
    # matmul dtype (precision.dtype, or tf32) -> dense FLOP/s; None: not published
    flops: dict[str, float | None]
    source: str


A100_SHEET = "NVIDIA A100 Tensor Core GPU data sheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"
H100_SHEET = "NVIDIA H100 Tensor Core GPU data sheet (resources.nvidia.com/en-us-tensor-core)"
H200_SHEET = "NVIDIA H200 Tensor Core GPU specifications (nvidia.com/en-us/data-center/h200)"
V100_SHEET = "NVIDIA V100 Tensor Core GPU data sheet (volta-v100-datasheet-update-us-1165301-r5.pdf)"
DENSE = "sparse figure / 2"


def _flops(fp32: float, tf32: float | None, bf16: float | None, fp16: float | None) -> dict:
    """Tensor-core figures with FP32 accumulate (what torch's autocast matmuls use), in TFLOP/s."""
    return {
        dtype: None if value is None else value * T
        for dtype, value in {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}.items()
    }


UNPUBLISHED = {"fp32": None, "tf32": None, "bf16": None, "fp16": None}

GPU_PEAKS: tuple[GpuPeak, ...] = (
    # A100: the same peaks for 40 and 80 GB, SXM4 and PCIe ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")
    GpuPeak(
        r"\bA100\b", "A100 (SXM4 / PCIe, 40 / 80 GB)", _flops(19.5, 156, 312, 312), f"{A100_SHEET}; {DENSE}"
    ),
    GpuPeak(
        r"\bA10G\b",
        "A10G (AWS G5)",
        UNPUBLISHED,
        "no vendor data sheet: the A10G is AWS's variant of the A10, and the tensor figures that "
        "third-party tables give it disagree (62.5 and 125 TFLOP/s among them); give metrics.peak_flops",
    ),
    GpuPeak(
        r"\bA10\b", "A10", _flops(31.2, 62.5, 125, 125), f"NVIDIA A10 Tensor Core GPU data sheet; {DENSE}"
    ),
    GpuPeak(r"\bH100 NVL\b", "H100 NVL", _flops(60, 417.5, 835.5, 835.5), f"{H100_SHEET}, H100 NVL; {DENSE}"),
    GpuPeak(
        r"\bH100 PCIe\b", "H100 PCIe", _flops(51, 378, 756.5, 756.5), f"{H100_SHEET}, H100 PCIe; {DENSE}"
    ),
    # the SXM5 card calls itself "NVIDIA H100 80GB HBM3"
    GpuPeak(
        r"\bH100\b.*(\bSXM|HBM3\b)",
        "H100 SXM",
        _flops(67, 494.5, 989.5, 989.5),
        f"{H100_SHEET}, H100 SXM; {DENSE}",
    ),
    GpuPeak(
        r"\bH100\b",
        "H100 of an unknown form factor",
        UNPUBLISHED,
        "the name does not say SXM, PCIe or NVL, whose peaks differ (989.5 / 756.5 / 835.5 bf16 TFLOP/s)",
    ),
    GpuPeak(r"\bH200 NVL\b", "H200 NVL", _flops(60, 417.5, 835.5, 835.5), f"{H200_SHEET}, H200 NVL; {DENSE}"),
    GpuPeak(r"\bH200\b", "H200 SXM", _flops(67, 494.5, 989.5, 989.5), f"{H200_SHEET}, H200 SXM; {DENSE}"),
    GpuPeak(
        r"\bL40S\b",
        "L40S",
        _flops(91.6, 183, 362.05, 362.05),
        f"NVIDIA L40S GPU data sheet (nvidia.com/en-us/data-center/l40s); {DENSE}",
    ),
    GpuPeak(
        r"\bL4\b",
        "L4",
        _flops(30.3, 60, 121, 121),
        f"NVIDIA L4 Tensor Core GPU data sheet (nvidia.com/en-us/data-center/l4); {DENSE}",
    ),
    # not the RTX 4090 D (fewer SMs); GeForce tensor cores run half rate with FP32 accumulate
    GpuPeak(
        r"\bRTX 4090\b(?!\s*D\b)",
        "GeForce RTX 4090",
        _flops(82.6, 82.6, 165.2, 165.2),
        "NVIDIA Ada GPU Architecture whitepaper (nvidia-ada-gpu-architecture.pdf), Appendix A, GeForce "
        "RTX 4090: FP16 / BF16 tensor with FP32 accumulate, dense",
    ),
    # Volta and Turing: no bf16 or TF32 tensor cores
    GpuPeak(r"\bV100S\b", "V100S PCIe", _flops(16.4, None, None, 130), V100_SHEET),
    GpuPeak(r"\bV100-SXM", "V100 SXM2", _flops(15.7, None, None, 125), V100_SHEET),
    GpuPeak(r"\bV100-PCIE\b", "V100 PCIe", _flops(14, None, None, 112), V100_SHEET),
    GpuPeak(
        r"\bT4\b",
        "T4",
        _flops(8.1, None, None, 65),
        "NVIDIA T4 Tensor Core GPU data sheet (t4-tensor-core-datasheet)",
    ),
)


def gpu_peak(name: str, dtype: str) -> tuple[float | None, dict[str, Any]]:
    """(dense peak FLOP/s of device `name` for matmuls in `dtype`, the record of where it came from)."""
    rule = next((r for r in GPU_PEAKS if re.search(r.pattern, name, re.IGNORECASE)), None)
    record: dict[str, Any] = {"device_name": name, "dtype": dtype}
    if rule is None:
        return None, {
            **record,
            "status": "unknown",
            "reason": f"{name!r} is not in GPU_PEAKS (aamperf/metrics/gpu_peaks.py); give metrics.peak_flops",
        }
    peak = rule.flops.get(dtype)
    record.update(model=rule.model, source=rule.source)
    if peak is None:
        why = rule.source if not any(rule.flops.values()) else f"the {rule.model} has no {dtype} tensor cores"
        return None, {**record, "status": "unknown", "reason": f"no {dtype} peak for the {rule.model}: {why}"}
    return peak, {**record, "status": "table", "reason": None}
