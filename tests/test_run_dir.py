"""A run directory's records are never lost: one run at a time holds it, from before Hydra writes there;
files that are not aamperf's are left alone; a damaged checkpoint or metrics line costs no work and no
record; a run's end is said in its train.log; a full disk at the start is one line."""

import logging
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, losses, on_tmpfs, read_summary, wait_for_steps
from test_faults import tmpfs_works

from aamperf import checkpoint
from aamperf.files import CLAIM
from aamperf.run import train


def files_of(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


@pytest.mark.slow  # three launches, one training until the others are refused
def test_a_run_directory_in_use_is_refused_before_anything_is_written_there(launch):
    """Two runs in one hydra.run.dir: the second, started while the first trains, is refused with exit 2
    before Hydra rewrites .hydra/ (the live run's config.yaml said seed 5 for a run trained with seed 0),
    with or without trainer.resume=auto; the first goes on, its records whole."""
    first, run_dir = launch("seed=0", "trainer.max_steps=100000", "trainer.resume=auto", wait=False)
    try:
        wait_for_steps(first, run_dir, 2)
        before = files_of(run_dir / ".hydra")
        seconds = [launch("seed=5", *resume).proc for resume in ([], ["trainer.resume=auto"])]
        after = files_of(run_dir / ".hydra")
        assert first.poll() is None, "the first run ended before the second was refused: it proves nothing"
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    for second in seconds:
        assert second.returncode == 2, second.stderr[-3000:]
        assert (
            second.stderr.strip()
            .splitlines()[-1]
            .startswith(f"error: run directory {run_dir} is in use by process {first.pid} ")
        ), second.stderr[-3000:]
    assert after == before  # not a byte of the live run's config or overrides rewritten
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    done = read_summary(run_dir)
    assert done["config"]["seed"] == 0 and done["status"] == "interrupted"
    assert [step for step, _, _ in losses(run_dir)] == list(range(1, done["steps"] + 1))
    assert not (run_dir / CLAIM).exists()  # released as the run ended


def test_a_claim_held_by_a_live_process_refuses_and_a_killed_ones_is_taken_over(make_cfg, tmp_path):
    """The claim is a lock its process holds: a process that is killed (no clean-up) leaves only a file,
    which the next run takes over."""
    from aamperf.errors import UserError

    holder = subprocess.Popen(
        [*PYTHON, "-c", "import sys, time; from pathlib import Path; from aamperf.files import Claim; "
         f"Claim(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"is in use by process {holder.pid} "):
            train(make_cfg(), tmp_path)
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / CLAIM).exists()  # a kill leaves the file
    assert train(make_cfg(), tmp_path)["status"] == "completed"
    assert not (tmp_path / CLAIM).exists()


def test_files_in_checkpoints_that_are_not_aamperfs_are_left_alone(make_cfg, tmp_path):
    """A backup and a hand-named checkpoint beside the run's own: the resume and the pruning of the next
    saves crashed on their names."""
    train(make_cfg("trainer.max_steps=2", "trainer.checkpoint_every=1", "trainer.keep_last=1"), tmp_path)
    saved = tmp_path / checkpoint.CHECKPOINT_DIR
    (saved / "step_00000006.pt.bak").write_bytes(b"a backup")
    (saved / "step_final.pt").write_bytes((saved / "step_00000002.pt").read_bytes())
    (saved / "step_old").mkdir()
    summary = train(
        make_cfg(
            "trainer.max_steps=4", "trainer.checkpoint_every=1", "trainer.keep_last=1", "trainer.resume=auto"
        ),
        tmp_path,
    )
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    assert sorted(p.name for p in saved.iterdir()) == [
        "step_00000004.pt", "step_00000006.pt.bak", "step_final.pt", "step_old"
    ]  # fmt: skip
    assert (saved / "step_00000006.pt.bak").read_bytes() == b"a backup"


@pytest.mark.slow  # ~6 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_a_damaged_newest_checkpoint_is_kept_and_the_run_goes_on_from_the_one_before(
    make_cfg, tmp_path, caplog
):
    common = ["trainer.checkpoint_every=2", "trainer.keep_last=3"]
    whole = tmp_path / "whole"
    train(make_cfg(*common, "trainer.max_steps=6"), whole)
    run_dir = tmp_path / "run"
    train(make_cfg(*common, "trainer.max_steps=4"), run_dir)
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    damaged = newest.read_bytes()[:1000]  # truncated: a copy cut short, a disk error
    newest.write_bytes(damaged)
    with caplog.at_level(logging.WARNING):
        summary = train(make_cfg(*common, "trainer.max_steps=6", "trainer.resume=auto"), run_dir)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    assert losses(run_dir) == losses(whole)  # steps 3 and 4 trained again, bit for bit
    kept = run_dir / "checkpoints" / "step_00000004.pt.damaged"
    assert kept.read_bytes() == damaged  # kept for a look, under a name no resume reads
    assert f"{newest} cannot be read" in caplog.text and "step_00000004.pt.damaged" in caplog.text


@pytest.mark.slow  # two launches
def test_a_metrics_line_cut_short_before_the_newest_checkpoint_is_logged_again(launch, tmp_path):
    """Power lost with step 6's line in the page cache and its checkpoint on disk: the resume goes on from
    the checkpoint before that line, so step 6's record comes back; the warning is in train.log."""
    resumable = ["trainer.checkpoint_every=2", "trainer.keep_last=2", "trainer.max_steps=6"]
    run, run_dir = launch(*resumable)
    assert run.returncode == 0, run.stderr[-3000:]
    whole = losses(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    run, _ = launch(*resumable, "trainer.resume=auto")
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_summary(run_dir)["resumed_from_step"] == 4
    assert losses(run_dir) == whole  # step 6 trained and logged again, bit for bit
    assert "dropped 1 damaged line(s)" in (run_dir / "train.log").read_text()


@pytest.mark.slow  # two launches
def test_a_runs_failure_or_abort_is_said_in_its_train_log(launch):
    failed, run_dir = launch("data.target=bmi", name="failed")
    assert failed.returncode == 2, failed.stderr[-3000:]
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith("error: data.target: no column 'bmi'")
    assert (run_dir / "train.log").read_text().endswith(f"[aamperf.train][ERROR] - {line}\n")

    poisoned = ["loss._target_=plugin_model.PoisonedLoss", "+loss.into=batch", "+loss.from_step=2"]
    aborted, run_dir = launch(*poisoned, "trainer.max_steps=8", "trainer.max_nonfinite=2", name="aborted")
    assert aborted.returncode == 3, aborted.stderr[-3000:]
    line = aborted.stderr.strip().splitlines()[-1]
    assert line.startswith("aborted: 2 non-finite steps in a row")
    assert (run_dir / "train.log").read_text().endswith(f"[aamperf.train][ERROR] - {line}\n")


@pytest.mark.parametrize(
    ("room", "what"),
    [
        (0, "of {run_dir} to write the run's claim on its directory (.running); free space there or"),
        (4096, "of the run directory to write its files; free space there or"),  # the claim's page: Hydra's
    ],
    ids=["full", "room for the claim only"],
)
def test_a_disk_full_at_the_start_is_one_line(launch, tmp_path, room, what):
    if not tmpfs_works(tmp_path):
        pytest.skip("no tmpfs can be mounted here (unshare or mount refused): a full disk needs one")
    disk, kept, size = tmp_path / "disk", tmp_path / "kept", 65536
    disk.mkdir()
    fill = ["sh", "-c", f'head -c {size - room} /dev/zero > {disk}/fill; exec "$@"', "sh"]  # before the run
    run_dir = disk / "run"
    tmpfs = on_tmpfs(size, disk, kept)
    run, _ = launch(f"hydra.run.dir={run_dir}", name=None, launcher=[*tmpfs, *fill, *PYTHON])
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        f"error: no space left on the file system {what.format(run_dir=run_dir)} set hydra.run.dir elsewhere"
    ]
