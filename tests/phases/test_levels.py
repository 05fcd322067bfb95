"""The four levels compose, explicit choices win, bad combinations fail before the run."""

import pytest
import torch
from conftest import read_summary

from aamperf.errors import UserError
from aamperf.phases import check_phases
from aamperf.run import train

LEVELS = {  # the device-dependent choices are measured where the run is (auto)
    "baseline": ("fp32", "disabled", "math", "plain", "simple", "for_loop", "standard"),
    "basic": ("auto", "disabled", "auto", "plain", "auto", "foreach", "standard"),
    "advanced": ("auto", "disabled", "auto", "fast", "auto", "fused", "fast"),
    "ultra": ("auto", "auto", "auto", "fast", "auto", "fused", "fast"),
}


def choices(cfg):
    ops = (cfg.aam_ops.dedup, cfg.aam_ops.skip_padding, cfg.aam_ops.bucket)
    aam = {(False, False, False): "plain", (True, True, True): "fast"}.get(ops)
    workers = cfg.dataloader.num_workers
    loader = "auto" if workers == "auto" else ("tuned" if workers else "simple")
    return (
        cfg.precision.dtype,
        cfg.compile.mode,
        cfg.attention.impl,
        aam,
        loader,
        cfg.optimizer.impl,
        cfg.dropout.impl,
    )


@pytest.mark.parametrize("level", LEVELS)
def test_level_picks_its_options(make_cfg, level):
    cfg = make_cfg(f"optim={level}")
    assert cfg.optim == level and choices(cfg) == LEVELS[level]


def test_command_line_choice_wins_over_the_level(make_cfg):
    cfg = make_cfg("optim=ultra", "precision=fp32", "compile=disabled", "attention=sdpa")
    assert (cfg.precision.dtype, cfg.compile.mode, cfg.attention.impl) == ("fp32", "disabled", "sdpa")
    assert cfg.dataloader.num_workers == "auto"  # the level's, where the command line said nothing


def test_fp16_on_cpu_is_refused_with_the_fix(make_cfg):
    with pytest.raises(UserError, match="precision=fp16 needs a CUDA GPU.*use precision=bf16"):
        check_phases(make_cfg("precision=fp16"), torch.device("cpu"))


def test_all_phase_problems_are_reported_at_once(make_cfg):
    cfg = make_cfg(
        "precision=fp16", "memory.recompute_every=0", "distributed=ddp", "distributed.comm_hook=bf16"
    )
    with pytest.raises(UserError) as err:
        check_phases(cfg, torch.device("cpu"))
    problems = ("precision=fp16", "memory.recompute_every=0", "distributed.comm_hook=bf16 needs CUDA")
    assert all(s in str(err.value) for s in problems)


def test_every_phase_is_recorded_in_the_run(make_cfg, tmp_path):
    train(make_cfg("optim=advanced"), tmp_path)
    phases = read_summary(tmp_path)["phases"]
    expected = {
        "threads",
        "cpu_affinity",
        "cudnn_benchmark",
        "malloc",
        "deterministic",
        "cuda_memory",
        "dataloader",
        "precision",
        "attention",
        "aam_ops",
        "channels_last",
        "checkpointing",
        "compile",
        "optimizer",
    }
    assert expected <= phases.keys()
    assert all(r["status"] in ("applied", "skipped", "fallback") for r in phases.values())
    chosen = phases["precision"]["auto"]["chose"]  # measured here: bf16 where its matmuls pay
    assert phases["precision"]["status"] == ("applied" if chosen == "bf16" else "skipped")
    assert phases["aam_ops"]["status"] == "applied" and phases["optimizer"]["impl"] == "fused"
    assert (
        phases["channels_last"]["status"] == "skipped"
        and "no 4-D activations" in phases["channels_last"]["reason"]
    )
    assert phases["cudnn_benchmark"]["status"] == "skipped"  # CPU
    assert (
        phases["dataloader"]["pin_memory"] is False
        and "no host-to-GPU copy" in phases["dataloader"]["notes"][0]
    )


def test_a_kernel_the_device_lacks_is_refused_before_the_run(make_cfg):
    if torch.cuda.is_available():
        pytest.skip("the memory-efficient SDPA kernel exists on CUDA")
    with pytest.raises(
        UserError, match=r"attention.backends=\['efficient'\] cannot run on cpu.*use attention=sdpa"
    ):
        check_phases(make_cfg("attention=sdpa_efficient"), torch.device("cpu"))
