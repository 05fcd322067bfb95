"""Faults that clusters and shared machines bring, with real processes: stop signals (SIGTERM, SIGINT, a
second one, SLURM's preemption signal) and checkpoint files crafted to run code."""

import io
import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, losses, on_tmpfs, read_metrics, read_summary, torchrun, wait_for_steps

from aamperf import checkpoint, rng
from aamperf.errors import UserError
from aamperf.interrupts import Interrupts, RunInterrupted, stop_at_once, stop_if_signalled

LONG = ["trainer.max_steps=40", "trainer.val_every=8", "trainer.resume=auto"]


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_sigterm_finishes_the_step_keeps_a_checkpoint_and_the_run_goes_on_from_it(launch):
    proc, whole = launch(*LONG, name="whole")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # trainer.checkpoint_every=0: SIGTERM writes one anyway
    proc, stopped = launch(*LONG, name="stopped", wait=False)
    wait_for_steps(proc, stopped, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted: SIGTERM received")
    done = read_summary(stopped)
    assert done["status"] == "interrupted" and 3 <= done["steps"] < 40
    assert checkpoint.checkpoints(stopped)[-1].name == f"step_{done['steps']:08d}.pt"

    resumed, _ = launch(*LONG, name="stopped")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_summary(stopped)["resumed_from_step"] == done["steps"]
    assert losses(stopped) == losses(whole)  # every step once, bitwise (CPU fp32)


@pytest.mark.slow  # over 12 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_sigint_stops_after_the_step_in_one_line_without_a_checkpoint_when_none_is_asked(launch):
    proc, run_dir = launch(*LONG, wait=False)
    wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "no checkpoint (trainer.checkpoint_every=0" in err.strip().splitlines()[-1]
    warned = (run_dir / "train.log").read_text()  # the warning when it came says so too
    assert "SIGINT received: stopping after this step (no checkpoint)" in warned
    assert read_summary(run_dir)["status"] == "interrupted" and not checkpoint.checkpoints(run_dir)


# ~4-7 s (a run launched, to its second step); its handler's second signal is in the default suite:
# test_a_second_signal_to_the_handler_ends_its_process_at_once
@pytest.mark.slow
def test_a_second_signal_ends_the_process_at_once(launch):
    proc, run_dir = launch(*LONG, wait=False)
    wait_for_steps(proc, run_dir, 2)
    # two different signals at once (two of one kind pending together would be delivered as one)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    # killed by the second, whichever was handled first: no step finished, nothing written
    assert proc.returncode in (-signal.SIGTERM, -signal.SIGINT)
    assert not checkpoint.checkpoints(run_dir)


def test_a_second_signal_to_the_handler_ends_its_process_at_once():
    """The run's handler in its training loop (a step under way): the first signal waits for the step's end,
    the second kills the process at once, by its own default action. A process without torch (0.2 s)."""
    code = (
        "import os, signal, time\n"
        "from aamperf.interrupts import Interrupts\n"
        "with Interrupts() as interrupts:\n"
        "    interrupts.in_loop = True\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(10)\n"
        "print('went on')\n"
    )
    proc = subprocess.run([*PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("loop_ended", "when"),
    [(False, "before training began; nothing to keep"), (True, "after the last step, before the run's")],
)
def test_a_signal_outside_the_training_loop_stops_the_run_at_once_and_says_when(loop_ended, when):
    stop = pytest.raises(RunInterrupted, match=f"^SIGTERM received {when}")
    with stop as stopped, Interrupts() as interrupts:
        interrupts.loop_ended = loop_ended
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here, at once
    assert stopped.value.exit_code == 143 and interrupts.signum == signal.SIGTERM


def test_a_stop_signal_handled_in_a_finalizer_still_stops_the_command(capfd):
    """predict went on to the end (exit 0) when its SIGINT was handled as a weakref's callback ran: Python
    drops an exception raised in a finalizer. The signal is sent again, to land in the code around it."""

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # handled here, inside the finalizer

    with pytest.raises(SystemExit) as stopped, stop_at_once("nothing written"):
        Finalized()  # gone at once
        time.sleep(5)  # the code the finalizer interrupted: the stop lands here
    assert stopped.value.code == 130
    assert capfd.readouterr().err.strip().splitlines() == ["interrupted: SIGINT received; nothing written"]


def test_a_stop_signal_that_the_interrupted_code_swallowed_still_stops_the_command(capfd):
    """A bare `except:` in the code a signal interrupted swallows the handler's StopSignal: the command
    stops at the next check (predict's, before its files are written), not at its end with exit 0."""
    went_on = []
    with pytest.raises(SystemExit) as stopped, stop_at_once("nothing written"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        except BaseException:  # noqa: BLE001 - what the test is about
            pass
        went_on.append(True)
        stop_if_signalled()
        went_on.append(False)  # not reached
    assert stopped.value.code == 130 and went_on == [True]
    assert capfd.readouterr().err.strip().splitlines() == ["interrupted: SIGINT received; nothing written"]
    with pytest.raises(SystemExit), stop_at_once("nothing written"):  # or, unchecked, at the end
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException:  # noqa: BLE001
            pass
    assert capfd.readouterr().err.strip().splitlines() == ["interrupted: SIGTERM received; nothing written"]
    with stop_at_once("nothing written"):  # the next command under it starts afresh
        stop_if_signalled()


@pytest.mark.slow  # about 40 s: submitit's runner, a requeue and a resumed run (the suite stays under 10 min)
def test_a_preempted_submitit_job_checkpoints_is_requeued_and_goes_on_to_the_end(launch):
    """hydra/launcher=submitit_local: submitit's own job runner, as under SLURM. Its preemption signal
    (SIGUSR2) to the job: aamperf finishes the step and checkpoints, submitit requeues the job, and the
    requeued job goes on from the checkpoint (trainer.resume=auto) in the same directory to the end."""
    import psutil

    settings = ["hydra/launcher=submitit_local", "hydra.sweep.subdir=job", "hydra.launcher.timeout_min=10"]
    proc, sweep = launch(*LONG, *settings, name="sweep", multirun=True, wait=False)
    run_dir = sweep / "job"
    wait_for_steps(proc, run_dir, 3)
    [job] = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "submitit.core._submit" in " ".join(p.cmdline())
    ]
    job.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    logs = "".join(f.read_text() for f in (sweep / ".submitit").rglob("*_log.*"))
    assert "SIGUSR2" in logs and "Requeued job" in logs, logs[-3000:]
    done = read_summary(run_dir)
    assert done["status"] == "completed" and done["steps"] == 40
    assert 3 <= done["resumed_from_step"] < 40
    assert [step for step, _, _ in losses(run_dir)] == list(range(1, 41))  # every step once


# ---- checkpoints that carry code: none of it may run ------------------------------------------------


class Payload:
    """Unpickling this creates `marker`: what a crafted checkpoint would do with a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fmt", ["pt", "sharded"])
@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_checkpoint_with_a_pickle_payload_is_refused_and_runs_nothing(launch, tmp_path, fmt):
    """A run with trainer.resume=auto finds a crafted newest checkpoint: a file, or a sharded directory
    whose `.metadata` (a pickle, read by torch.distributed.checkpoint) is the payload."""
    run_dir, marker = tmp_path / "run", tmp_path / "payload_ran"
    step = run_dir / "checkpoints" / "step_00000099"
    if fmt == "pt":
        step.parent.mkdir(parents=True)
        torch.save({"model": Payload(marker)}, step.with_suffix(".pt"))
    else:
        step.mkdir(parents=True)
        (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    run, _ = launch("trainer.resume=auto")
    assert not marker.exists(), "code from the checkpoint ran"
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(
        "error: cannot resume from"
    ), run.stderr[-3000:]


def test_a_sharded_checkpoint_whose_trainer_state_carries_a_payload_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer()
    path, marker = tmp_path / "step_00000004", tmp_path / "payload_ran"
    _sharded_checkpoint(path, model, optimizer)
    torch.save({"rngs": Payload(marker), "step": 4}, path / "trainer.pt")
    with pytest.raises(UserError, match="cannot resume from"):
        checkpoint.load(path, model, optimizer)
    assert not marker.exists(), "code from the checkpoint ran"


def test_a_sharded_checkpoint_item_with_a_payload_is_refused_and_runs_nothing(tmp_path):
    """DCP stores non-tensor values (the optimizer's hyper-parameters) as pickled bytes items; torch's own
    planner unpickles them in full. The payload is real: torch's reader runs it."""
    model, optimizer = _model_and_optimizer()
    path, marker = tmp_path / "step_00000004", tmp_path / "payload_ran"
    _sharded_checkpoint(path, model, optimizer)
    _put_payload_in_a_bytes_item(path, marker)

    with pytest.raises(UserError, match="cannot resume from"):
        checkpoint.load(path, model, optimizer)
    assert not marker.exists(), "code from the checkpoint ran"

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)  # torch's own reader
    assert marker.exists(), "the test's payload does not run: it proves nothing"


def test_a_real_sharded_checkpoint_loads_through_the_restricted_reader(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = tmp_path / "step_00000004"
    _sharded_checkpoint(path, model, optimizer)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lr = optimizer.param_groups[0]["lr"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer.param_groups[0]["lr"] = 99.0
    state = checkpoint.load(path, model, optimizer)
    assert state["step"] == 4 and optimizer.param_groups[0]["lr"] == lr
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def _model_and_optimizer():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _sharded_checkpoint(path: Path, model, optimizer) -> None:
    """A sharded checkpoint as checkpoint.save writes one under FSDP2 (here in one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)
    torch.save({"rngs": [rng.rng_state()], "step": 4}, path / "trainer.pt")


def _put_payload_in_a_bytes_item(path: Path, marker: Path) -> None:
    """Append a torch-serialized payload to the shard file and point a non-tensor item's entry at it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((path / ".metadata").read_bytes())
    name = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == name)
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    shard = path / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    info.offset, info.length = offset, len(buffer.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


# ---- run directories, full disks, damaged caches and records ------------------------------------------


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_two_runs_started_together_get_a_directory_each(launch, tmp_path):
    """The default run directory: two launches in the same second (both started at once here) used to
    share outputs/runs/<date>/<time> and interleave their metrics."""
    procs = [launch("seed=0", name=None, cwd=tmp_path, wait=False).proc for _ in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    runs = sorted((tmp_path / "outputs" / "runs").glob("*/*"))
    assert len(runs) == 2
    for run in runs:
        assert [step for step, _, _ in losses(run)] == [1, 2, 3]


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_partial_last_line_in_the_metrics_does_not_stop_a_resume(make_cfg, tmp_path):
    from aamperf.run import train

    train(make_cfg("trainer.max_steps=4", "trainer.checkpoint_every=2"), tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # power lost mid-line
    summary = train(make_cfg("trainer.max_steps=6", "trainer.resume=auto"), tmp_path)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 4
    assert [step for step, _, _ in losses(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_resume_refuses_a_new_batch_and_applies_a_new_lr(make_cfg, tmp_path):
    from aamperf.run import train

    train(make_cfg("trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.lr=1e-4"), tmp_path)
    with pytest.raises(UserError, match=r"trainer.batch_size=8 \(checkpoint: 4\)"):
        train(make_cfg("trainer.max_steps=6", "trainer.resume=auto", "trainer.batch_size=8"), tmp_path)
    summary = train(make_cfg("trainer.max_steps=6", "trainer.resume=auto", "trainer.lr=1e-2"), tmp_path)
    assert summary["resume_changes"]["trainer.lr"] == [1e-4, 1e-2]
    rows = read_metrics(tmp_path)
    assert rows[4]["step"] == 5 and rows[4]["lr"] > 1e-3  # the new lr's schedule, not the old one's


@pytest.mark.parametrize(  # truncated in the fast suite; the other two kinds with the slow tests
    "damage_kind",
    [
        "truncated",
        pytest.param("empty", marks=pytest.mark.slow),
        pytest.param("garbage", marks=pytest.mark.slow),
    ],
)
def test_a_damaged_cache_is_rebuilt_with_a_warning(make_cfg, tmp_path, damage_kind, caplog, monkeypatch):
    """Each cache a run reads: the simulated data set, its sample store, its UniFrac matrix (precomputed
    mode), the peak FLOP/s record."""
    import shutil

    from aamperf.data.tables import resolve_files
    from aamperf.metrics.flops import LoadWatch
    from aamperf.run import train

    # the machine's load is not this test's subject: a peak calibration judged "under load" is not cached,
    # and the test needs every cache written (on a busy machine, tests running beside it, it was not)
    monkeypatch.setattr(LoadWatch, "verdict", staticmethod(lambda *args, **kwargs: None))

    # the tiny data set alone from the session's cache, not the other tests' entries: its sample store,
    # UniFrac matrix and peak FLOP/s record this test's first run writes
    simulated = resolve_files(make_cfg().data)["table"].parent
    cache = tmp_path / "cache"
    shutil.copytree(simulated, cache / "simulated" / simulated.name)
    # metrics.peak_flops=null: the calibration runs and writes its cache, one of those damaged below
    overrides = (f"data.cache_dir={cache}", "data.unifrac_mode=precomputed", "metrics.peak_flops=null")
    first = train(make_cfg(*overrides), tmp_path / "first")  # every cache written

    def damage(path):
        whole = path.read_bytes()
        kinds = {"truncated": whole[: len(whole) // 2], "empty": b"", "garbage": os.urandom(64)}
        path.write_bytes(kinds[damage_kind])

    # the derived caches first: a rebuilt data set is new content, whose store and matrix are new entries
    for path in [
        *(cache / "samples").glob("*/index.npz"),
        *(cache / "unifrac").glob("*.npz"),
        cache / "peak_flops.json",
    ]:
        damage(path)
    second = train(make_cfg(*overrides), tmp_path / "second")
    damage(cache / "simulated" / simulated.name / "table.biom")
    third = train(make_cfg(*overrides), tmp_path / "third")
    for summary in (second, third):
        assert summary["status"] == "completed"
        assert (summary["n_train"], summary["n_val"]) == (first["n_train"], first["n_val"])
    warned = caplog.text
    assert "sample store" in warned and "UniFrac cache" in warned and "simulated data set" in warned
    assert warned.count("damaged") >= 3


def tmpfs_works(tmp_path) -> bool:
    probe = tmp_path / "probe_mount"
    probe.mkdir()
    try:
        run = subprocess.run(
            [*on_tmpfs(1 << 20, probe, tmp_path / "probe_copy"), "true"], capture_output=True
        )
    except FileNotFoundError:  # no unshare
        return False
    return run.returncode == 0


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_a_full_disk_during_a_checkpoint_says_so_in_one_line_and_keeps_the_last_good_one(launch, tmp_path):
    if not tmpfs_works(tmp_path):
        pytest.skip("no tmpfs can be mounted here (unshare or mount refused): a full disk needs one")
    overrides = ["trainer.checkpoint_every=1", "trainer.keep_last=1"]
    sizing, sized = launch(*overrides, "trainer.max_steps=1", name="sized")  # one checkpoint's size
    assert sizing.returncode == 0, sizing.stderr[-3000:]
    one = next((sized / "checkpoints").iterdir()).stat().st_size
    run_dir, kept = tmp_path / "full", tmp_path / "kept"
    run_dir.mkdir()
    # room for the run's own files and one checkpoint, not for the next one beside it
    tmpfs = on_tmpfs(one * 3 // 2 + 300_000, run_dir, kept)
    run, _ = launch(*overrides, "trainer.max_steps=3", name="full", launcher=[*tmpfs, *PYTHON])
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no space left on the file system of {run_dir}"), run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "step_00000001.pt, is kept" in last
    assert read_summary(kept)["status"] == "failed", run.stderr[-3000:]
    assert [p.name for p in (kept / "checkpoints").iterdir()] == ["step_00000001.pt"]  # no partial file
    assert not [p for p in kept.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow  # two launches
def test_a_full_disk_while_the_sample_store_is_built_is_one_line_and_leaves_no_partial_file(launch, tmp_path):
    if not tmpfs_works(tmp_path):
        pytest.skip("no tmpfs can be mounted here (unshare or mount refused): a full disk needs one")
    sized_cache, cache, kept = tmp_path / "sized_cache", tmp_path / "cache", tmp_path / "kept"
    # the CPU calibration's cache elsewhere: a calibration under load is not written (a CI run's full run
    # wrote one page less than its sizing run, and the index fitted)
    calibration = f"metrics.peak_flops_cache={tmp_path / 'peak_flops.json'}"
    sizing, _ = launch(f"data.cache_dir={sized_cache}", calibration, "trainer.max_steps=1", name="sized")
    assert sizing.returncode == 0, sizing.stderr[-3000:]
    (index,) = (sized_cache / "samples").glob("*/index.npz")  # the store's largest file, written last

    def pages(path: Path) -> int:  # a tmpfs holds whole pages
        return -(-path.stat().st_size // 4096) * 4096

    # room for the simulated data set and the store's raw files, and for the index less one page
    written = [p for p in sized_cache.rglob("*") if p.is_file() and p != index]
    assert {p.relative_to(sized_cache).parts[0] for p in written} == {"simulated", "samples"}
    cache.mkdir()
    tmpfs = on_tmpfs(sum(map(pages, written)) + pages(index) - 4096, cache, kept)
    run, run_dir = launch(f"data.cache_dir={cache}", calibration, name="full", launcher=[*tmpfs, *PYTHON])
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: no space left on the file system of {cache / 'samples'} to write the sample"
    )
    assert "Traceback" not in run.stderr and read_summary(run_dir)["status"] == "failed"
    assert (kept / "simulated").is_dir() and not list((kept / "samples").iterdir())  # no partial store


@pytest.mark.slow  # about a minute: two ranks, a 10 s timeout, a resumed launch
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_it_resumes(launch):
    """2 ranks, one stopped with SIGSTOP (a hung node): the other ends within distributed.timeout_s, in one
    line; a new launch goes on from the last checkpoint."""
    import psutil

    settings = [*LONG, "trainer.checkpoint_every=2", "trainer.batch_size=8", "distributed=ddp"]
    settings += ["distributed.timeout_s=10", "data.val_fraction=0.31"]
    proc, run_dir = launch(*settings, launcher=torchrun(2), wait=False)
    wait_for_steps(proc, run_dir, 3)
    ranks = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "aamperf.train" in " ".join(p.cmdline())
    ]
    stopped = next(p for p in ranks if p.environ().get("RANK") == "1")
    stopped.suspend()  # SIGSTOP
    began = time.time()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        for p in ranks:
            if p.is_running():
                p.kill()
    assert time.time() - began < 10 + 60, "the job outlived the timeout by more than a minute"
    assert proc.returncode != 0
    assert "another rank stopped, died or did not answer within distributed.timeout_s=10" in err
    done = read_summary(run_dir)
    assert done["status"] == "aborted"
    resumed, _ = launch(*settings, "trainer.max_steps=12", launcher=torchrun(2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_summary(run_dir)["resumed_from_step"] >= 2


@pytest.mark.slow  # about 10 s: a sweep of two jobs, stopped in the second (the default suite is at 8 min)
def test_a_signal_to_a_sweep_says_in_its_line_how_to_report_the_jobs_before_it(launch):
    proc, sweep_dir = launch("seed=0,1", "trainer.max_steps=40", name="sweep", multirun=True, wait=False)
    deadline = time.time() + 240
    while not any(d.name.startswith("1_") and (d / "metrics.jsonl").exists() for d in sweep_dir.glob("*")):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "the sweep's second job logged no steps"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("interrupted: SIGINT received") and "Traceback" not in err
    assert line.endswith(f"sweep job #1: python -m aamperf.compare {sweep_dir} reports those before it")
    compare = [*PYTHON, "-m", "aamperf.compare", str(sweep_dir)]
    report = subprocess.run(compare, capture_output=True, text=True)
    assert report.returncode == 0 and (sweep_dir / "comparison.md").exists(), report.stderr[-3000:]
