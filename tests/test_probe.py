"""The device probe: real measurements here, and a cache keyed by device and question that a busy
machine never writes."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

from aamperf.files import update_json_cache
from aamperf.interrupts import Interrupts, RunInterrupted
from aamperf.probe import Probe, device_key, model_shapes
from aamperf.probe_measures import (
    PAIRED_TRIALS,
    TRIALS,
    beyond,
    measure_attention,
    measure_matmul,
    timed_in_turn,
)

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


def test_measure_attention_times_the_candidates_in_turn(monkeypatch):
    # one after the other, a slow spell of the machine fell on one candidate and flipped a near tie
    import aamperf.probe_measures as probe_module

    turns = []
    real = probe_module.timed_in_turn

    def spy(*fns, **options):
        turns.append(len(fns))
        return real(*fns, **options)

    monkeypatch.setattr(probe_module, "timed_in_turn", spy)
    record = measure_attention(CPU, torch.float32, (4, 2, 16, 8), dropout=(0.1, "fast"))
    assert turns == [2] and record["sdpa_s"] > 0 and record["math_s"] > 0  # math and SDPA, alternating


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


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_first_run_says_what_it_measures_and_a_later_one_reads_the_cache(launch, tmp_path):
    cache = tmp_path / "probe.json"
    lines = []
    for name in ("first", "later"):
        proc, run_dir = launch("optim=basic", f"probe.cache={cache}", name=name)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines.append(
            [line for line in (run_dir / "train.log").read_text().splitlines() if "aamperf.probe" in line]
        )
    first, later = lines
    said = (
        "measuring matmul rates per dtype at the model's shapes (precision=auto) on this device (once: kept"
    )
    assert any(said in line and str(cache) in line for line in first)
    assert any(
        "measured matmul rates per dtype at the model's shapes (precision=auto): " in line for line in first
    )
    assert any("measuring SDPA against the written-out attention (attention=auto)" in line for line in first)
    assert later == []


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


@pytest.mark.parametrize(
    ("second_s", "bounds", "clear"),
    [
        ([0.7, 0.8, 0.75], (1.25,), True),  # all well below the bound
        ([1.5, 1.4, 1.6], (1.25,), True),  # all well above it
        ([0.7, 1.2, 0.75], (1.25,), False),  # one round within CLEAR of it
        ([0.7, 1.5, 0.75], (1.25,), False),  # rounds on both sides of it
        ([1.12, 1.2, 1.13], (1.0, 1.25), False),  # clear of 1.0, not of 1.25
        ([0.5, 0.5, 0.5], (1.0, 1.25), True),
    ],
)
def test_rounds_are_settled_only_where_all_lie_clearly_on_one_side_of_every_bound(second_s, bounds, clear):
    assert beyond(bounds)(([1.0, 1.0, 1.0], second_s)) is clear


def test_rounds_in_turn_end_early_where_they_settle_and_run_in_full_where_they_do_not():
    """The attention probe's 7 rounds took 7.4-8.7 s of a first run on a 2-core AVX2 EPYC: where SDPA and
    the math are clearly apart, PAIRED_TRIALS rounds decide as well; near where the choice turns, all run."""
    calls: list[str] = []

    def call(name: str, seconds: float) -> Callable[[], None]:
        return lambda: (calls.append(name), time.sleep(seconds))

    quick, slow = timed_in_turn(
        call("a", 0.01), call("b", 0.02), device=CPU, trials=TRIALS, settled=beyond((1.0,))
    )
    assert len(quick) == len(slow) == PAIRED_TRIALS and calls == ["a", "b"] * PAIRED_TRIALS
    quick, slow = timed_in_turn(
        call("a", 0.01), call("b", 0.02), device=CPU, trials=TRIALS, settled=beyond((2.0,))
    )
    assert len(quick) == len(slow) == TRIALS  # each round's ratio ~2, the bound itself: not settled
    # settled, but each function's calls must still fill the load watch's window
    quick, slow = timed_in_turn(
        call("a", 0.01), call("b", 0.02), device=CPU, trials=TRIALS, min_s=0.05, settled=beyond((1.0,))
    )
    assert sum(quick) >= 0.05 and PAIRED_TRIALS < len(quick) < TRIALS


def test_the_attention_probe_records_how_many_rounds_it_timed():
    record = measure_attention(CPU, torch.float32, (4, 2, 16, 8), bounds=(1.25,))
    assert record["rounds"] >= PAIRED_TRIALS and record["sdpa_s"] > 0 and record["math_s"] > 0


def _measured_through_a_stop_signal(caught: type[BaseException], went_on: list) -> Callable[[], dict]:
    """A measurement that catches `caught` around a stop signal, then goes on: Exception, as inductor's
    compile does (a RunInterrupted raised there read as "compile does not work here", and the compile
    went on), or even BaseException."""

    def measure() -> dict:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the handler runs here, in the main thread
        except caught:
            pass
        went_on.append(caught)
        return {"works": False, "error": "what the signal's exception became", "under_load": None}

    return measure


@pytest.mark.parametrize("caught", [Exception, BaseException])
def test_a_stop_signal_in_a_measurement_stops_the_run_and_caches_nothing(tmp_path, caught):
    cache, went_on = tmp_path / "probe.json", []
    measure = _measured_through_a_stop_signal(caught, went_on)
    with pytest.raises(RunInterrupted, match="^SIGTERM received before training began"), Interrupts():
        Probe(CPU, cache).answer("compile", {"block": None}, measure)
    assert not cache.exists()  # neither way
    # the handler's exception passes `except Exception` (at once: a compile does not go on for minutes)
    assert went_on == ([] if caught is Exception else [BaseException])
    quiet = {"works": True, "error": None, "under_load": None}  # a run after it measures and keeps it
    assert Probe(CPU, cache).answer("compile", {"block": None}, lambda: quiet)["source"] == "measured"
    assert Probe(CPU, cache).answer("compile", {"block": None}, lambda: quiet)["source"] == "cache"


@pytest.mark.slow
def test_a_stop_signal_during_inductors_first_compile_stops_the_probe_and_caches_nothing(tmp_path):
    """The real case: SIGTERM 2 s into the compile probe, in a new inductor cache (a first compile takes
    7 s or more on 2 cores): inductor caught the handler's exception (in its instruction-set check or the
    compile) and the run went on, with "torch.compile does not work here" cached for the device."""
    script = f"""
