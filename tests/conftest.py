"""Fixtures: the real Hydra config, composed with tiny CPU settings; a run launched as a user launches
it; and the run record read back as `python -m aamperf.compare` reads it."""

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aamperf.allocator import ALLOCATORS, find
from aamperf.config import register_configs
from aamperf.report.runs import Run
from aamperf.run import train
from aamperf.train import cli
from aamperf.weights import MODEL_FILE

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
TESTS = REPO / "tests"  # tests/plugin_model.py: the model._target_ / loss._target_ of some tests

# Small enough for a 3-step run in a few seconds, big enough for every code path.
TINY = [
    "model=aam_tiny",
    "device=cpu",
    "data.n_samples=40",
    "data.n_asvs=64",
    "data.mean_richness=20",
    "data.depth=600",
    "data.rarefy_depth=500",
    "trainer.batch_size=4",
    "trainer.max_steps=3",
    "trainer.warmup_steps=1",
    "trainer.val_every=2",
    "trainer.val_batches=1",
    "trainer.progress=false",
    "metrics.log_every=1",
    "metrics.skip_steps=1",
    "metrics.rf_baseline=false",  # the random forest after a target run: its own tests turn it on
    # the CPU's peak given, not calibrated: the calibration (a second a run on 2 cores, ten at an emulated
    # bf16) is its own tests' subject; a test of it, or of an `auto` that reads the peak, sets it null
    "metrics.peak_flops=1e13",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` (tests/gpu/, `pytest -m gpu`) are skipped, with the reason, without CUDA."""
    if torch.cuda.is_available():
        return
    why = pytest.mark.skip(
        reason=f"needs a CUDA GPU: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) "
        "sees none here; experiments/gpu/run.sh runs these on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(why)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the whole session: the tiny data set is simulated once."""
    return tmp_path_factory.mktemp("aamperf-cache")


# a stage-2 (fine-tuning) test's stage 1: tests/test_finetune.py, test_cached_embeddings.py
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A completed pretraining run (UniFrac + masked nucleotides, no target): its directory."""
    register_configs()
    run_dir = tmp_path_factory.mktemp("pretrain")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*TINY, f"data.cache_dir={cache_dir}", "data.target=null"])
    assert train(cfg, run_dir)["status"] == "completed"
    return run_dir


def weights_of(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a completed run keeps (its model.pt)."""
    return torch.load(run_dir / MODEL_FILE, weights_only=True)["weights"]


@pytest.fixture
def make_cfg(cache_dir: Path) -> Iterator[Callable[..., DictConfig]]:
    """compose("config") with the tiny settings, then the test's own overrides (which win)."""
    register_configs()

    def make(*overrides: str, hydra: bool = False) -> DictConfig:
        """hydra=True: with the `hydra` node, set as the current HydraConfig (for ${hydra:...})."""
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(
                "config",
                overrides=[*TINY, f"data.cache_dir={cache_dir}", *overrides],
                return_hydra_config=hydra,
            )
        if hydra:
            HydraConfig.instance().set_config(cfg)
        return cfg

    yield make
    HydraConfig.instance().cfg = None  # no HydraConfig left behind for the next test


# ---- a run launched as a user launches it ------------------------------------------------------------

PYTHON = (sys.executable,)
# Set by a torchrun that started pytest: a run launched here is not one of its ranks.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")


def free_port() -> int:
    """A local TCP port free now, for a process group of ranks spawned by a test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int, *options: str, module: str = "torch.distributed.run") -> list[str]:
    """The launcher of `ranks` local processes, for launch(launcher=...): torchrun, or aamperf.launch."""
    return [sys.executable, "-m", module, *options, "--standalone", f"--nproc_per_node={ranks}"]


class Launched(NamedTuple):
    proc: subprocess.CompletedProcess | subprocess.Popen  # finished; still running with wait=False
    run_dir: Path | None  # hydra.run.dir, or hydra.sweep.dir of a multirun


def launch_run(
    *args: str,
    cache_dir: Path,
    run_dir: Path | None,
    module: str = "aamperf.train",
    launcher: Sequence[str] = PYTHON,
    multirun: bool = False,
    tiny: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
    wait: bool = True,
) -> Launched:
    """`<launcher> -m <module> [-m] <TINY> data.cache_dir=... <args> hydra.run.dir=<run_dir>`, in
    `env` (default: this process's) without a torchrun rank, with this checkout and tests/ importable.
    wait=True: run it to the end (or `timeout`), output captured as text; wait=False: start it, stderr
    piped (text), stdout dropped. run_dir=None: Hydra's default directory under `cwd`."""
    cmd = [*launcher, "-m", module, *(["-m"] if multirun else [])]
    cmd += [*TINY, f"data.cache_dir={cache_dir}"] if tiny else []
    cmd += args
    if run_dir is not None:
        cmd.append(f"hydra.{'sweep' if multirun else 'run'}.dir={run_dir}")
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in RANK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(TESTS), env.get("PYTHONPATH")]))
    if wait:
        env["PYTHONFAULTHANDLER"] = "1"  # aborted past its timeout, each Python process prints its stacks
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = abort_with_stacks(proc)
            pytest.fail(f"{shlex.join(cmd)} ran past its {timeout} s; stacks at the abort:\n{err[-8000:]}")
        return Launched(subprocess.CompletedProcess(cmd, proc.returncode, out, err), run_dir)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )
    return Launched(proc, run_dir)


def abort_with_stacks(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT to the Python processes of a launch that hangs, its children first and one at a time (their
    stacks would interleave): with faulthandler on, each writes every thread's stack to the stderr they
    share. Then the launch's output, killed if still alive."""
    import psutil

    def ended(process: psutil.Process) -> bool:
        with contextlib.suppress(psutil.NoSuchProcess):
            return process.status() == psutil.STATUS_ZOMBIE
        return True

    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        for process in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.Error):
                if "python" in process.name():  # not W&B's service: Go dumps every goroutine
                    process.send_signal(signal.SIGABRT)
                    deadline = time.monotonic() + 10
                    while not ended(process) and time.monotonic() < deadline:
                        time.sleep(0.02)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


@pytest.fixture
def launch(tmp_path: Path, cache_dir: Path) -> Callable[..., Launched]:
    """launch(*overrides, name="run", **options): launch_run in the directory tmp_path / name (Hydra's
    default with name=None), with the session's data cache."""

    def launch(*overrides: str, name: str | None = "run", **options) -> Launched:
        return launch_run(
            *overrides, cache_dir=cache_dir, run_dir=None if name is None else tmp_path / name, **options
        )

    return launch


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """Hydra sets up the root logger for each run (console, train.log); the tests after this one
    must not log to a captured stream that is closed by then."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def invoke(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture, *args: str, module: str = "aamperf.train"
) -> tuple[int, str, str]:
    """`python -m <module> *args` (aamperf.train or aamperf.predict) in this process (0.3 s; a new process
    spends 1.5 s importing torch): (exit code, stdout, stderr), its output alone (the test's before it
    dropped), without a torchrun rank's variables (as launch_run's). Never restarted with an allocator
    preloaded: that would replace pytest's process (this_command() is false here, which already keeps it
    from happening; a restart that came anyway fails the test)."""
    assert module in ("aamperf.train", "aamperf.predict"), module
    if module == "aamperf.predict":
        from aamperf.predict.__main__ import cli as entry
    else:
        entry = cli

    def restart(name: str, args: list[str]) -> None:
        raise AssertionError(f"{module} would start again with {name} preloaded, replacing pytest: {args}")

    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("aamperf.allocator._start_again", restart)
    monkeypatch.setattr(sys, "argv", [module, *args])
    capfd.readouterr()
    try:
        with root_logger_kept():
            entry()
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        HydraConfig.instance().cfg = None  # no run's HydraConfig left behind for the next test
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture
def launch_here(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> Callable[..., Launched]:
    """launch(*overrides, name="run", tiny=True, module="aamperf.train"), the same arguments, run in this
    process by invoke(): for a run refused before it trains (exit code 2, one `error:` line) or a short one
    whose printout is checked. Not for what only a process of its own shows: a signal, its environment, an
    allocator's restart. aamperf.predict runs with allocator=null (its default, tcmalloc, restarts the
    process where installed) unless the test names one that is not installed here."""

    def launch(
        *overrides: str, name: str | None = "run", tiny: bool = True, module: str = "aamperf.train"
    ) -> Launched:
        run_dir = None if name is None else tmp_path / name
        args = [*([*TINY, f"data.cache_dir={cache_dir}"] if tiny else []), *overrides]
        if module == "aamperf.predict":
            given = [a.split("=", 1)[1] for a in overrides if a.startswith("allocator=")]
            if any(v in ALLOCATORS and find(v) for v in given):
                pytest.fail(
                    f"allocator={given[-1]} is installed here: it needs a process of its own (launch)"
                )
            args += [] if given else ["allocator=null"]
        args += [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
        code, out, err = invoke(monkeypatch, capfd, *args, module=module)
        return Launched(subprocess.CompletedProcess([module, *args], code, out, err), run_dir)

    return launch


def on_tmpfs(size: int, mount: Path, copy: Path) -> list[str]:
    """A launcher prefix: the command after it runs in a private mount namespace (as root, or in a user
    namespace) where `mount` is a tmpfs of `size` bytes; what it left there is copied to `copy` (the
    tmpfs goes with the namespace)."""
    mount, copy = shlex.quote(str(mount)), shlex.quote(str(copy))
    script = f'mount -t tmpfs -o size={size} tmpfs {mount} || exit 99; "$@"; rc=$?; '
    script += f"mkdir -p {copy} && cp -a {mount}/. {copy}/; exit $rc"
    return ["unshare", "-rm" if os.geteuid() else "-m", "sh", "-c", script, "sh"]


def skip_where_others_busy(limit: float = 0.2, watch_s: float = 0.5) -> None:
    """Skip, with the reason, a test whose timing or load reading another program on the cores would
    decide: their load watched for `watch_s` first (the test's own process and children left out)."""
    from aamperf.metrics.flops import LoadWatch

    watch = LoadWatch()
    time.sleep(watch_s)
    if (others := watch.stop()["other_cores_busy"]) > limit:
        pytest.skip(f"other processes kept {others:.2f} cores busy before the test: it needs a quiet machine")


@contextlib.contextmanager
def holding(code: str) -> Iterator[None]:
    """Another program beside the test, holding the memory `code` takes (RAM or a GPU's), until the block
    ends."""
    script = f"import time\n{code}\nprint('ready', flush=True)\ntime.sleep(300)"
    hog = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        yield
    finally:
        hog.kill()
        hog.wait()


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int) -> None:
    """Until the run has logged `n` whole lines: it is in its training loop."""
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "the run logged no steps"
        time.sleep(0.01)


# ---- the run record, read back ------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's lines, as the report reads them (aamperf/report/runs.py); the file must exist."""
    assert (Path(run_dir) / "metrics.jsonl").is_file(), f"{run_dir} has no metrics.jsonl"
    return Run(Path(run_dir), [], {}).metrics


def read_summary(run_dir: Path) -> dict:
    """summary.json of a run directory."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


def losses(run_dir: Path) -> list[tuple]:
    """(step, loss, val_loss) of each metrics line: what a resumed run must repeat exactly."""
    return [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run_dir)]


def read_wandb(run: Path, *options: str) -> list[dict]:
    """The JSON records of one offline W&B run (its directory), read back by W&B's own tool: one a line,
    or with --summary one object over several lines."""
    wandb_cli = shutil.which("wandb") or str(Path(sys.executable).with_name("wandb"))
    cmd = [wandb_cli, "leet", "inspect", "--json", *options, str(run)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    decoder, records, at = json.JSONDecoder(), [], 0
    while at < len(out):  # each line that starts an object; any other line is not a record
        if out.startswith("{", at):
            record, at = decoder.raw_decode(out, at)
            records.append(record)
        at = out.find("\n", at) + 1 or len(out)
    return records
