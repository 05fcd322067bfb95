"""`auto` options: each decided from the probe's answer, both ways, and read back from its cache."""

import json
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
from conftest import skip_where_others_busy
from omegaconf import OmegaConf

from aamperf.phases.auto import (
    MIN_MATH_GAIN,
    MIN_MATMUL_GAIN,
    choose_attention,
    choose_checkpointing,
    choose_precision,
    resolve_auto,
)
from aamperf.probe import Probe, device_key, model_shapes

CPU = torch.device("cpu")


class Injected:
    """A probe whose answers are given: what a device with these figures would have measured."""

    def __init__(self, matmul=None, attention=None):
        self._matmul, self._attention = matmul, attention

    def matmul(self, shapes):
        return {"flops": self._matmul, "shapes": shapes, "source": "cache"}

    def attention(self, dtype, shape, *, backward=True, dropout=(0.0, "standard"), bounds=()):
        self.asked_backward, self.asked_dropout, self.asked_bounds = backward, dropout, bounds
        return {**self._attention, "source": "cache"}


@pytest.mark.parametrize(
    ("bf16_flops", "chosen"),
    [(400e9, "bf16"), (60e9, "fp32"), (110e9, "fp32")],  # AMX-like, AVX-512 BF16 at small shapes, marginal
)
def test_precision_auto_takes_bf16_only_where_its_matmuls_gain_enough(bf16_flops, chosen):
    decision = choose_precision(CPU, Injected(matmul={"fp32": 100e9, "bf16": bf16_flops}), [(8, 8, 8)])
    assert decision["chose"] == chosen
    assert f"bf16 matmul {bf16_flops / 100e9:.2f}x fp32" in decision["reason"]


def test_precision_auto_for_a_model_of_unknown_shapes_says_it_measured_a_square_matmul(tmp_path):
    """Another model than AAM: its matmul shapes are not known before it runs, and the reason says so
    rather than claim the model's shapes."""
    from aamperf.metrics.flops import square_shape

    decision = choose_precision(CPU, Probe(CPU, tmp_path / "probe.json"), [])
    square = square_shape(torch.get_num_threads())
    assert decision["shapes"] == [list(square)]
    said = f"at a {'x'.join(map(str, square))} matmul (this model's shapes are not known)"
    assert said in decision["reason"]
    assert decision["chose"] in ("fp32", "bf16")


@pytest.mark.parametrize(("fp32_s", "low_s", "chosen"), [(0.020, 0.015, "fp16"), (0.019, 0.028, "fp32")])
def test_precision_auto_on_a_gpu_keeps_the_low_dtype_only_where_its_steps_are_faster(fp32_s, low_s, chosen):
    """The step trial's figures decide after the matmul rate (an H100: fp16 matmuls 1.58x fp32's, its
    steps 0.68x fp32's speed); the reason keeps the matmul's figure and adds the steps'."""
    from aamperf.phases.precision import confirm_precision

    decision = {
        "chose": "fp16",
        "reason": "fp16 matmul 1.58x fp32 at the model's shapes here (>= 1.15): fp16",
    }
    changed = confirm_precision(decision, {"step_s": {"fp16": low_s, "fp32": fp32_s}, "batches": 4})
    assert decision["chose"] == chosen and changed == (chosen == "fp32")
    assert decision["reason"].startswith("fp16 matmul 1.58x fp32 at the model's shapes here (>= 1.15); ")
    assert decision["reason"].endswith(
        f"over 4 batches; {'>=' if chosen == 'fp16' else '<'} 1.05x faster): {chosen}"
    )
    assert f"ran {low_s / fp32_s:.2f}x fp32's time" in decision["reason"]


def test_the_precision_step_trial_times_real_steps_decides_by_them_and_caches_them(make_cfg, tmp_path):
    """confirm_low_precision on this CPU's real steps (runs call it on GPUs; its timing is the device's
    own): the run's dtype is the one the figures favour, the config says it, the second call reads
    the cache, and the steps leave no gradients behind."""
    from hydra.utils import instantiate

    from aamperf.data import build_data
    from aamperf.device import to_device
    from aamperf.job import warmup_step
    from aamperf.phases import confirm_low_precision

    cfg = make_cfg("precision=bf16", f"probe.cache={tmp_path / 'probe.json'}")
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    warmup = warmup_step(loss_fn, [to_device(b, CPU) for b in list(data.train_loader)[:2]])
    sources = []
    for _ in range(2):
        cfg.precision.dtype = "bf16"
        decision = {
            "chose": "bf16",
            "reason": "bf16 matmul 2.00x fp32 at the model's shapes here (>= 1.15): bf16",
        }
        changed = confirm_low_precision(model, cfg, CPU, warmup, decision, micro_batch=4)
        step_s = decision["step_trial"]["step_s"]
        kept = step_s["fp32"] / step_s["bf16"] >= 1.05
        assert decision["chose"] == cfg.precision.dtype == ("bf16" if kept else "fp32")
        assert changed == (not kept) and decision["decide_s"] > 0
        sources.append(decision["step_trial"]["source"])
    assert sources == ["measured", "cache"]
    assert all(p.grad is None for p in model.parameters())


