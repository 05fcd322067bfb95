"""The entry point as a user runs it: exit codes, one-line errors, the run directory."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launch_run, read_summary
from omegaconf import OmegaConf

from aamperf.config import CONF_DIR
from aamperf.predict.config import PredictConfig
from aamperf.train import PREDICTION_GROUPS


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_main_job_writes_run_directory(launch):
    proc, run_dir = launch("trainer.max_steps=5")
    assert proc.returncode == 0, proc.stderr
    assert f"run directory: {run_dir}" in proc.stdout
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 5
    assert (run_dir / ".hydra" / "config.yaml").exists()  # the resolved config beside the record


def test_bad_input_is_one_line_exit_2_and_writes_nothing(launch):
    proc, run_dir = launch("trainer.batch_size=1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: trainer.batch_size=1 must be >= 2")
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()  # refused before Hydra made the run directory


def test_missing_user_table_names_the_option(launch_here, tmp_path):
    proc, _ = launch_here(
        "data=biom",
        f"data.table={tmp_path / 'nope.biom'}",
        f"data.tree={tmp_path / 'nope.nwk'}",
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "data.table" in last and "nope.biom" in last


def test_a_run_of_warm_up_steps_only_says_why_it_has_no_speed(launch_here):
    proc, _ = launch_here("trainer.max_steps=1")  # TINY: metrics.skip_steps=1
    assert proc.returncode == 0, proc.stderr
    assert (
        "n/a: the 1 steps run were all warm-up (metrics.skip_steps=1); raise trainer.max_steps" in proc.stdout
    )


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_help_says_what_aamperf_is_its_groups_and_commands(launch):
    proc, _ = launch("--help", tiny=False, name=None)
    assert proc.returncode == 0 and proc.stdout.startswith("aamperf: PyTorch training made fast")
    assert "optim: advanced, baseline, basic, ultra" in proc.stdout  # the groups, from conf/
    assert "python -m aamperf.compare DIR" in proc.stdout and len(proc.stdout.splitlines()) < 60
    listing, _ = launch(module="aamperf", tiny=False, name=None)
    assert listing.returncode == 0 and "python -m aamperf.launch" in listing.stdout
    wrong, _ = launch("train", module="aamperf", tiny=False, name=None)  # python -m aamperf.train meant
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines()[-1].startswith("error: train: not a")
    predict, _ = launch("--help", module="aamperf.predict", tiny=False, name=None)
    assert predict.returncode == 0 and predict.stdout.startswith("aamperf.predict: a run's trained model")
    assert "inference=baseline|fast|int8" in predict.stdout and "powered by Hydra" not in predict.stdout
    assert "compile, quantize." in predict.stdout  # prediction's groups: its help lists them
    # its plain keys are PredictConfig's: `name.*` a section of keys, `name` one key
    listed = predict.stdout.split("Plain keys (key=value): ", 1)[1].split(". Every key", 1)[0]
    factories = {f.name: f.default_factory for f in dataclasses.fields(PredictConfig)}
    for key in (k.strip() for k in listed.split(",")):
        name = key.removesuffix(".*")
        assert name in factories, key
        section = factories[name] is not dataclasses.MISSING and dataclasses.is_dataclass(factories[name]())
        assert section == key.endswith(".*"), key


def config_groups(name: str) -> dict[str, str]:
    """The groups conf/<name>.yaml's defaults list takes, each with its options as Hydra lists them."""
    defaults = OmegaConf.load(CONF_DIR / f"{name}.yaml").defaults
    groups = [
        str(next(iter(entry))).removeprefix("optional ") for entry in defaults if not isinstance(entry, str)
    ]
    return {group: ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))) for group in groups}


def test_the_help_lists_trainings_groups_and_a_prediction_group_is_refused_in_one_line(launch, launch_here):
    proc, _ = launch("--help", tiny=False, name=None)
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.split("Config groups (group=option", 1)[1].split("Plain keys", 1)[0]
    listed = dict(line.split(": ", 1) for line in section.splitlines() if re.match(r"\w+: ", line))
    training = config_groups("config")
    assert listed == training  # each group training takes, with each of its options, and no other
    assert not {"inference", "quantize"} & listed.keys()
    assert (
        set(PREDICTION_GROUPS)
        == config_groups("predict").keys() - training.keys()
        == {"inference", "quantize"}
    )
    for override, group, value in (
        ("inference=fast", "inference", "fast"),
        ("+quantize=none", "quantize", "none"),
    ):
        refused, run_dir = launch_here(override)  # Hydra's own advice was `+inference=fast`
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines() == [
            f"error: {override}: {group} sets how a trained model predicts, not training: "
            f"python -m aamperf.predict run=<run dir> {group}={value}"
        ]
        assert not run_dir.exists()


