"""Bad input at the entry point: one `error:` line that names the fix, exit code 2, no traceback, and an
earlier run in the run directory left byte for byte as it was. Most cases call cli() in this process."""

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONF_DIR, TINY, invoke, read_metrics, read_summary, root_logger_kept
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from aamperf.data.tables import resolve_files
from aamperf.guards import memory_limit
from aamperf.phases.system import taskset_list
from aamperf.train import cli

# This machine's, as refusals name them: the cores this process may run on, the memory a rank can have.
CORES = taskset_list(list(os.sched_getaffinity(0)))
_LIMIT, _SET_BY = memory_limit()
MEMORY = f"{_LIMIT / 2**30:.2f} GiB: this " + (
    "machine's RAM" if _SET_BY == "machine" else "process's cgroup limit"
)

# Found before Hydra writes anything: the earlier run's directory is not touched at all.
CONFIG_CASES = {
    "unknown key": (["trainer.batchsize=8"], "did you mean trainer.batch_size?"),
    "wrong type": (["trainer.max_steps=ten"], "trainer.max_steps=ten: expected int"),
    "unknown group option": (["precision=fp8"], "choose one of auto, bf16, fp16, fp32 (conf/precision/)"),
    "unknown group": (["precisio=fp32"], "did you mean precision?"),
    "unknown option of an optional group": (["experiment=headlin"], "choose one of ablation"),
    "override syntax": (["trainer.lr=="], "cannot parse the override 'trainer.lr==' (extraneous input '='"),
    "a second = in a value": (["hydra.run.dir=out/a=b"], "'hydra.run.dir=out/a=b' (mismatched input '='"),
    "fp16 on CPU": (["precision=fp16"], "use precision=bf16"),
    "unknown target head": (
        ["model.target_head=mlp"],
        "model.target_head=mlp must be one of linear, transformer",
    ),
    "a probe cache that is a directory": (["probe.cache={inputs}"], "is a directory; give a file in it"),
    "ddp without torchrun": (["distributed=ddp"], "torchrun --nproc_per_node=2 -m aamperf.train"),
    "batch of one": (["trainer.batch_size=1"], "trainer.batch_size=1 must be >= 2"),
    "batch not divisible into micro-batches": (
        ["trainer.batch_size=5", "trainer.grad_accum_steps=2"],
        "trainer.batch_size=5 (the global batch) must divide evenly",
    ),
    "no steps": (["trainer.max_steps=0"], "trainer.max_steps=0 must be > 0"),
    "negative patience": (["trainer.patience=-1"], "trainer.patience=-1 must be >= 0 (0: never stop early)"),
    "a monitor that is no validation figure": (["trainer.monitor=loss"], "trainer.monitor=loss is not a"),
    "a plateau factor that reduces nothing": (
        ["trainer.lr_schedule=plateau", "trainer.plateau_factor=1"],
        "trainer.plateau_factor=1.0 must be between 0 and 1 (excluded)",
    ),
    "an unknown mask strategy": (
        ["loss.mask_strategy=block"],
        "loss.mask_strategy=block must be one of random, span",
    ),
    "a negative asymmetric weight": (
        ["loss.target_loss=asymmetric", "loss.under_weight=-1"],
        "loss.under_weight=-1 must be a number >= 0",
    ),
    "the original's name of a schedule": (
        ["trainer.lr_schedule=cosine"],
        "trainer.lr_schedule=cosine is the original AAM's name; here it is trainer.lr_schedule=warmup_cosine "
        "trainer.warmup_steps=0 trainer.min_lr_ratio=0",
    ),
    "the original's name of a transform": (
        ["data.target_transform=log-zscore"],
        "data.target_transform=log-zscore is the original AAM's name; here it is "
        "data.target_transform=log1p_zscore",
    ),
    "a weighted metric per batch": (
        ["data.unifrac_metric=weighted_normalized", "data.unifrac_mode=batch"],
        "data.unifrac_metric=weighted_normalized is computed up front: set data.unifrac_mode=precomputed",
    ),
    "the original's name of a metric": (
        ["data.unifrac_metric=weighted"],
        "data.unifrac_metric=weighted is the original AAM's name; here it is "
        "data.unifrac_metric=weighted_normalized",
    ),
    "a restart cycle of no steps": (
        ["trainer.lr_schedule=cosine_restarts", "trainer.restart_steps=0"],
        "trainer.restart_steps=0 must be >= 1 (the first cycle's steps), or null",
    ),
    "restart cycles that shrink": (
        ["trainer.lr_schedule=cosine_restarts", "trainer.restart_mult=0"],
        "trainer.restart_mult=0 must be an integer >= 1 (1: equal cycles)",
    ),
    "a target's figure without a target": (
        ["trainer.monitor=val_target_r2", "data.target=null"],
        "set data.target, or watch val_loss",
    ),
    "a renamed option": (["memory=checkpointing"], "memory=checkpointing is now memory=full"),
    "another renamed option": (["optimizer=adamw"], "optimizer=adamw is now optimizer=adamw_for_loop"),
    "a renamed key": (["memory.checkpoint_every=3"], "memory.checkpoint_every is now memory.recompute_every"),
    "negative seed": (["seed=-1"], "seed=-1 must be an integer from 0 to 4294967295"),
    "seed above 32 bits": (["data.seed=99999999999"], "data.seed=99999999999 must be an integer from 0"),
    "negative lr": (["trainer.lr=-0.001"], "trainer.lr=-0.001 must be > 0"),
    "no threads to draw the masks": (["dropout=fast", "dropout.threads=0"], "dropout.threads=0 must be >= 1"),
    "unknown device": (["device=tpu"], "device=tpu is not one of auto, cpu, cuda, cuda:N"),
    "unknown allocator": (["system.allocator=jemalloc"], "system.allocator=jemalloc is not one of tcmalloc"),
    "more ASVs than model positions": (["data.max_asvs=32"], "raise model.max_asvs"),
    "unknown resume mode": (["trainer.resume=maybe"], "trainer.resume=maybe is not one of disabled, auto"),
    "memory fraction above 1": (["memory.warn_fraction=1.5"], "memory.warn_fraction=1.5 must be in (0, 1]"),
    "activation budget above 1": (
        ["memory=budget", "compile=default", "memory.activation_budget=2"],
        "memory.activation_budget=2.0 must be in (0, 1]",
    ),
    "activation budget without compile": (["memory=budget"], "add compile=auto or compile=default"),
    "attention kernel missing on CPU": (["attention=sdpa_efficient"], "use attention=sdpa"),
    "unknown compile mode": (
        ["compile.mode=fastest"],
        "compile.mode=fastest is not one of disabled, default, reduce-overhead, max-autotune, auto; set "
        "compile.mode=<one of them>, or compile=<option> of conf/compile/",
    ),
    "a model without max_asvs": (
        ["~model", "+model._target_=collections.OrderedDict"],
        "data.max_asvs follows model.max_asvs, which model collections.OrderedDict has not",
    ),
    "a key nothing reads": (["+trainer.lr_decay=0.5"], "trainer.lr_decay is not a setting aamperf reads"),
    "no batch made ahead": (["dataloader=tuned", "dataloader.prefetch_factor=0"], "must be >= 1 (batches"),
    "a learning rate of inf": (["trainer.lr=inf"], "trainer.lr=inf must be a finite number"),
    "a nan": (["compare.quality_tolerance=nan"], "compare.quality_tolerance=nan must be a finite number"),
    "a value left out": (["trainer.lr=???"], "trainer.lr has no value (???); set trainer.lr=<value>"),
    "an environment variable not set": (
        ["trainer.lr=${{oc.env:AAMPERF_TEST_UNSET}}"],
        'trainer.lr: KeyError raised while resolving interpolation: "Environment variable '
        "'AAMPERF_TEST_UNSET' not found\"; set what it refers to, or give it: trainer.lr=<value>",
    ),
    "batch size neither a number nor auto": (["trainer.batch_size=big"], "must be an integer >= 2 or auto"),
    "no non-finite step allowed": (["trainer.max_nonfinite=0"], "trainer.max_nonfinite=0 must be >= 1"),
    "validation batches of one": (["trainer.val_batch_size=1"], "trainer.val_batch_size=1 must be >= 2"),
    "confidence of 95, not 0.95": (["compare.confidence=95"], "compare.confidence=95.0 must be between 0"),
    "memory stop at 0": (["memory.max_fraction=0"], "memory.max_fraction=0.0 must be in (0, 1]"),
    "batch-size budget of all memory": (
        ["trainer.batch_size=auto", "trainer.auto_batch.budget_fraction=1.5"],
        "trainer.auto_batch.budget_fraction=1.5 must be in (0, 1)",
    ),
    "a fixed batch-size budget of no memory": (
        ["trainer.batch_size=auto", "trainer.auto_batch.budget_gib=0"],
        "trainer.auto_batch.budget_gib=0.0 must be > 0",
    ),
    "loader workers neither a number nor auto": (
        ["dataloader.num_workers=some"],
        "must be an integer >= 0 or auto",
    ),
    "missing BIOM": (
        ["data=biom", "data.table={inputs}/nope.biom", "data.tree={inputs}/tips.nwk"],
        "data.table: no such file: {inputs}/nope.biom",
    ),
    "validation set too small": (["data.val_fraction=0.01"], "leaves 0 validation samples"),
    "run directory under a file": (["hydra.run.dir={inputs}/afile/run"], "choose another hydra.run.dir"),
    "run directory in /proc": (["hydra.run.dir=/proc/x"], "(/proc is not a writable directory)"),
    "run directory in /sys": (["hydra.run.dir=/sys/x"], "(/sys is not a writable directory)"),
    "cache directory under a file": (
        ["data.cache_dir={inputs}/afile/cache"],
        "data.cache_dir={inputs}/afile/cache: cannot write the cache there ({inputs}/afile is not a writable",
    ),
    "cache directory on a file system that refuses writes": (
        ["data.cache_dir=/sys/aamperf-cache"],
        "cannot write the cache there (/sys is not a writable directory); choose another data.cache_dir",
    ),
    # AAM's and AAMLoss's own arguments, checked before anything is built (a plug-in checks its own)
    "unknown model argument": (
        ["+model.x=1"],
        "model: AAM got an unexpected keyword argument 'x'; fix the model.* overrides or conf/model/",
    ),
    "width the heads do not divide": (
        ["model.embedding_dim=47"],
        "model.embedding_dim=47 is not divisible by model.num_heads=2",
    ),
    "no embedding": (["model.embedding_dim=0"], "model.embedding_dim=0 must be an integer >= 1"),
    "no FFN": (["model.ffn_mult=0"], "model.ffn_mult=0 must be an integer >= 1"),
    "fewer token ids than the data's": (
        ["model.vocab_size=3"],
        "model.vocab_size=3 is below the 7 token ids of aamperf's data (PAD, A, C, G, T, START, MASK); "
        "set model.vocab_size=7",
    ),
    "ASVs longer than the model's positions": (
        ["model.seq_len=50"],
        "model.seq_len=50 is shorter than an ASV's 151 tokens (START + 150 bp); set model.seq_len=151",
    ),
    "no base hidden": (["loss.mask_fraction=0"], "loss.mask_fraction=0 must be a number between 0 and 1"),
    "every base hidden": (["loss.mask_fraction=1.5"], "loss.mask_fraction=1.5 must be a number between 0"),
    "a negative loss weight": (["loss.unifrac_weight=-1"], "loss.unifrac_weight=-1 must be a number >= 0"),
    "a negative gradient clip": (
        ["trainer.grad_clip=-1"],
        "trainer.grad_clip=-1.0 must be >= 0 (0: no clipping)",
    ),
    "no FLOP batches": (["metrics.flop_batches=0"], "metrics.flop_batches=0 must be >= 1"),
    "a core this process may not run on": (
        ["system.cpu_cores=[99]"],
        f"system.cpu_cores=[99] holds a core this process may not run on; choose among cores {CORES}, or "
        "system.cpu_cores=null (the cores it was given)",
    ),
    "no core": (["system.cpu_cores=[]"], f"system.cpu_cores=[] names no core; choose among cores {CORES}"),
    "onecycle with no fall": (
        ["trainer.lr_schedule=onecycle", "trainer.warmup_steps=3"],
        "trainer.lr_schedule=onecycle cannot rise over trainer.warmup_steps=3 of trainer.max_steps=3 "
        "(OneCycleLR needs 2 or more steps up and 1 or more down); set trainer.warmup_steps=0 (torch's "
        "30%) or 2",
    ),
    "onecycle with a one-step rise": (
        ["trainer.lr_schedule=onecycle", "trainer.warmup_steps=1"],
        "trainer.lr_schedule=onecycle cannot rise over trainer.warmup_steps=1",
    ),
    "batch-size budget above this machine's memory": (
        ["trainer.batch_size=auto", "trainer.auto_batch.budget_gib=100000"],
        f"trainer.auto_batch.budget_gib=100000.0 is more than a rank can have here ({MEMORY}); lower it, or "
        "trainer.auto_batch.budget_gib=null for trainer.auto_batch.budget_fraction of that",
    ),
}
# Found while the run starts (data, model, checkpoint): the start is refused, its summary goes to
# summary.refused.json, and the earlier run's files stay as they were.
RUN_CASES = {
    "corrupt BIOM": (
        ["data=biom", "data.table={inputs}/bad.biom", "data.tree={inputs}/tips.nwk"],
        "data.table: cannot read {inputs}/bad.biom as a BIOM table",
    ),
    "tree without the table's ASVs": (
        ["data=biom", "data.table={table}", "data.tree={inputs}/tips.nwk"],
        "give a tree that covers every ASV of data.table",
    ),
    "UniFrac matrix of other samples": (
        ["data=biom", "data.table={table}", "data.unifrac={inputs}/dist.npy"],
        "give a matrix that covers every sample",
    ),
    "empty after rarefaction": (["data.rarefy_depth=1000000"], "lower data.rarefy_depth"),
    "missing metadata column": (["data.target=bmi"], "data.target: no column 'bmi'"),
    "a model that is not an nn.Module": (
        ["~model", "+model._target_=collections.OrderedDict", "data.max_asvs=16"],
        "returned a OrderedDict, not a torch.nn.Module; fix model._target_",
    ),
    "checkpoint of another model shape": (["model.embedding_dim=48"], "cannot resume from"),
}


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, cache_dir) -> dict[str, str]:
    """The user's files of the cases: a damaged table, a tree and a UniFrac matrix of other ids."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "bad.biom").write_text("not a BIOM table\n")
    (root / "tips.nwk").write_text("(a:1,b:1);\n")
    np.save(root / "dist.npy", np.zeros((2, 2)))
    (root / "dist.ids.txt").write_text("x\ny\n")
    (root / "afile").write_text("a file, not a directory\n")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*TINY, f"data.cache_dir={cache_dir}"])
    return {"inputs": str(root), "table": str(resolve_files(cfg.data)["table"])}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory, cache_dir) -> Path:
    """A completed 1-step run with a checkpoint: the directory a user re-runs in with a mistake."""
    run_dir = tmp_path_factory.mktemp("earlier") / "run"
    args = [*TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["aamperf.train", *args, "trainer.max_steps=1", "trainer.checkpoint_every=1"])
        with root_logger_kept():
            cli()
    assert read_summary(run_dir)["status"] == "completed"
    return run_dir


@pytest.fixture
def rerun(earlier_run, inputs, cache_dir, tmp_path, monkeypatch, capfd):
    """rerun(overrides, fix, damage=None): a copy of the earlier run, `damage(run_dir)`, then a re-run
    there with trainer.resume=auto and `overrides`. Checks exit code 2 and the one error line naming
    `fix`; returns the run directory's files before and after the re-run."""

    def run(overrides, fix, damage=None):
        run_dir = tmp_path / "run"
        shutil.copytree(earlier_run, run_dir)
        if damage:
            damage(run_dir)
        before = files_of(run_dir)
        args = [*TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}", "trainer.resume=auto"]
        code, _, err = invoke(monkeypatch, capfd, *args, *(o.format(**inputs) for o in overrides))
        lines = err.strip().splitlines()
        assert code == 2, err
        assert lines[-1].startswith("error: ") and fix.format(**inputs) in lines[-1], lines[-1]
        assert not any("error" in line.lower() for line in lines[:-1]) and "Traceback" not in err, err
        return before, files_of(run_dir)

    return run


