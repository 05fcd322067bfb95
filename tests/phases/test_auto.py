"""`auto` options: each decided from the probe's answer, both ways, and read back from its cache."""

import json

import pytest
import torch

from aamperf.distributed import World
from aamperf.phases.auto import choose_attention, choose_precision, resolve_auto
from aamperf.probe import Probe, device_key, model_shapes

CPU = torch.device("cpu")


class Injected:
    """A probe whose answers are given: what a device with these figures would have measured."""

    def __init__(self, matmul=None, attention=None):
        self._matmul, self._attention = matmul, attention

    def matmul(self, shapes):
        return {"flops": self._matmul, "shapes": shapes, "source": "cache"}

    def attention(self, dtype, shape):
        return {**self._attention, "source": "cache"}


@pytest.mark.parametrize(
    ("bf16_flops", "chosen"),
    [(400e9, "bf16"), (60e9, "fp32"), (110e9, "fp32")],  # AMX-like, AVX-512 BF16 at small shapes, marginal
)
def test_precision_auto_takes_bf16_only_where_its_matmuls_gain_enough(bf16_flops, chosen):
    decision = choose_precision(CPU, Injected(matmul={"fp32": 100e9, "bf16": bf16_flops}), [(8, 8, 8)])
    assert decision["chose"] == chosen
    assert f"bf16 matmul {bf16_flops / 100e9:.2f}x fp32" in decision["reason"]


@pytest.mark.parametrize(("sdpa_s", "chosen"), [(0.5, "sdpa"), (1.5, "math")])
def test_attention_auto_takes_the_faster_implementation(sdpa_s, chosen):
    answer = {"backends": ["flash", "math"], "sdpa_s": sdpa_s, "math_s": 1.0}
    decision = choose_attention(CPU, Injected(attention=answer), torch.float32, (4, 2, 16, 8))
    assert decision["chose"] == chosen and f"{sdpa_s:.2f}x the math's time" in decision["reason"]


def test_attention_auto_takes_the_math_where_no_sdpa_kernel_runs():
    answer = {"backends": [], "sdpa_s": 0.1, "math_s": 1.0}
    decision = choose_attention(CPU, Injected(attention=answer), torch.float32, None)
    assert decision["chose"] == "math" and "no SDPA kernel" in decision["reason"]


def test_resolve_auto_reads_the_cached_probe_and_writes_the_choices_into_the_config(make_cfg, tmp_path):
    cfg = make_cfg("precision=auto", "attention=auto", f"probe.cache={tmp_path}/probe.json")
    micro_batch = cfg.trainer.batch_size
    matmuls, attention = model_shapes(cfg.model, micro_batch, cfg.data.max_asvs)
    key = device_key(CPU)
    # what a device where bf16 is slow and SDPA fast would have cached (keys as Probe.answer writes them)
    cache = {
        f"{key}|matmul|shapes={matmuls}": {"flops": {"fp32": 100e9, "bf16": 50e9}, "shapes": matmuls},
        f"{key}|attention|dtype={torch.float32},shape={attention}": {
            "backends": ["flash", "math"],
            "sdpa_s": 0.2,
            "math_s": 1.0,
        },
    }
    (tmp_path / "probe.json").write_text(json.dumps(cache))
    decisions = resolve_auto(cfg, CPU, micro_batch, World())
    assert (cfg.precision.dtype, cfg.attention.impl) == ("fp32", "sdpa")
    assert decisions["precision"]["source"] == decisions["attention"]["source"] == "cache"
    assert "bf16 matmul 0.50x fp32" in decisions["precision"]["reason"]


def test_resolve_auto_measures_on_this_device_when_nothing_is_cached(make_cfg, tmp_path):
    cfg = make_cfg("precision=auto", "attention=auto", f"probe.cache={tmp_path}/probe.json")
    decisions = resolve_auto(cfg, CPU, cfg.trainer.batch_size, World())
    assert decisions["precision"]["source"] in ("measured", "measured_under_load")
    assert cfg.precision.dtype in ("fp32", "bf16") and cfg.attention.impl in ("math", "sdpa")
    flops = decisions["precision"]["matmul_flops"]
    assert (cfg.precision.dtype == "bf16") == (flops["bf16"] / flops["fp32"] >= 1.15)


def test_no_auto_no_probe(make_cfg, tmp_path):
    cfg = make_cfg(f"probe.cache={tmp_path}/probe.json")
    assert resolve_auto(cfg, CPU, 4, World()) == {}
    assert not (tmp_path / "probe.json").exists()
    assert Probe(CPU, tmp_path / "probe.json").key == device_key(CPU)
