"""The GPU peak table: each product found by the name torch reports for it, the most specific rule
first, dense figures only, unknown -> null with the reason."""

import re

import pytest
import torch

from aamperf.checks import check_config
from aamperf.errors import UserError
from aamperf.job import measure_peak
from aamperf.metrics.gpu_peaks import GPU_PEAKS, gpu_peak

T = 1e12

# (torch.cuda.get_device_name(), dtype, dense peak in TFLOP/s or None)
NAMES = [
    ("NVIDIA A100-SXM4-40GB", "bf16", 312),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A10G", "bf16", None),  # no data sheet: null, not the A10's or the A100's
    ("NVIDIA A10", "bf16", 125),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),  # the SXM5 card
    ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H100", "bf16", None),  # form factor unknown: 756.5 to 989.5
    ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA L4", "bf16", 121),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40", "bf16", None),  # neither the L4 nor the L40S
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("NVIDIA GeForce RTX 4090 D", "bf16", None),
    ("Tesla V100-SXM2-16GB", "fp16", 125),
    ("Tesla V100-PCIE-32GB", "fp16", 112),
    ("Tesla V100S-PCIE-32GB", "fp16", 130),
    ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 tensor cores
    ("Tesla T4", "fp16", 65),
    ("AMD Instinct MI300X", "bf16", None),
]


@pytest.mark.parametrize(("name", "dtype", "tflops"), NAMES)
def test_each_device_name_gets_its_own_products_dense_peak(name, dtype, tflops):
    peak, record = gpu_peak(name, dtype)
    assert record["device_name"] == name and record["dtype"] == dtype
    if tflops is None:
        assert peak is None and record["status"] == "unknown" and record["reason"]
    else:
        assert peak == pytest.approx(tflops * T) and record["status"] == "table" and record["source"]


def test_a_short_name_never_takes_a_longer_ones_figure():
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "bf16")[1]["model"].startswith("A100")
    assert gpu_peak("NVIDIA L40S", "bf16")[1]["model"] == "L40S"
    assert gpu_peak("NVIDIA A10G", "bf16")[1]["model"].startswith("A10G")
    assert gpu_peak("NVIDIA H100 NVL", "bf16")[1]["model"] == "H100 NVL"


def test_every_rule_can_match_and_no_earlier_rule_hides_it():
    # a name made of what each rule's pattern asks for reaches that rule, not an earlier one
    examples = {
        r"\bA100\b": "NVIDIA A100-SXM4-80GB",
        r"\bA10G\b": "NVIDIA A10G",
        r"\bA10\b": "NVIDIA A10",
        r"\bH100 NVL\b": "NVIDIA H100 NVL",
        r"\bH100 PCIe\b": "NVIDIA H100 PCIe",
        r"\bH100\b.*(\bSXM|HBM3\b)": "NVIDIA H100 80GB HBM3",
        r"\bH100\b": "NVIDIA H100",
        r"\bH200 NVL\b": "NVIDIA H200 NVL",
        r"\bH200\b": "NVIDIA H200",
        r"\bL40S\b": "NVIDIA L40S",
        r"\bL4\b": "NVIDIA L4",
        r"\bRTX 4090\b(?!\s*D\b)": "NVIDIA GeForce RTX 4090",
        r"\bV100S\b": "Tesla V100S-PCIE-32GB",
        r"\bV100-SXM": "Tesla V100-SXM2-16GB",
        r"\bV100-PCIE\b": "Tesla V100-PCIE-16GB",
        r"\bT4\b": "Tesla T4",
    }
    assert [rule.pattern for rule in GPU_PEAKS] == list(examples)
    for rule in GPU_PEAKS:
        first = next(r for r in GPU_PEAKS if re.search(r.pattern, examples[rule.pattern], re.IGNORECASE))
        assert first is rule, f"{examples[rule.pattern]!r} is taken by {first.model!r} before {rule.model!r}"


def test_the_table_holds_dense_figures_with_a_source():
    for rule in GPU_PEAKS:
        assert rule.source and set(rule.flops) == {"fp32", "tf32", "bf16", "fp16"}
        known = {k: v for k, v in rule.flops.items() if v is not None}
        # tensor-core bf16/fp16 at least 2x the CUDA cores' fp32 (GeForce, FP32 accumulate) and at most
        # 16x (A100): a sparse figure (2x the dense one) would break the upper bound somewhere
        for half in ("bf16", "fp16"):
            if half in known and "fp32" in known:
                assert 2 <= known[half] / known["fp32"] <= 16.1, (rule.model, half)
    # the sheets' "with sparsity" figures halved
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(1979 / 2 * T)
    assert gpu_peak("NVIDIA L4", "bf16")[0] == pytest.approx(242 / 2 * T, rel=0.01)


def test_a_given_peak_is_used_without_a_calibration(make_cfg):
    cfg = make_cfg("metrics.peak_flops=1.25e14")
    peak, record = measure_peak(cfg, torch.device("cpu"), 4)
    assert peak == 1.25e14
    assert record == {"status": "given", "dtype": "fp32", "reason": "metrics.peak_flops=125000000000000.0"}


@pytest.mark.parametrize("value", ["0", "-1e12"])
def test_a_given_peak_must_be_positive(make_cfg, value):
    with pytest.raises(UserError, match=r"metrics.peak_flops=.* must be > 0"):
        check_config(make_cfg(f"metrics.peak_flops={value}"))