@pytest.mark.parametrize(("overrides", "fix"), CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_config_mistake_exits_2_and_writes_nothing(overrides, fix, rerun):
    before, after = rerun(overrides, fix)
    assert after == before  # not a byte changed, not a file added (not even .hydra/)


def assert_refused_and_kept(before: dict[str, bytes], after: dict[str, bytes], fix: str) -> None:
    assert {name: after[name] for name in before} == before  # summary, metrics, checkpoints, .hydra, log
    assert set(after) - set(before) == {"summary.refused.json"}
    refused = json.loads(after["summary.refused.json"])
    assert refused["status"] == "failed" and fix in refused["error"]


@pytest.mark.parametrize(("overrides", "fix"), RUN_CASES.values(), ids=RUN_CASES.keys())
def test_refused_start_keeps_the_earlier_run(overrides, fix, rerun, inputs):
    assert_refused_and_kept(*rerun(overrides, fix), fix.format(**inputs))


def test_a_sweep_over_hydras_own_settings_names_the_fix(tmp_path, monkeypatch, capfd):
    code, _, err = invoke(monkeypatch, capfd, "-m", f"hydra.run.dir={tmp_path / 'a'},{tmp_path / 'b'}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "a multirun sweeps the job's settings, not Hydra's own (hydra.*)" in err
    assert not any(tmp_path.iterdir())


def test_every_data_problem_is_listed_in_one_line(cache_dir, tmp_path, monkeypatch, capfd):
    data = ["data=biom", "data.tree=x.nwk", "data.unifrac=y.npy", "data.target=age", "data.val_fraction=1.5"]
    args = [*TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={tmp_path / 'run'}", *data]
    code, _, err = invoke(monkeypatch, capfd, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    problems = [
        "data.val_fraction=1.5 must be between 0 and 1",
        "data.source=biom needs data.table=<file.biom>",
        "data=biom needs exactly one of data.tree=<tree.nwk> (UniFrac computed from it) or data.unifrac=",
        "data.target=age needs data.metadata=<samples.tsv>",
        "data.tree: no such file: x.nwk",
        "data.unifrac: no such file: y.npy",
    ]
    assert err.startswith("error: ") and all(problem in err for problem in problems), err
    assert not (tmp_path / "run").exists()  # found before Hydra writes anything


def test_corrupt_checkpoint_is_refused_and_the_run_kept(rerun):
    def truncate_newest_checkpoint(run_dir: Path) -> None:
        newest = max((run_dir / "checkpoints").iterdir())
        newest.write_bytes(newest.read_bytes()[:100])

    fix = "cannot resume from"
    assert_refused_and_kept(*rerun([], fix, damage=truncate_newest_checkpoint), fix)


def test_a_new_run_where_an_earlier_one_is_refused_and_writes_nothing(
    earlier_run, cache_dir, tmp_path, monkeypatch, capfd
):
    """Started again in a run's directory without trainer.resume=auto, a run wrote its rows after the
    earlier run's in metrics.jsonl (steps 1, 1) and replaced its summary and model."""
    run_dir = tmp_path / "run"
    shutil.copytree(earlier_run, run_dir)
    before = files_of(run_dir)
    code, _, err = invoke(
        monkeypatch, capfd, *TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}"
    )
    assert code == 2 and err.strip().splitlines() == [
        f"error: run directory {run_dir} holds an earlier run (completed at step 1) that this run would "
        f"write over; give this run its own hydra.run.dir, go on from its step 1 with trainer.resume=auto, "
        f"or remove {run_dir} to run there again"
    ]
    assert files_of(run_dir) == before  # not even .hydra/ or the log


def test_resume_auto_starts_over_a_run_that_kept_no_checkpoint_and_refuses_a_completed_one(
    earlier_run, cache_dir, tmp_path, monkeypatch, capfd
):
    """A run stopped before its first checkpoint goes on from the start: its rows are logged again, not
    after the old ones. A completed run without a checkpoint is not trained over."""
    run_dir = tmp_path / "run"
    shutil.copytree(earlier_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    args = [*TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={run_dir}", "trainer.resume=auto"]
    code, _, err = invoke(monkeypatch, capfd, *args, "trainer.max_steps=1")
    assert code == 2 and "(completed at step 1, no checkpoint to go on from)" in err, err
    summary = read_summary(run_dir)
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    code, _, err = invoke(monkeypatch, capfd, *args, "trainer.max_steps=1")
    assert code == 0, err
    assert [row["step"] for row in read_metrics(run_dir)] == [1]
    assert read_summary(run_dir)["status"] == "completed"


def test_a_sweep_where_an_earlier_one_is_refused_before_any_job_runs(
    earlier_run, tmp_path, monkeypatch, capfd
):
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(earlier_run, sweep_dir / "0")
    before = files_of(sweep_dir)
    code, out, err = invoke(monkeypatch, capfd, "-m", *TINY, f"hydra.sweep.dir={sweep_dir}", "seed=0,1")
    assert code == 2 and err.strip().splitlines() == [
        f"error: sweep directory {sweep_dir} holds the runs of an earlier sweep (1 run directory) that this "
        f"sweep would write over; give this sweep its own hydra.sweep.dir (or trainer.resume=auto to go on "
        f"from their checkpoints), or remove {sweep_dir} to sweep there again"
    ]
    assert files_of(sweep_dir) == before and "#0" not in out


def test_recorded_fallbacks_keep_the_run_going(inputs, cache_dir, tmp_path, monkeypatch, capfd):
    """Not a mistake to stop for: W&B with a key it refuses logs offline, a compile backend that is
    missing trains eagerly; exit 0 and summary.json says why (the units: tests/test_loggers.py,
    tests/phases/test_phase_correctness.py)."""
    monkeypatch.setenv("WANDB_API_KEY", "not-a-key")  # W&B refuses it at init, with no network call
    overrides = ["logger=wandb", "logger.mode=online", "compile=default", "compile.backend=no_such_backend"]
    with socket.create_server(("127.0.0.1", 0)) as server:  # a W&B server this machine reaches
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        code, out, err = invoke(
            monkeypatch, capfd, *TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={tmp_path}", *overrides
        )
    assert code == 0, err
    # said as it happens, not only in summary.json: the user asked for a compiled run
    assert "compile=default compile.backend=no_such_backend: torch.compile failed, running eager" in out
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed"
    assert summary["logger"][0]["mode"] == "offline" and "API key" in summary["logger"][0]["fallback"]
    assert summary["phases"]["compile"]["status"] == "fallback"
    assert "no_such_backend" in summary["phases"]["compile"]["reason"]


def test_a_job_failing_as_it_runs_is_recorded_and_the_sweep_goes_on(cache_dir, tmp_path, monkeypatch, capfd):
    """What only a run finds (here: its data, empty after rarefaction) fails that job alone."""
    sweep = [
        f"hydra.sweep.dir={tmp_path}",
        "trainer.max_steps=1",
        "data.rarefy_depth=1000000,500",
        "compare.baseline='data.rarefy_depth=500'",
    ]
    code, _, err = invoke(monkeypatch, capfd, "-m", *TINY, f"data.cache_dir={cache_dir}", *sweep)
    assert code == 1  # a job failed: the report lists it
    summaries = [read_summary(p.parent) for p in tmp_path.glob("*/summary.json")]
    by_depth = {s["config"]["data"]["rarefy_depth"]: s for s in summaries}
    assert by_depth[1000000]["status"] == "failed" and "lower data.rarefy_depth" in by_depth[1000000]["error"]
    assert by_depth[500]["status"] == "completed" and len(summaries) == 2
    assert "lower data.rarefy_depth" in err and "Traceback" not in err
    assert (tmp_path / "comparison.json").exists()


def test_a_config_mistake_in_any_job_refuses_the_sweep_before_the_first_runs(tmp_path, monkeypatch, capfd):
    """Every job is checked before any runs: the mistake of the last job is found in seconds, not after
    the others; each problem names its jobs, and nothing is written."""
    sweep = [f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.cache_dir={tmp_path / 'cache'}", "seed=0,1"]
    sweep.append("trainer.batch_size=4,1")
    code, out, err = invoke(monkeypatch, capfd, "-m", *TINY, *sweep)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: sweep job #2 (trainer.batch_size=1 seed=0), #3 (trainer.batch_size=1 seed=1): "
        "trainer.batch_size=1 must be >= 2 (UniFrac compares pairs of samples); compare.baseline="
        "'optim=baseline' matches 2 configurations of this sweep ('trainer.batch_size=4', "
        "'trainer.batch_size=1'), and its report compares every other with one; name it: "
        "'compare.baseline=\"trainer.batch_size=4\"' (the default), or another of them"
    ]
    assert not (tmp_path / "sweep").exists() and "#0" not in out  # refused before Hydra made the sweep
    code, _, err = invoke(monkeypatch, capfd, "-m", *TINY, *sweep[:-1], "trainer.lr=-1")
    assert code == 2 and err.strip() == "error: trainer.lr=-1.0 must be > 0"  # every job: the run's line
    # a swept value that refers to an environment variable not set: its job's, read as written
    unset = "trainer.lr=${oc.env:AAMPERF_TEST_UNSET},0.1"
    code, _, err = invoke(monkeypatch, capfd, "-m", *TINY, *sweep[:-1], unset)
    assert code == 2 and "Traceback" not in err
    assert err.strip().startswith("error: sweep job #0 (seed=0 trainer.lr=")
    assert "\"Environment variable 'AAMPERF_TEST_UNSET' not found\"" in err
    assert not (tmp_path / "sweep").exists()


def test_a_value_its_job_would_refuse_as_it_starts_refuses_the_sweep_before_the_first_runs(
    tmp_path, monkeypatch, capfd
):
    """The model's arguments are checked with every job's other values: model.seq_len=50 failed its job
    with a traceback, after the jobs before it had run."""
    sweep = [f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.cache_dir={tmp_path / 'cache'}"]
    sweep += ["model.seq_len=151,50", "compare.baseline='model.seq_len=151'"]
    code, out, err = invoke(monkeypatch, capfd, "-m", *TINY, *sweep)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: sweep job #1 (model.seq_len=50): model.seq_len=50 is shorter than an ASV's 151 tokens "
        "(START + 150 bp); set model.seq_len=151"
    ]
    assert not (tmp_path / "sweep").exists() and "#0" not in out


def test_a_sweep_whose_report_would_have_no_baseline_is_refused_before_the_first_runs(
    tmp_path, monkeypatch, capfd
):
    """A sweep of two values ran every job, then exited 2: compare.baseline (optim=baseline) matched both
    configurations. Refused at once, naming the configuration with the default values (seed aside), else the
    first job's (TINY's trainer.batch_size=4 is neither 8 nor 3)."""
    sweep = [f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.cache_dir={tmp_path / 'cache'}", "seed=0,1"]
    cases = {
        ("trainer.lr=0.001,0.0001",): "compare.baseline='optim=baseline' matches 2 configurations of this "
        "sweep ('trainer.lr=0.001', 'trainer.lr=0.0001'), and its report compares every other with one; name "
        "it: 'compare.baseline=\"trainer.lr=0.0001\"' (the default), or another of them",
        ("trainer.batch_size=8,3",): "compare.baseline='optim=baseline' matches 2 configurations of this "
        "sweep ('trainer.batch_size=8', 'trainer.batch_size=3'), and its report compares every other with "
        "one; name it: 'compare.baseline=\"trainer.batch_size=8\"' (the first job's), or another of them",
        ("trainer.lr=0.001,0.0001", "compare.baseline='precision=bf16'"): "compare.baseline='precision=bf16' "
        "matches none of the configurations of this sweep ('trainer.lr=0.001', 'trainer.lr=0.0001'), and its "
        "report compares every other with one; name it: 'compare.baseline=\"trainer.lr=0.0001\"' (the "
        "default), or another of them",
    }
    for overrides, said in cases.items():
        code, out, err = invoke(monkeypatch, capfd, "-m", *TINY, *sweep, *overrides)
        assert code == 2 and err.strip().splitlines() == [f"error: {said}"], err
        assert not (tmp_path / "sweep").exists() and "#0" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on a CUDA GPU: nothing to refuse there")
def test_a_job_this_device_cannot_run_fails_alone_in_a_sweep(cache_dir, tmp_path, monkeypatch, capfd):
    """What the device decides is no config mistake: a study sweeping fp16 for a GPU runs its other
    jobs on a CPU, and fp16 is a failed row with its fix (experiments/precision/)."""
    sweep = [f"hydra.sweep.dir={tmp_path}", f"data.cache_dir={cache_dir}", "trainer.max_steps=1"]
    sweep += ["precision=fp32,fp16", "compare.baseline='precision=fp32'"]
    code, _, err = invoke(monkeypatch, capfd, "-m", *TINY, *sweep)
    assert code == 1 and "precision=fp16 needs a CUDA GPU" in err and "Traceback" not in err
    by_precision = {
        s["config"]["precision"]["dtype"]: s["status"] for s in map(read_summary, tmp_path.glob("*/"))
    }
    assert by_precision == {"fp32": "completed", "fp16": "failed"}


def test_a_sweep_with_a_value_outside_a_choice_is_one_line(tmp_path, monkeypatch, capfd):
    sweep = ["-m", "compile.mode=fastest,default", f"hydra.sweep.dir={tmp_path}"]
    code, out, err = invoke(monkeypatch, capfd, *sweep)
    assert code == 2 and "Traceback" not in err, err
    assert [line.split(";")[0] for line in err.strip().splitlines()] == [
        "error: compile.mode=fastest is not one of disabled, default, reduce-overhead, max-autotune, auto"
    ]
    assert not list(tmp_path.glob("*/summary.json"))  # refused as it composes: no job ran


def test_a_bug_keeps_its_traceback(cache_dir, tmp_path, monkeypatch, capfd):
    def broken(cfg, run_dir, interrupts=None, sweep_job=False):
        raise RuntimeError("a bug")

    monkeypatch.setattr("aamperf.run.train", broken)  # main() imports it when it runs
    with pytest.raises(RuntimeError, match="a bug"):  # uncaught: Python prints the traceback, exit 1
        invoke(monkeypatch, capfd, *TINY, f"hydra.run.dir={tmp_path}")
    assert "HYDRA_FULL_ERROR" not in os.environ  # set for the call only


def test_hydra_full_error_keeps_hydras_report(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigCompositionException, match="trainer.batchsize"):
        invoke(monkeypatch, capfd, "trainer.batchsize=8", f"hydra.run.dir={tmp_path}")


def test_cfg_job_still_prints_the_config(monkeypatch, capfd):
    code, out, _ = invoke(monkeypatch, capfd, "--cfg", "job", "trainer.max_steps=7")
    assert code == 0 and "  max_steps: 7\n" in out


def test_a_sweep_and_its_config_at_once_is_one_line(monkeypatch, capfd):
    code, out, err = invoke(monkeypatch, capfd, "-m", "--cfg", "job", "optim=baseline,ultra")
    assert code == 2 and "Traceback" not in err and not out
    assert err.strip().splitlines() == [
        "error: Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified: one of "
        "them per command; to see a sweep job's config, drop -m: python -m aamperf.train --cfg job <that "
        "job's overrides>"
    ]


def test_the_shell_sees_exit_code_2_for_a_config_mistake(launch):
    proc, run_dir = launch("trainer.batchsize=8", tiny=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: trainer.batchsize is not a config key; did you mean trainer.batch_size?"
    ]
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("missing", "said"),
    [
        ("hydra/sweeper/optuna", "hparams_search=fastest needs the hydra-optuna-sweeper package: "
         "pip install 'aamperf[search]'"),
        ("hydra/launcher/submitit_slurm", "hydra/launcher=slurm needs the hydra-submitit-launcher package"),
    ],
)  # fmt: skip
def test_a_hydra_plugin_not_installed_names_the_extra_that_installs_it(missing, said):
    """What Hydra raises where an extra of pyproject.toml is not installed (seen from a wheel installed
    without extras: Hydra's "Could not find 'hydra/sweeper/optuna' ... Available options: basic")."""
    from hydra.errors import MissingConfigException

    from aamperf.errors import hydra_error_message

    exc = MissingConfigException(f"Could not find '{missing}'", missing_cfg_file=missing, options=["basic"])
    assert hydra_error_message(exc).startswith(said)


def test_cores_are_named_as_taskset_writes_them():
    assert taskset_list([6, 0, 2, 1, 3]) == "0-3,6"
    assert taskset_list([5]) == "5"