def test_the_console_scripts_are_installed():
    import shutil

    bin_dir = str(Path(sys.executable).parent)  # the environment's scripts, whether activated or not
    for script in ("aamperf", "aamperf-train", "aamperf-compare", "aamperf-launch"):
        assert shutil.which(script, path=bin_dir), (
            f"{script}: pip install -e . installs it ([project.scripts])"
        )
    proc = subprocess.run(
        [shutil.which("aamperf-train", path=bin_dir), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "Config groups" in proc.stdout


def test_a_run_s_modules_leave_scipy_stats_and_scikit_learn_unimported():
    """Each costs a run's start ~0.6 s or more (2-core EPYC): only a classification's ROC AUC, a report's
    intervals and the forest baseline import them, as they run."""
    code = (
        "import sys, aamperf.train, aamperf.callbacks, aamperf.run, aamperf.trainer, aamperf.metrics.target\n"
        "print(' '.join(m for m in ('scipy.stats', 'sklearn') if m in sys.modules) or 'none')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["none"]


def test_an_option_is_found_among_the_config_files_and_not_elsewhere(tmp_path):
    """check_job's quick look (a file of a file source) before Hydra's listing of a group (0.6 s a run)."""
    from aamperf.callbacks import in_file_sources

    (tmp_path / "optim").mkdir()
    (tmp_path / "optim" / "mine.yaml").write_text("{}\n")
    sources = [{"path": "hydra.conf", "schema": "pkg"}, {"path": str(CONF_DIR), "schema": "file"}]
    config = OmegaConf.create({"hydra": {"runtime": {"config_sources": sources}}})
    assert in_file_sources(config, "optim", "ultra") and not in_file_sources(config, "optim", "mine")
    assert not in_file_sources(config, "optim", "ultr")
    config.hydra.runtime.config_sources.append({"path": str(tmp_path), "schema": "file"})
    assert in_file_sources(config, "optim", "mine")
    no_sources = OmegaConf.create({"hydra": {"runtime": {}}})  # as a sweep's jobs are composed
    assert not in_file_sources(no_sources, "optim", "ultra")


END_PROCESS = """
import atexit, concurrent.futures, sys, threading, time
from aamperf.errors import end_process

class Module:  # a module global's finalizer: run by the interpreter's teardown, which end_process skips
    def __del__(self):
        print("teardown", flush=True)

kept = Module()

def command():
    atexit.register(lambda: print("exit handler", end=""))  # its output unflushed
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)  # its idle worker: stopped at exit, not waited for
    pool.submit(time.sleep, 0).result()
    print("command", flush=True)
    sys.exit({code!r})

end_process(command, "ending", "ending")
"""


@pytest.mark.parametrize(("code", "returncode", "stderr"), [(3, 3, ""), (None, 0, ""), ("why", 1, "why\n")])
def test_a_command_ends_its_process_at_once_with_its_code_threads_and_exit_handlers(
    tmp_path, code, returncode, stderr
):
    """end_process: the command's exit code (None: 0; a message: printed, 1), its thread joined, an idle
    executor's worker stopped (joining it first hung a sweep), its exit handlers run and their output
    flushed; the interpreter's teardown left out (1.1 s with torch loaded).
    Run by another program in its process (a profiler, runpy here), the command returns as a call does."""
    (tmp_path / "ending.py").write_text(END_PROCESS.format(code=code))
    for how, teardown in (
        (["-m", "ending"], ""),
        (["-c", "import runpy; runpy.run_module('ending')"], "teardown\n"),
    ):
        proc = subprocess.run(
            [sys.executable, *how], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert (proc.returncode, proc.stderr) == (returncode, stderr)
        assert proc.stdout == "command\nthread done\nexit handler" + teardown


def test_the_report_command_loads_no_torch():
    """python -m aamperf.compare reads run directories: torch's import (1.5 s) is not its to pay."""
    code = "import sys, aamperf.compare; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


def test_a_launch_past_its_timeout_fails_with_the_stacks_of_its_processes(tmp_path):
    child = "import time\ndef waiting_child(): time.sleep(60)\nwaiting_child()"
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\n"
    parent += "def waiting_parent(): time.sleep(60)\nwaiting_parent()"
    hangs = [sys.executable, "-c", parent]  # the rest of launch_run's command line is its argv
    with pytest.raises(pytest.fail.Exception, match="ran past its 2 s; stacks at the abort") as failed:
        launch_run(cache_dir=tmp_path, run_dir=None, launcher=hangs, tiny=False, timeout=2)
    assert "in waiting_parent" in str(failed.value) and "in waiting_child" in str(failed.value)
