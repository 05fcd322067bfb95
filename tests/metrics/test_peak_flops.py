import json

import torch

from aamperf.metrics import count_flops, peak_flops


def test_count_flops_of_a_matmul():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    assert count_flops(lambda: a @ b) == 2 * 64 * 32 * 16


def test_cpu_peak_is_the_best_calibration_seen(tmp_path):
    cache = tmp_path / "peak.json"
    first = peak_flops(torch.device("cpu"), "fp32", cache)
    assert first > 1e9  # any CPU that runs the tests does more than 1 GFLOP/s in a matmul
    (key,) = json.loads(cache.read_text())
    assert "fp32" in key and "threads=" in key
    # A higher figure from an earlier calibration stays (this one may run on a busy machine) ...
    cache.write_text(json.dumps({key: 1e18}))
    assert peak_flops(torch.device("cpu"), "fp32", cache) == 1e18
    # ... and a low one, measured under load, is replaced by the new measurement.
    cache.write_text(json.dumps({key: 1.0}))
    assert peak_flops(torch.device("cpu"), "fp32", cache) > 1e9
    assert json.loads(cache.read_text())[key] > 1e9


def test_unknown_device_or_dtype_has_no_peak(tmp_path):
    assert peak_flops(torch.device("cpu"), "int8", tmp_path / "p.json") is None
    assert peak_flops(torch.device("meta"), "fp32", tmp_path / "p.json") is None