import os, signal, threading, torch
from aamperf.interrupts import Interrupts, RunInterrupted
from aamperf.probe import Probe
threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
try:
    with Interrupts():
        print(Probe(torch.device("cpu"), {str(tmp_path / "probe.json")!r}).compile(None, torch.float32))
except RunInterrupted as exc:
    print("stopped:", exc)
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cmd = [sys.executable, "-c", script]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.stdout.strip() == "stopped: SIGTERM received before training began; nothing to keep", proc
    assert not (tmp_path / "probe.json").exists()


def test_two_functions_timed_in_turn_alternate_until_each_fills_the_window():
    """The compile probe's eager and compiled block: called in turn, so a slow spell of the machine
    falls on both; at least `trials` pairs, more until each one's calls add up to `min_s`."""
    calls: list[str] = []

    def call(name: str, seconds: float) -> Callable[[], None]:
        return lambda: (calls.append(name), time.sleep(seconds))

    quick, slow = timed_in_turn(call("a", 0.001), call("b", 0.03), device=CPU, trials=3)
    assert calls == ["a", "b"] * 3 and len(quick) == len(slow) == 3
    assert all(q < 0.03 <= s for q, s in zip(quick, slow, strict=True))
    calls.clear()
    quick, slow = timed_in_turn(call("a", 0.001), call("b", 0.03), device=CPU, trials=3, min_s=0.05)
    assert sum(quick) >= 0.05 and len(quick) == len(slow) == len(calls) // 2 > 3  # the quick one sets it
    assert calls == ["a", "b"] * len(quick)