# torch's kernels held to AVX2, as on a CPU without AVX-512 (oneDNN's bf16 matmul: no native instructions)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_precision_auto_measures_fp32_where_bf16_matmuls_have_no_native_instructions(tmp_path):
    """The fp32 outcome measured, not injected: in a process whose kernels are held to AVX2 the probe
    times bf16 matmuls far below fp32's and precision=auto takes fp32."""
    skip_where_others_busy()  # the two rates timed beside another program's load can come out either way
    script = (
        "import json, sys, torch\n"
        "from aamperf.phases.auto import choose_precision\n"
        "from aamperf.probe import Probe\n"
        "cpu = torch.device('cpu')\n"
        "probe, shapes = Probe(cpu, sys.argv[1]), [(512, 64, 256), (256, 256, 64)]\n"
        "print(json.dumps([choose_precision(cpu, probe, shapes), probe.matmul(shapes)]))\n"
    )
    env = {**os.environ, **AVX2_ONLY}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "probe.json")], env=env, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
    decision, answer = json.loads(done.stdout.decode().splitlines()[-1])
    assert decision["chose"] == "fp32" and decision["source"] in ("measured", "measured_under_load")
    assert decision["matmul_flops"]["bf16"] < decision["matmul_flops"]["fp32"] / MIN_MATMUL_GAIN
    # one warm bf16 call far below fp32's rate settled each shape: its seconds-long trials were not run
    assert answer["settled"] == {"fp32": False, "bf16": True}


@pytest.mark.parametrize(("sdpa_s", "chosen"), [(0.5, "sdpa"), (1.5, "math")])
def test_attention_auto_takes_the_faster_implementation(sdpa_s, chosen):
    answer = {"backends": ["flash", "math"], "sdpa_s": sdpa_s, "math_s": 1.0}
    decision = choose_attention(CPU, Injected(attention=answer), torch.float32, (4, 2, 16, 8))
    assert decision["chose"] == chosen and f"{sdpa_s:.2f}x the math's time" in decision["reason"]


@pytest.mark.parametrize(("sdpa_s", "chosen"), [(1.16, "sdpa"), (1.25, "sdpa"), (1.3, "math")])
def test_attention_auto_leaves_a_near_tie_to_sdpa_and_says_so(sdpa_s, chosen):
    # the math keeps its probabilities for backward: it must be MIN_MATH_GAIN quicker to be chosen
    answer = {"backends": ["flash", "math"], "sdpa_s": sdpa_s, "math_s": 1.0}
    decision = choose_attention(CPU, Injected(attention=answer), torch.bfloat16, (4, 2, 16, 8))
    assert decision["chose"] == chosen
    assert ("a near tie" in decision["reason"]) == (chosen == "sdpa")
    # prediction's forward pass alone keeps nothing for backward: the quicker one
    inference = choose_attention(
        CPU, Injected(attention=answer), torch.bfloat16, (4, 2, 16, 8), backward=False
    )
    assert inference["chose"] == "math" and "a near tie" not in inference["reason"]


def test_attention_auto_for_inference_asks_for_a_forward_pass_alone():
    probe = Injected(attention={"backends": ["math"], "sdpa_s": 0.5, "math_s": 1.0})
    decision = choose_attention(CPU, probe, torch.float32, (4, 2, 16, 8), backward=False)
    assert probe.asked_backward is False and "SDPA forward 0.50x the math's time" in decision["reason"]
    assert probe.asked_bounds == (1.0,)  # where inference's choice turns: the probe may stop once clear of it
    choose_attention(CPU, probe, torch.float32, (4, 2, 16, 8))
    assert probe.asked_backward is True  # training's question: forward + backward
    assert probe.asked_bounds == (MIN_MATH_GAIN,)


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
        # aam_tiny's dropout 0.1 on the attention weights, drawn as dropout=standard draws it
        f"{key}|attention|dropout=[0.1, 'standard'],dtype={torch.float32},shape={attention}": {
            "backends": ["flash", "math"],
            "sdpa_s": 0.2,
            "math_s": 1.0,
        },
    }
    (tmp_path / "probe.json").write_text(json.dumps(cache))
    decisions = resolve_auto(cfg, CPU, micro_batch)
    assert (cfg.precision.dtype, cfg.attention.impl) == ("fp32", "sdpa")
    assert decisions["precision"]["source"] == decisions["attention"]["source"] == "cache"
    assert "bf16 matmul 0.50x fp32" in decisions["precision"]["reason"]
    assert "SDPA forward+backward with dropout 0.1 0.20x the math's time" in decisions["attention"]["reason"]


# A GPU's answer (figures of the H200 that showed it, rounded): cuDNN's SDPA is the quickest at a shape it
# has run, and far the slowest at a row count it has not (a plan built per shape)
GPU_ATTENTION = {
    "backends": ["flash", "efficient", "cudnn", "math"],
    "sdpa_s": 0.5,
    "sdpa_no_cudnn_s": 0.7,
    "math_s": 1.0,
    "no_cudnn_backends": ["efficient", "math"],
    "new_shape_s": {"math": 1.1, "sdpa": 40.0, "sdpa_no_cudnn": 0.8},
}


def test_attention_auto_leaves_cudnn_out_where_the_rows_change_and_its_plans_would_cost():
    decision = choose_attention(CPU, Injected(attention=GPU_ATTENTION), torch.bfloat16, (4, 2, 16, 8))
    assert decision["chose"] == "sdpa" and decision["sdpa_backends"] == ["efficient", "math"]
    assert (
        "SDPA without cuDNN forward+backward 0.73x the math's time at a row count not run before"
        in (decision["reason"])
    )
    assert "(with it 36.36x)" in decision["reason"]
    # bucketed rows (a few shapes, each planned once): the steady calls decide, cuDNN's kernel included
    steady = choose_attention(
        CPU, Injected(attention=GPU_ATTENTION), torch.bfloat16, (4, 2, 16, 8), shapes_vary=False
    )
    assert steady["chose"] == "sdpa" and "sdpa_backends" not in steady
    assert "SDPA forward+backward 0.50x the math's time at [4, 2, 16, 8]" in steady["reason"]


