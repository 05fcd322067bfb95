"""The phases that change settings rather than numbers: optimizer, system, loader, memory guard."""

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from aamperf.phases.dataloader import resolve_dataloader
from aamperf.phases.memory import apply_cuda_memory
from aamperf.phases.optimizer import build_optimizer
from aamperf.phases.system import apply_channels_last, apply_system, glibc_version

CPU = torch.device("cpu")


def test_optimizer_implementations(make_cfg):
    params = [torch.nn.Parameter(torch.randn(3))]
    for option, foreach, fused in (
        ("adamw_for_loop", False, None),
        ("adamw_foreach", True, None),
        ("adamw_fused", False, True),
    ):
        cfg = make_cfg(f"optimizer={option}")
        optimizer, record = build_optimizer([("w", params[0])], cfg.trainer, cfg.optimizer)
        group = optimizer.param_groups[0]
        assert (group["foreach"], group["fused"]) == (foreach, fused)
        assert group["lr"] == cfg.trainer.lr and group["weight_decay"] == cfg.trainer.weight_decay
        assert record["status"] == ("skipped" if option == "adamw_for_loop" else "applied")


def test_fused_and_plain_adamw_take_the_same_step(make_cfg):
    results = []
    for option in ("adamw_for_loop", "adamw_fused"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64))
        cfg = make_cfg(f"optimizer={option}")
        optimizer, _ = build_optimizer([("w", p)], cfg.trainer, cfg.optimizer)
        for _ in range(3):
            p.grad = torch.sin(p.detach())
            optimizer.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize("option", ["adamw_for_loop", "adamw_fused"])
def test_the_original_s_adam_and_sgd_take_torch_s_steps(make_cfg, option):
    """optimizer.algorithm=adam | sgd (the original AAM's --optimizer): torch's Adam (weight decay an L2
    penalty on the gradient) and SGD with momentum 0.9, at trainer.lr and trainer.weight_decay, in the
    group's implementation; AdamW's decoupled decay gives another step."""
    start = torch.randn(64, generator=torch.Generator().manual_seed(0))
    steps = {}
    for algorithm, reference in (
        ("adam", lambda p, t: torch.optim.Adam([p], lr=t.lr, weight_decay=t.weight_decay)),
        ("sgd", lambda p, t: torch.optim.SGD([p], lr=t.lr, weight_decay=t.weight_decay, momentum=0.9)),
        ("adamw", lambda p, t: torch.optim.AdamW([p], lr=t.lr, weight_decay=t.weight_decay)),
    ):
        cfg = make_cfg(f"optimizer={option}", f"optimizer.algorithm={algorithm}", "trainer.weight_decay=0.1")
        ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        optimizer, record = build_optimizer([("w", ours)], cfg.trainer, cfg.optimizer)
        torch_own = reference(theirs, cfg.trainer)
        for _ in range(3):
            for p, opt in ((ours, optimizer), (theirs, torch_own)):
                p.grad = torch.sin(p.detach())
                opt.step()
        torch.testing.assert_close(ours.detach(), theirs.detach())
        steps[algorithm] = ours.detach()
        assert type(optimizer).__name__ == {"adam": "Adam", "sgd": "SGD", "adamw": "AdamW"}[algorithm]
        if record["status"] == "applied":
            assert record["algorithm"] == algorithm
        else:  # the for_loop implementation is no phase: its reason names the update
            assert record["reason"] == f"optimizer.impl=for_loop ({algorithm} one parameter at a time)"
    assert not torch.allclose(steps["adam"], steps["adamw"])  # weight decay: an L2 penalty or decoupled


def test_tuned_system_sets_threads_and_records_cpu_only_skips(make_cfg):
    before = torch.get_num_threads()
    try:
        records = apply_system(make_cfg("system=tuned", "system.num_threads=1").system, CPU)
        assert torch.get_num_threads() == 1 and records["threads"]["intra_op"] == 1
        assert records["cudnn_benchmark"]["status"] == "skipped"
        assert records["cpu_affinity"]["status"] == "skipped"
    finally:
        torch.set_num_threads(before)


# Run in a process of its own: one that trained with reuse earlier in this pytest may keep a freed hole
# of >= 64 MiB in its heap, which malloc hands out again (pages faulted in) whatever its thresholds say
# (a page-fault count of 0 with glibc's thresholds, seen in a whole-suite run).
MALLOC_CHILD = """
import json, resource, sys
import torch
from omegaconf import OmegaConf
from aamperf.phases.system import apply_system

def faults_of_a_second_block(nbytes=64 << 20):
    # a freed block twice the size: the second fits in it with memalign's slack (one of the same size
    # would not, and the heap would grow around it)
    torch.ones(nbytes // 2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(nbytes // 4)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default, tuned = (OmegaConf.create(text) for text in sys.argv[1:3])
cpu, out = torch.device("cpu"), {}
apply_system(default, cpu)
out["default"] = faults_of_a_second_block()
out["tuned_record"] = apply_system(tuned, cpu)["malloc"]
faults_of_a_second_block()  # the heap grows to hold it once
out["tuned"] = faults_of_a_second_block()
out["later_record"] = apply_system(default, cpu)["malloc"]  # an in-process sweep's next job, defaults
out["later"] = faults_of_a_second_block()
print(json.dumps(out))
"""


