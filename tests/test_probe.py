"""The device probe: real measurements here, and a cache keyed by device and question that a busy
machine never writes."""

import json

import torch

from aamperf.files import update_json_cache
from aamperf.probe import Probe, device_key, measure_attention, measure_matmul, model_shapes

CPU = torch.device("cpu")


def test_measure_matmul_times_every_dtype_at_the_given_shapes():
    record = measure_matmul(CPU, [(256, 32, 64)])
    assert set(record["flops"]) == {"fp32", "bf16"}
    assert all(rate > 1e6 for rate in record["flops"].values())  # at least a MFLOP/s: something was timed
    assert record["shapes"] == [[256, 32, 64]]


def test_measure_attention_names_the_kernels_that_run_and_times_both():
    record = measure_attention(CPU, torch.float32, (4, 2, 16, 8))
    assert "math" in record["backends"] and "cuda" not in " ".join(record["backends"])
    assert record["sdpa_s"] > 0 and record["math_s"] > 0


def test_inference_times_attention_forward_alone_under_its_own_cache_key(tmp_path):
    probe = Probe(CPU, tmp_path / "probe.json")
    shape = (4, 2, 16, 8)
    trained = {"backends": ["math"], "backward": True, "sdpa_s": 123.0, "math_s": 456.0, "under_load": None}
    key = probe._key("attention", {"dtype": torch.float32, "shape": shape})  # training's key, as before
    update_json_cache(probe.cache_file, key, trained)
    assert probe.attention(torch.float32, shape)["sdpa_s"] == 123.0  # training's answer, from the cache
    inference = probe.attention(torch.float32, shape, backward=False)  # not training's: measured now
    assert inference["backward"] is False and inference["source"] != "cache"
    assert 0 < inference["sdpa_s"] < 123.0 and 0 < inference["math_s"] < 456.0


def test_training_with_attention_dropout_is_timed_with_it_under_its_own_cache_key(tmp_path):
    probe = Probe(CPU, tmp_path / "probe.json")
    shape = (4, 2, 16, 8)
    without = {"backends": ["math"], "backward": True, "sdpa_s": 123.0, "math_s": 456.0, "under_load": None}
    update_json_cache(
        probe.cache_file, probe._key("attention", {"dtype": torch.float32, "shape": shape}), without
    )
    with_dropout = probe.attention(torch.float32, shape, dropout=(0.1, "fast"))  # not the dropout-free answer
    assert with_dropout["dropout_p"] == 0.1 and with_dropout["source"] != "cache"
    assert 0 < with_dropout["sdpa_s"] < 123.0 and 0 < with_dropout["math_s"] < 456.0
    again = probe.attention(torch.float32, shape, dropout=(0.1, "fast"))
    assert again["source"] == "cache" or again["source"] == "measured_under_load"
    assert probe.attention(torch.float32, shape, backward=False, dropout=(0.1, "fast"))["dropout_p"] == 0.0


def test_model_shapes_follow_the_model_config(make_cfg):
    cfg = make_cfg()
    matmuls, attention = model_shapes(cfg.model, 4, cfg.data.max_asvs)
    dim, length = cfg.model.embedding_dim, cfg.model.seq_len
    rows = 4 * cfg.data.max_asvs
    assert matmuls[0] == (rows * length, dim, cfg.model.ffn_mult * dim)
    assert attention == (rows, cfg.model.num_heads, length, dim // cfg.model.num_heads)
    assert model_shapes({"_target_": "x"}, 4, 16) == ([], None)


def quiet(value):
    return lambda: {"value": value, "under_load": None}


def busy(value):
    return lambda: {"value": value, "under_load": "other processes used 1.5 cores while it ran"}


def test_a_quiet_answer_is_cached_and_reused(tmp_path):
    probe = Probe(CPU, tmp_path / "probe.json")
    assert probe.answer("q", {"n": 1}, quiet(1))["source"] == "measured"
    again = probe.answer("q", {"n": 1}, quiet(2))  # would measure 2: the cached 1 is read instead
    assert (again["value"], again["source"]) == (1, "cache")
    other = probe.answer("q", {"n": 2}, quiet(3))  # other parameters: another entry
    assert (other["value"], other["source"]) == (3, "measured")
    keys = json.loads((tmp_path / "probe.json").read_text())
    assert len(keys) == 2 and all(k.startswith(device_key(CPU)) for k in keys)


def test_refresh_measures_again_and_replaces_the_answer(tmp_path):
    Probe(CPU, tmp_path / "probe.json").answer("q", {}, quiet(1))
    fresh = Probe(CPU, tmp_path / "probe.json", refresh=True).answer("q", {}, quiet(2))
    assert (fresh["value"], fresh["source"]) == (2, "measured")
    assert Probe(CPU, tmp_path / "probe.json").answer("q", {}, quiet(3))["value"] == 2


def test_an_answer_measured_under_load_is_not_cached_and_a_quiet_one_wins(tmp_path):
    probe = Probe(CPU, tmp_path / "probe.json")
    first = probe.answer("q", {}, busy(1))
    assert (first["value"], first["source"]) == (1, "measured_under_load")
    assert not (tmp_path / "probe.json").exists()
    probe.answer("q", {}, quiet(2))
    refreshed = Probe(CPU, tmp_path / "probe.json", refresh=True).answer("q", {}, busy(3))
    assert (refreshed["value"], refreshed["source"]) == (2, "cache")  # the busy 3 is rejected
    assert refreshed["rejected"]["value"] == 3


def test_the_cache_is_per_thread_count(tmp_path):
    threads = torch.get_num_threads()
    Probe(CPU, tmp_path / "probe.json").answer("q", {}, quiet(1))
    try:
        torch.set_num_threads(threads + 1)
        other = Probe(CPU, tmp_path / "probe.json").answer("q", {}, quiet(2))
    finally:
        torch.set_num_threads(threads)
    assert (other["value"], other["source"]) == (2, "measured")  # a matmul rate depends on the threads


def test_a_measurement_leaves_the_random_stream_as_it_was(tmp_path):
    """A run that measures (first on a machine) draws the same weights and dropout as one that reads the
    cache: the probe's own random tensors come from a forked stream."""
    torch.manual_seed(0)
    Probe(CPU, tmp_path / "probe.json").answer(
        "q", {}, lambda: {"x": torch.randn(3).tolist(), "under_load": None}
    )
    after_measuring = torch.rand(2)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(2), after_measuring)


def test_the_cache_is_per_instruction_set_torch_uses(tmp_path, monkeypatch):
    """oneDNN held to AVX2 (how a CPU without AVX-512 runs torch's bf16 matmuls) is another device for the
    cache, though /proc/cpuinfo is the same: its answers are measured, not read."""
    assert f"isa={torch.backends.cpu.get_cpu_capability()}" in device_key(CPU)
    Probe(CPU, tmp_path / "probe.json").answer("q", {}, quiet(1))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    other = Probe(CPU, tmp_path / "probe.json").answer("q", {}, quiet(2))
    assert (other["value"], other["source"]) == (2, "measured")