def test_attention_auto_takes_the_math_where_every_sdpa_is_slower_at_new_row_counts():
    answer = {**GPU_ATTENTION, "new_shape_s": {"math": 1.0, "sdpa": 40.0, "sdpa_no_cudnn": 1.4}}
    decision = choose_attention(CPU, Injected(attention=answer), torch.bfloat16, (4, 2, 16, 8))
    assert decision["chose"] == "math" and "sdpa_backends" not in decision


@pytest.mark.parametrize(("aam_ops", "backends"), [("plain", ["efficient", "math"]), ("fast", [])])
def test_resolve_auto_asks_for_new_row_counts_unless_the_rows_are_bucketed(
    make_cfg, tmp_path, aam_ops, backends
):
    cfg = make_cfg("attention=auto", f"aam_ops={aam_ops}", f"probe.cache={tmp_path}/probe.json")
    _, attention = model_shapes(cfg.model, cfg.trainer.batch_size, cfg.data.max_asvs)
    key = f"{device_key(CPU)}|attention|dropout=[0.1, 'standard'],dtype={torch.float32},shape={attention}"
    (tmp_path / "probe.json").write_text(json.dumps({key: GPU_ATTENTION}))
    decisions = resolve_auto(cfg, CPU, cfg.trainer.batch_size)
    assert cfg.attention.impl == "sdpa" and decisions["attention"]["source"] == "cache"
    assert [str(b) for b in cfg.attention.backends] == backends  # written into the run's config


def test_resolve_auto_measures_on_this_device_when_nothing_is_cached(make_cfg, tmp_path):
    cfg = make_cfg("precision=auto", "attention=auto", f"probe.cache={tmp_path}/probe.json")
    decisions = resolve_auto(cfg, CPU, cfg.trainer.batch_size)
    assert decisions["precision"]["source"] in ("measured", "measured_under_load")
    assert cfg.precision.dtype in ("fp32", "bf16") and cfg.attention.impl in ("math", "sdpa")
    flops = decisions["precision"]["matmul_flops"]
    assert (cfg.precision.dtype == "bf16") == (flops["bf16"] / flops["fp32"] >= 1.15)


@pytest.mark.parametrize(
    ("dtype", "attention", "chosen"),
    [
        ("fp32", "math", "selective"),
        ("fp32", "sdpa", "none"),
        ("bf16", "math", "none"),
        ("fp16", "sdpa", "none"),
    ],
)
def test_memory_auto_recomputes_only_fp32_activations_with_the_written_out_attention(
    dtype, attention, chosen
):
    decision = choose_checkpointing(dtype, attention, 2)
    assert decision["chose"] == chosen and f"activations kept in {dtype}" in decision["reason"]


def test_memory_auto_follows_the_precision_that_precision_auto_chose(make_cfg, tmp_path):
    cfg = make_cfg("precision=auto", "memory=auto", f"probe.cache={tmp_path}/probe.json")
    matmuls, _ = model_shapes(cfg.model, cfg.trainer.batch_size, cfg.data.max_asvs)
    for bf16, checkpointing in ((400e9, "none"), (50e9, "selective")):  # bf16 pays here / does not
        cache = {
            f"{device_key(CPU)}|matmul|shapes={matmuls}": {
                "flops": {"fp32": 100e9, "bf16": bf16},
                "shapes": matmuls,
            }
        }
        (tmp_path / "probe.json").write_text(json.dumps(cache))
        cfg.precision.dtype, cfg.memory.checkpointing = "auto", "auto"
        decisions = resolve_auto(cfg, CPU, cfg.trainer.batch_size)
        assert cfg.memory.checkpointing == checkpointing == decisions["checkpointing"]["chose"]
        assert decisions["checkpointing"]["dtype"] == cfg.precision.dtype


def test_memory_auto_follows_the_attention_that_attention_auto_chose(make_cfg, tmp_path):
    cfg = make_cfg("precision=fp32", "attention=auto", "memory=auto", f"probe.cache={tmp_path}/probe.json")
    _, shape = model_shapes(cfg.model, cfg.trainer.batch_size, cfg.data.max_asvs)
    key = f"{device_key(CPU)}|attention|dropout=[0.1, 'standard'],dtype={torch.float32},shape={shape}"
    for sdpa_s, attention, checkpointing in ((0.5, "sdpa", "none"), (2.0, "math", "selective")):
        answer = {"backends": ["flash", "math"], "sdpa_s": sdpa_s, "math_s": 1.0}
        (tmp_path / "probe.json").write_text(json.dumps({key: answer}))
        cfg.attention.impl, cfg.memory.checkpointing = "auto", "auto"
        decisions = resolve_auto(cfg, CPU, cfg.trainer.batch_size)
        assert decisions["attention"]["source"] == "cache"
        assert (cfg.attention.impl, cfg.memory.checkpointing) == (attention, checkpointing)


def test_no_auto_no_probe(make_cfg, tmp_path):
    cfg = make_cfg(f"probe.cache={tmp_path}/probe.json")
    assert resolve_auto(cfg, CPU, 4) == {}
    assert not (tmp_path / "probe.json").exists()
    assert Probe(CPU, tmp_path / "probe.json").key == device_key(CPU)


