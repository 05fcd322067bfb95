"""system.allocator: a run that asks for tcmalloc starts again with it preloaded, in its own directory;
where it cannot, its record says why and how."""

import json
import os
import subprocess
import sys

import pytest
from conftest import TINY

from aamperf.allocator import ALLOCATORS, Allocator, find, in_process, why_not_restarted
from aamperf.errors import this_command
from aamperf.phases.system import allocator_record

TCMALLOC = find("tcmalloc")
needs_tcmalloc = pytest.mark.skipif(
    TCMALLOC is None, reason=f"tcmalloc is not installed here ({ALLOCATORS['tcmalloc'].install})"
)


@needs_tcmalloc
@pytest.mark.parametrize(  # the restart from the job: 11-17 s, in the longer tests
    "flag", [None, pytest.param("--config-name=config", marks=pytest.mark.slow)]
)
def test_a_run_asking_for_tcmalloc_starts_again_with_it_in_the_same_directory(
    launch, tmp_path, cache_dir, flag
):
    """A plain run starts again before Hydra does (nothing written yet); one with a flag, which is not
    composed ahead, from its job, in the directory Hydra made for it."""
    flags = [flag] if flag else []  # first, as Hydra takes them: its overrides are one run of arguments
    overrides = [*TINY, f"data.cache_dir={cache_dir}", "system.allocator=tcmalloc", "trainer.max_steps=2"]
    proc, run_dir = launch(*flags, *overrides, tiny=False)
    assert proc.returncode == 0, proc.stderr
    phases = json.loads((run_dir / "summary.json").read_text())["phases"]
    assert phases["allocator"]["status"] == "applied", phases["allocator"]
    assert phases["allocator"]["name"] == "tcmalloc" and TCMALLOC in phases["allocator"]["preloaded"]
    assert phases["allocator"]["settings"]["TCMALLOC_RELEASE_RATE"] == "0"
    assert phases["malloc"]["reason"] == "malloc is tcmalloc here: glibc's thresholds do not apply"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no second (dated) run directory
    # from the job: said in the run's log, which the new process goes on writing
    assert (run_dir / "train.log").read_text().count("starting again with") == (1 if flag else 0)


def test_a_run_without_an_allocator_keeps_the_process_malloc():
    record = allocator_record(None)
    assert record["status"] == "skipped"
    assert record["reason"] == "system.allocator=null: malloc as the process has it (the C library's)"
    assert in_process() is None  # pytest was not started with a preloaded allocator


def test_a_process_that_is_not_the_train_command_is_never_started_again():
    assert not this_command()  # pytest: a restart would replace the tests' own process
    if TCMALLOC is not None:
        record = allocator_record("tcmalloc")
        assert record["status"] == "skipped"
        assert "is not a python -m aamperf.train command" in record["reason"]
        assert "LD_PRELOAD=libtcmalloc_minimal.so.4 python -m aamperf.train" in record["reason"]


def test_a_sweep_keeps_its_process_malloc_and_says_how_to_have_the_allocator():
    if TCMALLOC is None:
        pytest.skip(f"tcmalloc is not installed here ({ALLOCATORS['tcmalloc'].install})")
    why = why_not_restarted("tcmalloc", in_sweep=True)
    assert why.startswith("a sweep's jobs share one process")
    assert "LD_PRELOAD=libtcmalloc_minimal.so.4 python -m aamperf.train ... -m" in why


def test_a_missing_library_says_how_to_install_it(monkeypatch):
    missing = Allocator(libraries=("libno_such_malloc.so.9",), install="apt install no-such-malloc")
    monkeypatch.setitem(ALLOCATORS, "tcmalloc", missing)
    assert find("tcmalloc") is None
    record = allocator_record("tcmalloc")
    assert record["reason"] == (
        "system.allocator=tcmalloc: libno_such_malloc.so.9 is not installed here "
        "(apt install no-such-malloc): malloc as the process has it"
    )


def test_the_train_command_is_recognised_from_the_process_arguments(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["python", "-X", "dev", "-m", "aamperf.train", "optim=ultra"])
    monkeypatch.setattr(sys, "argv", ["/src/aamperf/train.py", "optim=ultra"])
    assert this_command()
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/aamperf-train", "optim=ultra"])
    monkeypatch.setattr(sys, "argv", ["/venv/bin/aamperf-train", "optim=ultra"])
    assert this_command()
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "pytest", "tests"])
    monkeypatch.setattr(sys, "argv", ["aamperf.train", "optim=ultra"])  # a test calling cli() in its process
    assert not this_command()
    # a profiler that runs the command in its own process: not the command's process to restart or end
    profiled = ["python", "-m", "cProfile", "-o", "p", "-m", "aamperf.train", "a=1"]
    monkeypatch.setattr(sys, "orig_argv", profiled)
    monkeypatch.setattr(sys, "argv", ["aamperf.train", "a=1"])  # as cProfile sets it
    assert not this_command()
    memray = ["/venv/bin/python", "/venv/bin/memray", "run", "-m", "aamperf.train"]
    monkeypatch.setattr(sys, "orig_argv", memray)
    monkeypatch.setattr(sys, "argv", ["/src/aamperf/train.py"])
    assert not this_command()
    torchrun = ["python", "-u", "-m", "aamperf.predict", "run=r"]  # a rank, as torchrun starts it
    monkeypatch.setattr(sys, "orig_argv", torchrun)
    monkeypatch.setattr(sys, "argv", ["/src/aamperf/predict/__main__.py", "run=r"])
    assert this_command("aamperf.predict", "aamperf-predict") and not this_command()


@needs_tcmalloc
def test_freed_memory_is_given_back_under_tcmalloc_too(tmp_path):
    """The batch-size finder and a sweep's next job start from what the process holds: with tcmalloc's
    freed spans kept (TCMALLOC_RELEASE_RATE=0), release_freed_memory hands them back."""
    script = (
        "import psutil, torch\n"
        "from aamperf.metrics.monitor import release_freed_memory\n"
        "rss_bytes = lambda: psutil.Process().memory_info().rss\n"
        "x = torch.ones(2**27)\n"  # 512 MiB, its pages touched
        "del x\n"
        "kept = rss_bytes()\n"
        "release_freed_memory()\n"
        "print(kept / 2**20, rss_bytes() / 2**20)\n"
    )
    env = {**os.environ, "LD_PRELOAD": TCMALLOC, **ALLOCATORS["tcmalloc"].settings}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    kept_mib, after_mib = map(float, out.stdout.split())
    assert kept_mib - after_mib > 400, out.stdout  # the 512 MiB were kept, then returned
