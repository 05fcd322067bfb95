"""memory=budget: torch.compile's activation memory budget keeps fewer bytes for backward, with the
gradients of no checkpointing, dropout on (its masks' seeds saved: aamperf/phases/recompute.py)."""

import copy
import logging

import pytest
import torch
import torch._functorch.config as functorch_config
from conftest import read_summary
from hydra.utils import instantiate

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.model.layers import Transformer
from aamperf.phases.compile import apply_compile
from aamperf.phases.memory import UNBUDGETED, apply_checkpointing, budget_unused, set_compiled_recompute
from aamperf.phases.recompute import RANDOMNESS_KEPT
from aamperf.phases.record import applied, skipped
from aamperf.run import train


@pytest.fixture
def tiny(make_cfg):
    """aam_tiny with its dropout on (the seed before each pass draws the same masks), one real batch."""
    cfg = make_cfg()
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    return model, instantiate(cfg.loss), to_device(next(iter(data.train_loader)), torch.device("cpu"))


def step(model, loss_fn, batch):
    """Loss, gradients and the bytes forward saved for backward (autograd's saved-tensor hooks see the
    compiled graphs' saved activations as well as eager's)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every model
    saved = {}

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = loss_fn(model, batch, 1)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())


def compiled(model, loss_fn, batch, make_cfg, *memory):
    """Compiled whole (compile.per_block=false, as CUDA graphs compile it): a block's own graph kept its
    masks' seeds in forward even at budget 0.01 on torch 2.13, the whole stack's did not."""
    other = copy.deepcopy(model)
    apply_checkpointing(other, make_cfg(*memory).memory)
    options = make_cfg("compile=default", "compile.per_block=false").compile
    record = apply_compile(other, options, lambda: step(other, loss_fn, batch))
    assert record["status"] == "applied", record
    return step(other, loss_fn, batch)


def assert_same_gradients(a, b):
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
    for name in a[1]:
        torch.testing.assert_close(b[1][name], a[1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(autouse=True)
def unbudgeted():
    yield
    set_compiled_recompute(False, UNBUDGETED)  # a failed test leaves no budget behind


# 27 s (three compiles) on a 2-core AMX Xeon: `pytest -m slow`, which CI runs too (the default suite: ~10 min)
@pytest.mark.slow
def test_a_smaller_budget_keeps_fewer_bytes_with_the_gradients_of_no_checkpointing(make_cfg):
    """One transformer stack (a block of AAM's, dropout on), compiled as the phases compile it. Against the
    compiled stack without a budget: a compiled graph draws its dropout masks its own way (the same in
    each compiled model, not eager's). Without the randomness kept (aamperf/phases/recompute.py) the
    budgets' gradients differ (torch 2.13): backward draws new masks."""
    torch.manual_seed(0)
    stack, x = Transformer(dim=32, num_heads=2, num_layers=1, ffn_mult=4, dropout=0.1), torch.randn(8, 40, 32)
    assert_budgets_keep_less_and_the_gradients(stack, stack_loss, x, make_cfg)


def stack_loss(stack, x, _):
    return stack(x, None).square().mean(), None


def assert_budgets_keep_less_and_the_gradients(model, loss_fn, batch, make_cfg):
    whole = compiled(model, loss_fn, batch, make_cfg, "memory=none")
    half = compiled(model, loss_fn, batch, make_cfg, "memory=budget")  # 0.5, the option's
    least = compiled(model, loss_fn, batch, make_cfg, "memory=budget", "memory.activation_budget=0.01")
    for run in (half, least):
        assert_same_gradients(whole, run)
    assert least[2] < half[2] < whole[2], (least[2], half[2], whole[2])


@pytest.mark.slow  # inductor's code for AAM's 3 stacks, three times: a minute on 2 cores
def test_the_whole_model_within_a_budget_keeps_the_gradients(tiny, make_cfg):
    assert_budgets_keep_less_and_the_gradients(*tiny, make_cfg)


@pytest.mark.slow  # 26 s of cold inductor compiles (a fresh clone); the budget's parts stay in the fast suite
def test_a_run_records_its_budget_and_the_next_job_runs_without_it(make_cfg, tmp_path):
    summary = train(make_cfg("memory=budget", "compile=default"), tmp_path / "budget")
    assert summary["status"] == "completed"
    # the compile phase's warm-up and the warm-up steps' excess (lazy compiles): both are compiling
    assert (
        summary["compile_time_s"]
        == summary["phases"]["compile"]["compile_time_s"] + summary["warmup_excess_s"]
    )
    phase = summary["phases"]["checkpointing"]
    assert phase["status"] == "applied" and phase["mode"] == "budget" and phase["activation_budget"] == 0.5
    assert functorch_config.activation_memory_budget == 0.5  # the compiled graphs' budget
    assert torch._inductor.config.joint_custom_post_pass is RANDOMNESS_KEPT
    train(make_cfg("memory=none"), tmp_path / "none")  # the next job of an in-process sweep
    assert functorch_config.activation_memory_budget == UNBUDGETED
    assert torch._inductor.config.joint_custom_post_pass is None


def test_a_budget_whose_compile_phase_compiled_nothing_is_skipped_with_why(caplog):
    """What a run's record and log say of memory=budget where compile=auto declined (the run below)."""
    budget = {"mode": "budget", "activation_budget": 0.5}
    assert budget_unused(applied(**budget), applied()) == applied(**budget)  # compiled: the budget acts
    declined = skipped("compile=auto: 3 steps, too few to pay for a compile")
    with caplog.at_level(logging.WARNING, logger="aamperf.phases.memory"):
        record = budget_unused(applied(**budget), declined)
    why = "memory=budget acts in torch.compile's graphs, and the model runs eager (compile=auto: 3 steps"
    assert record["status"] == "skipped" and record["reason"].startswith(why)
    assert {k: record[k] for k in budget} == budget  # its settings kept in the record
    assert "every activation kept (memory=full or ops recompute in eager)" in caplog.text


# ~6 s: a process of its own; budget_unused's record and warning in the default suite (the test above)
@pytest.mark.slow
def test_a_budget_with_nothing_compiled_says_so(launch):
    # in a process of its own, as a user's first run: in the suite's, an earlier test has imported the
    # compiler, and compile=auto would compile a block to decline (11 s) where a new process declines at
    # the compiler's import (3 steps: too few to pay for any compile)
    proc, run_dir = launch("memory=budget", "compile=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every activation kept (memory=full or ops recompute in eager)" in proc.stdout + proc.stderr
    summary = read_summary(run_dir)
    phases = summary["phases"]
    assert phases["compile"]["status"] == "skipped"
    assert summary["compile_time_s"] == 0.0 and summary["warmup_excess_s"] >= 0  # nothing compiled
    assert phases["checkpointing"]["status"] == "skipped"
    reason = phases["checkpointing"]["reason"]
    assert reason.startswith(
        "memory=budget acts in torch.compile's graphs, and the model runs eager (compile=auto"
    )