# ---- compile=auto: a trial's figures (injected through the probe's cache, or measured) decide ----------

COMPILE = {"mode": "auto", "backend": "inductor", "dynamic": None, "fullgraph": False, "per_block": True}


class Tiny(torch.nn.Module):
    """Defined here, not a torch.nn built-in: dynamo does not compile a top-level frame of torch's own."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def tiny_step():
    from omegaconf import OmegaConf

    model = Tiny()
    batches = [torch.randn(4 + i, 8) for i in range(2)]

    def step(i: int) -> None:
        model(batches[i % 2]).sum().backward()
        model.zero_grad(set_to_none=True)

    return model, OmegaConf.create(COMPILE), step


SMALL = {"block": None, "dtype": torch.float32}  # auto_compile's probe question for a model without a shape


def block_answer(compile_s, eager_s=1.0, compiled_s=0.5):
    return {
        "works": True,
        "error": None,
        "block": [4, 16, 32, 2, 4],
        "dtype": "float32",
        "block_compile_s": compile_s,
        "eager_block_s": eager_s,
        "compiled_block_s": compiled_s,
    }


def inject(probe, question, params, figures):
    probe.answer(question, params, lambda: {**figures, "under_load": None})


@pytest.mark.parametrize(("steps", "compiled"), [(100, True), (10, False)])
def test_compile_auto_follows_a_cached_trial(tmp_path, steps, compiled):
    from aamperf.phases.compile import auto_compile

    model, cfg, step = tiny_step()
    cfg.backend = "eager"  # dynamo without inductor: what is tested is the decision (15 s less, cold)
    probe = Probe(CPU, tmp_path / "probe.json")
    figures = {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 10.0, "graphs": 1}
    inject(probe, "compile_trial", {"context": "c"}, figures)  # saves 0.5 s a step; 10 s to compile
    record = auto_compile(model, cfg, step, 2, steps, probe, "c")
    torch._dynamo.reset()
    assert record["auto"]["chose"] == ("default" if compiled else "disabled")
    assert record["status"] == ("applied" if compiled else "skipped")
    assert (model._compiled_call_impl is not None) == compiled
    assert f"{0.5 * steps:.1f} s saved over {steps} steps" in record["auto"]["reason"]


def test_compile_auto_stays_eager_where_compile_does_not_work(tmp_path):
    from aamperf.phases.compile import auto_compile

    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compile", SMALL, {"works": False, "error": "InvalidCxxCompiler: no working C++ compiler"})
    record = auto_compile(model, cfg, step, 2, 1000, probe, "c")
    assert record["status"] == "skipped" and "does not work here" in record["reason"]
    assert model._compiled_call_impl is None


def test_compile_auto_skips_a_trial_that_cannot_pay(tmp_path, monkeypatch):
    from aamperf.phases.compile import LoadWatch, auto_compile

    # a quiet machine, so that the timed step is kept (the load check has tests of its own)
    monkeypatch.setattr(LoadWatch, "verdict", staticmethod(lambda *args, **kwargs: None))
    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    other_block = {"block": (8, 32, 64, 2, 4), "dtype": torch.bfloat16}  # another model's, compiled here
    inject(probe, "compile", other_block, block_answer(compile_s=1e6))  # compiling costs more than any gain

    def no_probe(*args):
        raise AssertionError("a block was compiled although any gain is below the compile cost known here")

    monkeypatch.setattr(probe, "compile", no_probe)
    record = auto_compile(model, cfg, step, 2, 100, probe, "c")
    assert record["auto"]["chose"] == "disabled" and "compiling cannot pay" in record["reason"]
    assert "the quickest block compile measured on this device" in record["reason"]
    assert probe.cached("compile_trial", {"context": "c"}) is None  # no trial ran
    # the one eager step it timed is kept for this device, model and batch: the next run times none
    timed_s = record["auto"]["eager_step_s"]
    assert timed_s > 0 and probe.cached("eager_step", {"context": "c"})["eager_step_s"] == timed_s

    def no_step(i: int) -> None:
        raise AssertionError("a step was timed although its time is cached")

    again = auto_compile(model, cfg, no_step, 2, 100, probe, "c")
    assert again["auto"]["eager_step_s"] == timed_s and again["reason"] == record["reason"]


@pytest.mark.parametrize(
    ("least_step_s", "eager_step_s", "import_s", "by_import"),
    # the short run's import is long enough that its tiny steps, timed, stay under it on a busy machine too
    [(1e-6, None, 60.0, True), (10.0, None, 5.0, False), (1e-6, 10.0, 5.0, False)],
    ids=["short-run", "flops-too-many", "steps-too-slow"],
)
def test_compile_auto_on_a_device_that_compiled_nothing_weighs_the_run_against_the_compilers_import(
    tmp_path, monkeypatch, least_step_s, eager_step_s, import_s, by_import
):
    """3 steps against an import of the compiler (injected): a run whose steps take less in all stays
    eager without a block probe; one whose FLOPs at the peak already outweigh the import times no step and
    goes on to the probe; one whose timed steps outweigh it goes on to the probe too."""
    from aamperf.phases import compile as compile_phase

    monkeypatch.setattr(compile_phase, "compiler_imported", lambda: False)  # this process compiled before
    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compiler_import", {}, {"import_s": import_s})
    if eager_step_s is not None:
        inject(probe, "eager_step", {"context": "c"}, {"eager_step_s": eager_step_s})
    probed = []  # the block probe, not cached yet: its answer given here (slower compiled: no trial)
    monkeypatch.setattr(
        probe, "compile", lambda *args: probed.append(args) or block_answer(30.0, compiled_s=1.3)
    )
    record = compile_phase.auto_compile(model, cfg, step, 2, 3, probe, "c", least_step_s=least_step_s)
    assert record["auto"]["chose"] == "disabled" and model._compiled_call_impl is None
    assert len(probed) == (0 if by_import else 1)
    if by_import:
        assert f"(at least {import_s} s: importing torch's compiler, measured here)" in record["reason"]
        # the step it timed (the record's: one timed under load, e.g. beside another suite, is not cached)
        assert 0 < record["auto"]["eager_step_s"] < import_s / 3
    else:
        assert "ran 1.30x its eager time" in record["reason"]  # the block probe decided
    if least_step_s == 10.0:
        assert probe.cached("eager_step", {"context": "c"}) is None  # no step timed for the import


def test_compile_auto_asks_nothing_of_the_import_where_the_compiler_is_loaded(tmp_path, monkeypatch):
    from aamperf.phases import compile as compile_phase

    monkeypatch.setattr(compile_phase, "compiler_imported", lambda: True)
    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    monkeypatch.setattr(probe, "compiler_import", lambda: pytest.fail("compiling here would not import it"))
    monkeypatch.setattr(probe, "compile", lambda *args: block_answer(30.0, compiled_s=1.3))  # not cached
    record = compile_phase.auto_compile(model, cfg, step, 2, 3, probe, "c", least_step_s=1e-6)
    assert "ran 1.30x its eager time" in record["reason"]


def test_the_compilers_import_is_measured_in_a_process_that_has_not_loaded_it():
    code = (
        "from aamperf.probe_measures import compiler_imported, measure_compiler_import\n"
        "before = compiler_imported(); r = measure_compiler_import()\n"
        "print(before, compiler_imported(), r['import_s'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, import_s = out.split()
    assert (before, after) == ("False", "True") and float(import_s) > 0.1


def test_compile_auto_skips_a_trial_whose_gain_at_the_probed_speed_is_below_its_cost(tmp_path):
    """100 steps of 1 s could pay a 60 s compile, but at the probe's 0.5x a step they gain 50 s: no trial."""
    from aamperf.phases.compile import auto_compile

    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compile", SMALL, block_answer(compile_s=60.0, eager_s=1.0, compiled_s=0.5))
    inject(probe, "eager_step", {"context": "c"}, {"eager_step_s": 1.0})
    record = auto_compile(model, cfg, step, 2, 100, probe, "c")
    assert record["auto"]["chose"] == "disabled"
    assert "100 steps of 1 s can gain at most 50.0 s; compiling costs at least 60.0 s" in record["reason"]
    assert probe.cached("compile_trial", {"context": "c"}) is None


