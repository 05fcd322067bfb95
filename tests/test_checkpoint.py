"""Checkpoints: a run killed with SIGKILL goes on exactly where it stopped; bad checkpoints are refused."""

import copy
import shutil
import signal
from pathlib import Path

import psutil
import pytest
import torch
from conftest import losses, read_summary, torchrun, wait_for_steps

from aamperf.checkpoint import check_resume, config_changes
from aamperf.errors import UserError
from aamperf.run import train
from aamperf.summary import resolved_config

RESUMABLE = [
    "trainer.max_steps=12",
    "trainer.checkpoint_every=2",
    "trainer.resume=auto",
    "trainer.val_every=4",
]


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_run_killed_mid_training_resumes_with_the_same_losses(launch):
    proc, whole = launch(*RESUMABLE, name="whole")
    assert proc.returncode == 0, proc.stderr[-3000:]

    proc, killed = launch(*RESUMABLE, name="killed", wait=False)
    wait_for_steps(proc, killed, 5)
    proc.send_signal(signal.SIGKILL)  # no handler, no cleanup: as the OOM killer or a preemption
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    logged_before = len((killed / "metrics.jsonl").read_text().splitlines())  # a line cut short counts
    assert 5 <= logged_before < 12, "the run was not killed mid-training"
    assert not (killed / "summary.json").exists() or read_summary(killed)["status"] != "completed"

    resumed, _ = launch(*RESUMABLE, name="killed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = read_summary(killed)
    assert summary["status"] == "completed" and summary["resumed_from_step"] in (4, 6, 8, 10)
    # bitwise on CPU fp32: every step once, in order, with the loss of the uninterrupted run
    assert losses(killed) == losses(whole)


def test_checkpoints_are_loadable_without_code_and_only_the_newest_kept(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=4", "trainer.checkpoint_every=1", "trainer.keep_last=2"), tmp_path)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_00000003.pt", "step_00000004.pt"]
    state = torch.load(tmp_path / "checkpoints" / kept[-1], weights_only=True)  # no pickled code inside
    assert state["step"] == 4 and {"model", "optimizer", "scheduler", "scaler", "rngs", "stream"} <= set(
        state
    )


def test_a_kill_during_a_save_leaves_the_last_good_checkpoint(make_cfg, tmp_path, monkeypatch):
    """The process dies halfway through writing step 4 (SystemExit here, whose partial file is removed; a
    kill leaves it, planted below): step 2 stays the newest checkpoint, and a re-run goes on from it and
    removes the partial file."""
    resumable = make_cfg("trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.resume=auto")
    real_save = torch.save

    def dies_halfway(obj, f):
        if "step_00000004" in str(getattr(f, "name", f)):
            f.write(b"the first bytes of step 4")
            f.flush()
            raise SystemExit(137)
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(SystemExit):
        train(resumable, tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    saved = tmp_path / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == ["step_00000002.pt"]
    (saved / ".step_00000004.pt.k1ll3d.tmp").write_bytes(b"the first bytes of step 4")  # a kill's leftover
    summary = train(resumable, tmp_path)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    assert sorted(p.name for p in saved.iterdir()) == ["step_00000002.pt", "step_00000004.pt"]
    assert torch.load(saved / "step_00000004.pt", weights_only=True)["step"] == 4


def test_a_checkpoint_of_another_model_is_refused_with_the_fix(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=2"), tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    # the saved config tells first, before any weight is restored: the key, both values, the fix
    fix = r"cannot resume from .*step_00000002.pt with model.embedding_dim=24 \(checkpoint: \d+\).*set them"
    with pytest.raises(UserError, match=fix):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto", "model.embedding_dim=24"), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing written before is lost


# keys of the groups a resume keeps, added since: a checkpoint written before them ran as their defaults
ADDED_KEYS = {
    "data": ["unifrac_metric", "asv_sampling"],
    "loss": ["mask_strategy", "over_weight", "under_weight", "count_weight"],
    "model": [
        "target_activation",
        "count_head",
        "count_layers",
        "target_hidden_dims",
        "target_dropout",
        "target_residual",
    ],
}


def test_a_checkpoint_from_before_a_key_resumes_where_the_run_keeps_its_value(make_cfg):
    now = resolved_config(make_cfg())
    saved = copy.deepcopy(now)
    for group, keys in ADDED_KEYS.items():
        for key in keys:
            del saved[group][key]
    assert config_changes(saved, now) == {}
    check_resume(Path("step_00000002.pt"), config_changes(saved, now))
    span = resolved_config(make_cfg("loss.mask_strategy=span"))
    with pytest.raises(UserError, match=r"with loss.mask_strategy=span \(checkpoint: None\)"):
        check_resume(Path("step_00000002.pt"), config_changes(saved, span))


def test_a_resume_with_another_optimizer_update_is_refused_and_its_own_goes_on(make_cfg, tmp_path):
    """optimizer.algorithm=sgd's state (momentum buffers) is not AdamW's: a resume keeps the update."""
    sgd = ["optimizer.algorithm=sgd", "trainer.checkpoint_every=2", "trainer.resume=auto"]
    train(make_cfg(*sgd, "trainer.max_steps=2"), tmp_path)
    with pytest.raises(
        UserError, match=r"with optimizer.algorithm=adamw \(checkpoint: sgd\): a resume keeps"
    ):
        train(make_cfg("trainer.checkpoint_every=2", "trainer.resume=auto", "trainer.max_steps=4"), tmp_path)
    resumed = train(make_cfg(*sgd, "trainer.max_steps=4"), tmp_path)
    assert resumed["resumed_from_step"] == 2 and resumed["phases"]["optimizer"]["reason"].startswith(
        "optimizer.impl=for_loop (sgd"
    )


def test_a_corrupt_checkpoint_is_refused_with_the_fix(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=2"), tmp_path)
    (tmp_path / "checkpoints" / "step_00000002.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot resume from"):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"), tmp_path)


# two ranks: 45 s (ddp) on a 2-core AVX2-only EPYC: `pytest -m slow` (the default suite stays near 10 min)
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_checkpoint_saved_and_resumed(launch, tmp_path, strategy):
    """2 ranks: a full (DDP, rank 0) or sharded (FSDP2, torch.distributed.checkpoint) checkpoint,
    resumed by a new 2-rank launch and by one process, with the losses of the run that went through."""
    settings = [*RESUMABLE, "trainer.max_steps=6", "model.dropout=0", "data.val_fraction=0.31"]
    settings += ["trainer.batch_size=8", f"distributed={strategy}", "trainer.keep_last=3"]
    run, whole = launch(*settings, name="whole", launcher=torchrun(2))
    assert run.returncode == 0, run.stderr[-3000:]
    newest = sorted((whole / "checkpoints").iterdir())[-1]
    assert newest.name.startswith("step_00000006")
    if strategy == "fsdp":
        assert newest.is_dir() and list(newest.glob("*.distcp"))  # one shard file per rank
    again = tmp_path / "again"  # the same run, stopped after its step-4 checkpoint
    shutil.copytree(whole, again)
    stale = again / "checkpoints" / newest.name
    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    one = tmp_path / "one"  # the same checkpoint, resumed by a single process (another world size)
    shutil.copytree(again, one)
    run, _ = launch(*settings, name="again", launcher=torchrun(2))
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_summary(again)["resumed_from_step"] == 4
    assert [loss for _, loss, _ in losses(again)] == pytest.approx(
        [loss for _, loss, _ in losses(whole)], rel=1e-6
    )
    single = [o for o in settings if not o.startswith("distributed=")] + ["distributed=none"]
    run, _ = launch(*single, name="one")
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_summary(one)["resumed_from_step"] == 4
    assert [loss for _, loss, _ in losses(one)] == pytest.approx(
        [loss for _, loss, _ in losses(whole)], rel=1e-5
    )


@pytest.mark.slow  # about 20 s: two launches of two ranks (the default suite stays under 10 min)
def test_torchrun_restarts_a_killed_rank_and_goes_on_from_the_last_checkpoint(launch):
    """Elastic restart (torchrun --max-restarts): one rank dies, torchrun restarts both, they resume."""
    settings = [*RESUMABLE, "model.dropout=0", "data.val_fraction=0.31", "trainer.batch_size=8"]
    settings += ["distributed=ddp"]
    run, whole = launch(*settings, name="whole", launcher=torchrun(2))
    assert run.returncode == 0, run.stderr[-3000:]

    proc, restarted = launch(
        *settings, name="restarted", launcher=torchrun(2, "--max-restarts=1"), wait=False
    )
    wait_for_steps(proc, restarted, 5)
    ranks = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "aamperf.train" in " ".join(p.cmdline())
    ]
    assert len(ranks) == 2
    ranks[1].kill()  # one rank dies (SIGKILL); torchrun tears the group down and starts it again
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = read_summary(restarted)
    assert summary["status"] == "completed" and summary["resumed_from_step"] in (4, 6, 8, 10)
    assert [loss for _, loss, _ in losses(restarted)] == pytest.approx(
        [loss for _, loss, _ in losses(whole)], rel=1e-6
    )


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_compile_auto_on_a_resume_counts_only_the_steps_left(make_cfg, tmp_path):
    """A trial that pays over a run's 30 steps (0.5 s saved a step, 10 s to compile) does not over the 15
    a resume from step 15 has left: the resumed run stays eager and says so."""
    from aamperf.phases.compile import trial_context
    from aamperf.probe import Probe

    common = ["trainer.checkpoint_every=15", "trainer.resume=auto", f"probe.cache={tmp_path / 'probe.json'}"]
    train(make_cfg(*common, "trainer.max_steps=15"), tmp_path / "run")
    cfg = make_cfg(*common, "trainer.max_steps=30", "compile=auto")
    figures = {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 10.0, "graphs": 1}
    trial = {"context": trial_context(cfg, cfg.trainer.batch_size)}
    Probe(torch.device("cpu"), cfg.probe.cache).answer(
        "compile_trial", trial, lambda: {**figures, "under_load": None}
    )
    summary = train(cfg, tmp_path / "run")
    auto = summary["phases"]["compile"]["auto"]
    assert summary["resumed_from_step"] == 15 and summary["status"] == "completed"
    assert auto["chose"] == "disabled"
    assert "7.5 s saved over 15 steps <= 10.0 s of compiling" in auto["reason"]
