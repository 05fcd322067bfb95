"""Checkpoints: a run killed with SIGKILL goes on exactly where it stopped; bad checkpoints are refused."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import TINY

from aamperf.errors import UserError
from aamperf.run import train

RESUMABLE = [
    "trainer.max_steps=12",
    "trainer.checkpoint_every=2",
    "trainer.resume=auto",
    "trainer.val_every=4",
]


def command(cache_dir, run_dir, *overrides, ranks=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [
        *(launcher if ranks > 1 else [sys.executable]),
        "-m",
        "aamperf.train",
        *TINY,
        f"data.cache_dir={cache_dir}",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


def test_a_run_killed_mid_training_resumes_with_the_same_losses(tmp_path, cache_dir):
    whole = tmp_path / "whole"
    subprocess.run(command(cache_dir, whole, *RESUMABLE), check=True, capture_output=True, timeout=300)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        command(cache_dir, killed, *RESUMABLE), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5) and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no handler, no cleanup: as the OOM killer or a preemption
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    logged_before = len(metrics.read_text().splitlines())
    assert 5 <= logged_before < 12, "the run was not killed mid-training"
    assert (
        not (killed / "summary.json").exists()
        or json.loads((killed / "summary.json").read_text())["status"] != "completed"
    )

    resumed = subprocess.run(
        command(cache_dir, killed, *RESUMABLE), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
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
    with pytest.raises(UserError, match="cannot resume from .*step_00000002.pt.*trainer.resume=disabled"):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto", "model.embedding_dim=24"), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing written before is lost


def test_a_corrupt_checkpoint_is_refused_with_the_fix(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=2"), tmp_path)
    (tmp_path / "checkpoints" / "step_00000002.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot resume from"):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"), tmp_path)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_checkpoint_saved_and_resumed(tmp_path, cache_dir, strategy):
    """2 ranks: a full (DDP, rank 0) or sharded (FSDP2, torch.distributed.checkpoint) checkpoint,
    resumed by a new 2-rank launch and by one process, with the losses of the run that went through."""
    settings = [*RESUMABLE, "trainer.max_steps=6", "model.dropout=0", "data.val_fraction=0.31"]
    settings += ["trainer.batch_size=8", f"distributed={strategy}", "trainer.keep_last=3"]
    whole = tmp_path / "whole"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run(
        command(cache_dir, whole, *settings, ranks=2), capture_output=True, text=True, env=env
    )
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
    run = subprocess.run(
        command(cache_dir, again, *settings, ranks=2), capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((again / "summary.json").read_text())["resumed_from_step"] == 4
    assert [loss for _, loss, _ in losses(again)] == pytest.approx(
        [loss for _, loss, _ in losses(whole)], rel=1e-6
    )
    single = [o for o in settings if not o.startswith("distributed=")] + ["distributed=none"]
    run = subprocess.run(command(cache_dir, one, *single), capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((one / "summary.json").read_text())["resumed_from_step"] == 4
    assert [loss for _, loss, _ in losses(one)] == pytest.approx(
        [loss for _, loss, _ in losses(whole)], rel=1e-5
    )


def test_torchrun_restarts_a_killed_rank_and_goes_on_from_the_last_checkpoint(tmp_path, cache_dir):
    """Elastic restart (torchrun --max-restarts): one rank dies, torchrun restarts both, they resume."""
    settings = [*RESUMABLE, "model.dropout=0", "data.val_fraction=0.31", "trainer.batch_size=8"]
    settings += ["distributed=ddp"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    whole = tmp_path / "whole"
    run = subprocess.run(
        command(cache_dir, whole, *settings, ranks=2), capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]

    restarted = tmp_path / "restarted"
    cmd = command(cache_dir, restarted, *settings, ranks=2)
    cmd.insert(cmd.index("--standalone"), "--max-restarts=1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = restarted / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5) and time.time() < deadline:
        time.sleep(0.01)
    ranks = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "aamperf.train" in " ".join(p.cmdline())
    ]
    assert len(ranks) == 2
    ranks[1].kill()  # one rank dies (SIGKILL); torchrun tears the group down and starts it again
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = json.loads((restarted / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from_step"] in (4, 6, 8, 10)
    assert [loss for _, loss, _ in losses(restarted)] == pytest.approx(
        [loss for _, loss, _ in losses(whole)], rel=1e-6
    )