def test_compile_auto_counts_one_graph_for_blocks_that_share_it(tmp_path, monkeypatch):
    """Three blocks and a 40 s block compile: the 50 s gain bound exceeds the one graph's 40 s (the blocks
    reuse it), so the trial decides; counting 40 s a block (120 s) would have skipped it."""
    from omegaconf import OmegaConf

    from aamperf.model.layers import Block
    from aamperf.phases import compile as compile_phase

    model = torch.nn.Sequential(*(Block(8, 2, 4, 0.0) for _ in range(3)))
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compile", SMALL, block_answer(compile_s=40.0, eager_s=1.0, compiled_s=0.5))
    inject(probe, "eager_step", {"context": "c"}, {"eager_step_s": 1.0})
    trial = {"eager_step_s": 1.0, "compiled_step_s": 0.9, "compile_s": 30.0, "graphs": 1, "under_load": None}
    trials = []
    monkeypatch.setattr(compile_phase, "compile_trial", lambda *args: trials.append(args) or trial)
    cfg = OmegaConf.create(COMPILE)
    record = compile_phase.auto_compile(model, cfg, lambda i: None, 2, 100, probe, "c")
    assert len(trials) == 1 and record["auto"]["chose"] == "default"  # the trial compiled it: 10 s saved
    assert "10.0 s saved over 100 steps" in record["auto"]["reason"]


def test_compile_auto_skips_the_trial_where_a_compiled_block_is_slower_here(tmp_path):
    from aamperf.phases.compile import auto_compile

    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compile", SMALL, block_answer(compile_s=0.0, compiled_s=1.3))  # free, but slower
    record = auto_compile(model, cfg, step, 2, 10**6, probe, "c")
    assert record["auto"]["chose"] == "disabled" and "ran 1.30x its eager time" in record["reason"]
    assert "compiling cannot pay" in record["reason"] and model._compiled_call_impl is None


def test_compile_auto_times_no_step_where_the_cached_probe_says_compiling_is_slower(tmp_path):
    """The headline's second run here timed an eager step (6.6 s) to compare with the quickest compile
    known here, although this block's own cached probe already said a compiled block is slower."""
    from aamperf.phases.compile import auto_compile

    model, cfg, _ = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compile", SMALL, block_answer(compile_s=30.0, compiled_s=1.18))
    other_block = {"block": (8, 32, 64, 2, 4), "dtype": torch.float32}  # another model's, compiled quicker
    inject(probe, "compile", other_block, block_answer(compile_s=5.0))

    def no_step(i: int) -> None:
        raise AssertionError("an eager step was timed although the cached probe decides")

    record = auto_compile(model, cfg, no_step, 2, 10**6, probe, "c")
    assert record["auto"]["chose"] == "disabled" and "ran 1.18x its eager time" in record["reason"]
    assert probe.cached("eager_step", {"context": "c"}) is None