@pytest.mark.skipif(glibc_version() is None, reason="mallopt's thresholds are glibc's")
def test_tuned_system_reuses_freed_memory_and_a_later_default_job_gives_it_back(make_cfg):
    pages = (64 << 20) // resource.getpagesize()
    default, tuned = (OmegaConf.to_yaml(make_cfg(*o).system, resolve=True) for o in ((), ("system=tuned",)))
    child = subprocess.run(
        [sys.executable, "-c", MALLOC_CHILD, default, tuned], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    found = json.loads(child.stdout.splitlines()[-1])
    assert found["default"] > pages / 2, found  # glibc unmaps a freed 64 MiB block: faulted in again
    assert found["tuned_record"]["status"] == "applied", found
    assert found["tuned_record"]["libc"].startswith("glibc")
    assert found["tuned"] < pages / 20, found  # the freed block's pages, reused
    assert found["later_record"]["status"] == "skipped" and "set again" in found["later_record"]["reason"]
    assert found["later"] > pages / 2, found


def test_cpu_cores_pin_the_process_and_size_the_thread_pool(make_cfg):
    cores, before = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        records = apply_system(make_cfg("system=tuned", f"system.cpu_cores=[{cores[-1]}]").system, CPU)
        assert os.sched_getaffinity(0) == {cores[-1]}
        assert records["cpu_affinity"]["cores"] == [cores[-1]] and torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(before)


def test_a_later_job_that_asks_for_no_cores_or_threads_gets_the_process_ones_back(make_cfg):
    """An in-process sweep (Hydra's basic launcher): a job pinned to one core with one thread, then a
    job of system defaults, which must not train with the first job's settings."""
    cores, before = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cores) < 2 or before < 2:
        pytest.skip("needs 2 cores and 2 threads to tell a job's settings from the process's")
    try:
        apply_system(make_cfg().system, CPU)  # the process's first job: what it was given
        apply_system(make_cfg(f"system.cpu_cores=[{cores[-1]}]", "system.num_threads=1").system, CPU)
        records = apply_system(make_cfg().system, CPU)
        assert sorted(os.sched_getaffinity(0)) == cores and torch.get_num_threads() == before
        assert records["threads"]["intra_op"] == before
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(before)


def test_channels_last_applies_only_to_4d_models(make_cfg):
    cfg = make_cfg("system=tuned").system
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    assert apply_channels_last(conv, cfg)["status"] == "applied"
    assert conv[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert apply_channels_last(torch.nn.Linear(2, 2), cfg)["status"] == "skipped"


def test_tuned_loader_on_cpu_keeps_workers_and_drops_pinning(make_cfg):
    loader, record = resolve_dataloader(make_cfg("dataloader=tuned").dataloader, CPU)
    assert loader.num_workers >= 1 and loader.persistent_workers
    assert loader.pin_memory is False and loader.non_blocking is False
    simple, record = resolve_dataloader(make_cfg("dataloader=simple").dataloader, CPU)
    assert record["status"] == "skipped" and simple.prefetch_factor is None


def test_cuda_memory_settings_skip_on_cpu(make_cfg):
    assert apply_cuda_memory(make_cfg().memory, CPU)["status"] == "skipped"


@pytest.mark.parametrize("option", ["adamw_for_loop", "adamw_foreach"])
def test_categorical_lr_trains_the_conditioning_at_its_own_lr(make_cfg, option):
    """optimizer.categorical_lr (the original AAM's --categorical-lr): the categorical conditioning's
    parameters, by name under a wrapper's prefix, in a group of their own at it; the rest at trainer.lr. At
    trainer.lr=1e-12 a step moves the conditioning alone."""
    from hydra.utils import instantiate

    cfg = make_cfg(
        f"optimizer={option}", "optimizer.categorical_lr=0.01", "trainer.lr=1e-12", "trainer.weight_decay=0",
        "model.categorical_sizes=[3,2]", "model.categorical_output_scaling=true",
    )  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(instantiate(cfg.model))  # names under a prefix ("0."), as under a wrapper
    named = list(model.named_parameters())
    optimizer, record = build_optimizer(named, cfg.trainer, cfg.optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-12, 0.01]
    modules = ("categorical_embeddings", "categorical_projection", "output_scales", "output_biases")
    conditioning = {name for name, _ in named if name.split(".")[1] in modules}
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == {
        id(p) for n, p in named if n in conditioning
    }
    assert record["categorical_params"] == sum(p.numel() for n, p in named if n in conditioning) > 0
    before = {name: p.detach().clone() for name, p in named}
    for _, p in named:
        p.grad = torch.ones_like(p)
    optimizer.step()
    for name, p in named:
        moved = float((p.detach() - before[name]).abs().max())
        assert (moved > 1e-3) if name in conditioning else (moved < 1e-9), name
    plain, _ = build_optimizer(named, cfg.trainer, make_cfg(f"optimizer={option}").optimizer)
    assert len(plain.param_groups) == 1  # without it: one group, as before


def test_categorical_lr_without_conditioning_or_not_above_zero_is_refused(make_cfg):
    from aamperf.checks import check_config
    from aamperf.errors import UserError

    with pytest.raises(
        UserError, match=r"optimizer\.categorical_lr=0\.01 is the lr of the categorical conditioning"
    ):
        check_config(make_cfg("data.target=target", "optimizer.categorical_lr=0.01"))
    with pytest.raises(UserError, match=r"optimizer\.categorical_lr=0\.0 must be > 0, or null"):
        check_config(
            make_cfg("data.target=target", "data.categorical=[environment]", "optimizer.categorical_lr=0")
        )