@pytest.mark.slow  # 14 s (a real compile) on a 2-core AMX Xeon: the default suite stays near 10 min
def test_compile_auto_trial_times_both_and_caches_its_figures(tmp_path):
    """A real trial: eager and compiled steps timed here, the decision follows the figures."""
    from aamperf.phases.compile import auto_compile, pays

    model, cfg, step = tiny_step()
    probe = Probe(CPU, tmp_path / "probe.json")
    inject(probe, "compile", SMALL, block_answer(compile_s=0.0))  # always try
    record = auto_compile(model, cfg, step, 2, 100, probe, "c")
    torch._dynamo.reset()
    auto = record["auto"]
    assert auto["eager_step_s"] > 0 and auto["compiled_step_s"] > 0 and auto["graphs"] >= 1
    compiled = auto["compiled_step_s"] < auto["eager_step_s"]
    assert auto["chose"] == ("default" if compiled else "disabled")
    assert (model._compiled_call_impl is not None) == compiled
    if auto["source"] == "measured":  # a quiet trial is kept: the next run decides without one
        assert pays(probe.cached("compile_trial", {"context": "c"}), 100)[0] == pays(auto, 100)[0]


# ---- dataloader=auto: batch-making time against a step's, then the two pipelines timed ---------------

LOADER_ASKED = {
    "num_workers": "auto",
    "pin_memory": True,
    "persistent_workers": True,
    "prefetch_factor": 4,
    "non_blocking": True,
}


def loader_trial(in_process: list[float], worker: list[float], start_s: float = 0.05) -> dict:
    """`time_pipelines`' figures: seconds per step in each round."""
    import statistics

    return {
        "in_process_step_s": statistics.median(in_process),
        "worker_step_s": statistics.median(worker),
        "worker_start_s": start_s,
        "rounds": {"in_process": in_process, "worker": worker},
        "steps_per_round": 20,
    }


@pytest.mark.parametrize(
    ("batch_s", "trial", "steps", "workers", "said"),
    [
        (0.002, None, 1000, 0, "2.0% of a 100 ms step here (< 5%)"),  # no worker can save 5%
        (0.02, None, 10, 0, "could save at most 0.2 s over 10 steps, no more than timing one"),
        (0.02, loader_trial([0.12, 0.12, 0.12], [0.10, 0.10, 0.11]), 1000, 1, "0.83x"),
        # a batch crossing a process boundary, and a worker beside the step's threads, cost more
        (0.02, loader_trial([0.12, 0.12, 0.12], [0.25, 0.24, 0.26]), 1000, 0, "not 3% quicker in every"),
        (0.02, loader_trial([0.12, 0.12, 0.12], [0.10, 0.13, 0.10]), 1000, 0, "not 3% quicker in every"),
        (0.02, loader_trial([0.12] * 3, [0.10] * 3, start_s=5.0), 100, 0, "not over its 5.00 s start"),
    ],
)
def test_dataloader_auto_keeps_a_worker_only_where_timing_both_pipelines_says_it_pays(
    batch_s, trial, steps, workers, said
):
    from omegaconf import OmegaConf

    from aamperf.phases.dataloader import decide_workers, resolve_dataloader

    requested = OmegaConf.create(LOADER_ASKED)
    resolved, pending = resolve_dataloader(requested, CPU)
    assert resolved.num_workers == 0 and resolved.prefetch_factor is None  # in-process until measured
    loader, record = decide_workers(resolved, requested, batch_s, 0.1, trial=trial, steps=steps)
    auto = record["auto"]
    assert auto["chose"] == workers and said in auto["reason"], auto["reason"]
    assert f"making a batch takes {batch_s * 1e3:.1f} ms" in auto["reason"]
    assert auto.get("trial") == trial  # the figures beside the decision
    if workers:
        assert (loader.num_workers, loader.prefetch_factor, loader.pin_memory) == (1, 4, False)
    else:
        assert loader is None and record["status"] == "skipped"


def test_a_trial_is_asked_for_only_where_a_worker_could_save_more_than_it_costs():
    from aamperf.phases.dataloader import TRIAL_STEPS, trial_cost_s, trial_steps

    assert trial_steps(0.002, 0.1, 10_000, 4) is None  # 2% of a step: no worker can pay
    assert trial_steps(0.02, 0.1, 10, 4) is None  # 0.2 s to save at most, seconds to time
    assert trial_steps(0.0005, 0.001, 10_000, 4) == TRIAL_STEPS[1]  # tiny steps: the most per round
    assert trial_steps(0.5, 1.0, 10_000, 4) == TRIAL_STEPS[0]  # long ones: the fewest
    assert trial_cost_s(0.5, 1.0, 4) == pytest.approx(3 * (2 * TRIAL_STEPS[0] + 4) * 1.5)


def test_time_pipelines_alternates_rounds_and_leaves_out_what_a_worker_made_ahead():
    """Streams that say which pipeline made each batch: rounds alternate, every worker round begins with
    its lead-in untimed, and a pipeline whose batches take longer is timed longer."""
    import time as clock

    from aamperf.phases.dataloader import TRIAL_ROUNDS, time_pipelines

    taken = []

    def make_stream(workers: int):
        def batches():
            while True:
                clock.sleep(0.004 if workers == 0 else 0.0)  # in-process batches take 4 ms to make
                yield {"workers": workers}

        return batches()

    figures = time_pipelines(make_stream, lambda batch: taken.append(batch["workers"]), 5, lead_in=2)
    round_steps = [0] * 5 + [1] * (2 + 5)
    assert taken == [0, 1] + round_steps * TRIAL_ROUNDS  # first batches, then alternating rounds
    assert figures["steps_per_round"] == 5 and len(figures["rounds"]["worker"]) == TRIAL_ROUNDS
    assert figures["in_process_step_s"] >= 0.004 > figures["worker_step_s"]


def test_dataloader_auto_times_no_step_where_its_flops_at_the_peak_settle_it():
    from omegaconf import OmegaConf

    from aamperf.phases.dataloader import MIN_BATCH_SHARE, decide_workers, step_floor_s

    # 1 TFLOP at 100 GFLOP/s: no step is faster than 10 s; 1 ms of batch-making is 0.01% of it
    floor = step_floor_s(1e12, 1e11, 0.001)
    assert floor == pytest.approx(10.0)
    loader, record = decide_workers(OmegaConf.create({"num_workers": 0}), None, 0.001, floor, floor=True)
    assert (
        loader is None
        and record["auto"]["step_floor_s"] == floor
        and "at least 10000 ms" in record["auto"]["reason"]
    )
    # where the floor leaves room for the share to reach MIN_BATCH_SHARE (a peak measured low), or there is
    # no peak: a step is timed
    assert step_floor_s(1e12, 1e11, 10.0 * MIN_BATCH_SHARE / 4) is None
    assert step_floor_s(1e12, None, 0.001) is None


def test_the_loaders_timed_step_is_kept_for_the_next_run_of_the_same_configuration(make_cfg, tmp_path):
    """dataloader=auto where no FLOP floor settles it (a given peak of 1e18 FLOP/s floors the step near
    zero) times one step of the phased model; a later run of the same model, phases and data reads that
    figure, where a run of another batch size times its own."""
    from aamperf.run import train

    cache = tmp_path / "probe.json"
    given = ("dataloader=auto", "precision=fp32", "attention=math", "metrics.peak_flops=1e18")
    run = (*given, "trainer.max_steps=2", f"probe.cache={cache}")
    first = train(make_cfg(*run), tmp_path / "first")["phases"]["dataloader"]["auto"]
    if first["step_source"] == "measured_under_load":  # other processes used the cores: nothing kept
        assert "(timed under load: not kept)" in first["reason"] and "|loader_step|" not in (
            cache.read_text() if cache.exists() else ""
        ), first
        pytest.skip("other processes were busy while the step was timed: a quiet timing is needed to be kept")
    assert first["step_source"] == "measured" and first["step_s"] > 0, first
    assert any("|loader_step|" in key for key in json.loads(cache.read_text())), "a quiet timing is kept"
    again = train(make_cfg(*run, "seed=1"), tmp_path / "again")["phases"]["dataloader"]["auto"]
    assert again["step_source"] == "cache" and again["step_s"] == first["step_s"], again
    assert "(timed by an earlier run)" in again["reason"]
    other = train(make_cfg(*run, "trainer.batch_size=2"), tmp_path / "other")["phases"]["dataloader"]["auto"]
    assert other["step_source"] in ("measured", "measured_under_load"), other  # timed, not read


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_run_times_both_pipelines_on_its_own_batches_and_trains_as_it_would_have(make_cfg, tmp_path):
    """A model whose step is a few milliseconds (batch-making a large share of it): dataloader=auto times
    a real worker against in-process batches, decides as `worker_pays` says, and the run trains as with
    dataloader=simple (the trial's loaders are its own, its dropout draws forked); the next run reads
    the cached figures."""
    from aamperf.phases.dataloader import worker_pays
    from aamperf.run import train

    plugin = ["~model", "+model._target_=plugin_model.MeanPoolModel", "+model.dim=8", "+model.dropout=0.1"]
    plugin += ["data.max_asvs=16", "~loss", "+loss._target_=plugin_model.pair_loss", "+loss._partial_=true"]
    steps = ["trainer.max_steps=800", "trainer.val_every=800", f"probe.cache={tmp_path / 'probe.json'}"]
    auto = train(make_cfg(*plugin, *steps, "dataloader=auto"), tmp_path / "auto")
    record = auto["phases"]["dataloader"]["auto"]
    trial = record["trial"]
    assert trial["source"] == "measured" and trial["in_process_step_s"] > 0 and trial["worker_step_s"] > 0
    assert record["chose"] == int(worker_pays(trial, 800)[0]), record["reason"]
    simple = train(make_cfg(*plugin, *steps, "dataloader=simple"), tmp_path / "simple")
    assert auto["train_loss"] == simple["train_loss"] and auto["val_loss"] == simple["val_loss"]
    again = train(make_cfg(*plugin, *steps, "dataloader=auto"), tmp_path / "again")
    assert again["phases"]["dataloader"]["auto"]["trial"]["source"] == "cache"


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_run_with_every_auto_records_each_decision_beside_its_phase(make_cfg, tmp_path):
    """attention and the loader measured here; compile decided from the probe's block (injected:
    compiling for real takes a minute on 2 cores); precision=auto has its own test above."""
    from aamperf.probe import compile_block
    from aamperf.run import train

    cache = tmp_path / "probe.json"
    overrides = ("precision=fp32", "attention=auto", "compile=auto", "dataloader=auto")
    overrides += (f"probe.cache={cache}",)
    cfg = make_cfg(*overrides)
    question = {
        "block": compile_block(cfg.model, cfg.trainer.batch_size, cfg.data.max_asvs),
        "dtype": torch.float32,
    }
    inject(Probe(CPU, cache), "compile", question, block_answer(compile_s=1e6))
    summary = train(cfg, tmp_path / "run")
    phases = summary["phases"]
    for group in ("attention", "compile", "dataloader"):
        assert phases[group]["auto"]["reason"], group
    assert (phases["attention"]["status"] == "applied") == (phases["attention"]["auto"]["chose"] == "sdpa")
    assert phases["compile"]["auto"]["chose"] == "disabled" and summary["recompiles"] == 0
    workers = phases["dataloader"]["auto"]["chose"]
    assert phases["dataloader"]["auto"]["step_s"] > 0 and (phases["dataloader"]["status"] == "applied") == (
        workers == 1
    )
    # the step compile=auto timed (a compiled block gains 2x: worth a look) is the one the loader reads
    assert phases["dataloader"]["auto"]["step_s"] == phases["compile"]["auto"]["eager_step_s"]
    # the time spent deciding is the run's, in auto_s (compile=auto's included: it kept no compile)
    assert (
        summary["auto_s"] + 1e-3 >= phases["compile"]["decide_s"] >= phases["compile"]["auto"]["trial_s"] > 0
    )
    # the same device and cache: every answer kept is read, none measured again. An attention answer
    # measured while other processes shared the cores is not kept (CI's shared machine), so it is
    # measured again.
    first = phases["attention"]["auto"]["source"]
    again = train(make_cfg(*overrides), tmp_path / "again")
    assert first in ("measured", "measured_under_load")
    if first == "measured":
        assert again["phases"]["attention"]["auto"]["source"] == "cache"
        assert again["auto_s"] < summary["auto_s"] / 2
    else:
        assert again["phases"]["attention"]["auto"]["source"] in ("measured", "measured_under_load")


def test_the_time_compile_auto_spends_deciding_is_the_runs_auto_s(make_cfg, tmp_path):
    """compile=auto alone (its probe injected): what it spent timing the eager step is auto_s, and no
    compile time, since it kept none."""
    from aamperf.probe import compile_block
    from aamperf.run import train

    cache = tmp_path / "probe.json"
    cfg = make_cfg(
        "precision=fp32", "attention=math", "compile=auto", "dataloader=simple", f"probe.cache={cache}"
    )
    question = {
        "block": compile_block(cfg.model, cfg.trainer.batch_size, cfg.data.max_asvs),
        "dtype": torch.float32,
    }
    inject(Probe(CPU, cache), "compile", question, block_answer(compile_s=1e6))
    summary = train(cfg, tmp_path / "run")
    compile_record = summary["phases"]["compile"]
    assert compile_record["status"] == "skipped" and "compile_time_s" not in compile_record
    # auto_s is rounded to milliseconds
    assert summary["auto_s"] + 1e-3 >= compile_record["decide_s"] >= compile_record["auto"]["trial_s"] > 0.1


def test_precision_auto_keeps_the_low_dtype_where_fp32s_trial_step_runs_out_of_memory():
    """A batch chosen for 2-byte activations may not fit in fp32's (aam_base on an H200: the probes peaked
    at 11.45 GiB, fp16 training at 7.1): the trial keeps the low dtype and says why; a low dtype that
    does not fit either fails the run, as its first step would. The OOM is raised by the step: no GPU."""
    from aamperf.phases.precision import confirm_precision, step_times

    cfg = OmegaConf.create({"dtype": "auto", "matmul_precision": "high"})
    cpu = torch.device("cpu")

    def step(autocast, scaler, i: int) -> None:  # fp32's step (no autocast) does not fit
        with autocast():
            if not torch.is_autocast_enabled("cpu"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            torch.ones(64, 64) @ torch.ones(64, 64)

    figures = step_times(step, cfg, cpu, ["bf16", "fp32"], batches=2)
    assert figures["step_s"]["fp32"] is None and figures["step_s"]["bf16"] > 0
    decision = {"chose": "bf16", "reason": "bf16 matmul 1.5x fp32 at the model's shapes here (>= 1.15): bf16"}
    assert confirm_precision(decision, figures) is False and decision["chose"] == "bf16"
    assert decision["reason"].endswith(
        "; a training step in fp32 ran out of the device's memory at this batch, one under bf16 autocast"
        " did not: bf16"
    )

    def never_fits(autocast, scaler, i: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    with pytest.raises(torch.OutOfMemoryError):  # the run's own dtype does not fit
        step_times(never_fits, cfg, cpu, ["bf16", "fp32"], batches=2)


def test_a_trial_step_that_runs_out_of_memory_in_backward_leaves_no_gradients_behind():
    from aamperf.job import warmup_step

    class OutOfMemoryInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise torch.OutOfMemoryError("CUDA out of memory")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    def loss_fn(model, batch, step):  # the second layer's gradients land before the failing op's backward
        return model[1](OutOfMemoryInBackward.apply(model[0](batch["x"]))).sum(), {}

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(torch.OutOfMemoryError):
        warmup_step(loss_fn, [{"x": torch.ones(2, 4)}])(model, nullcontext, scaler)
    assert all(p.grad is None for p in model.parameters())
