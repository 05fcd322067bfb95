"""system.allocator: the process's malloc, gperftools' tcmalloc in place of the C library's.

A training step frees and allocates activations of tens of MiB whose sizes change with the batch.
glibc's malloc either gives each large block back to the OS when it is freed, so every step faults its
pages in again, or (system.reuse_freed_memory) keeps them in one heap whose holes stay resident: ultra's
peak RSS at the memory study's batch was 2.40-2.52 GiB with glibc's reuse, 1.68-1.71 GiB with tcmalloc
(its freed spans kept, TCMALLOC_RELEASE_RATE=0), at the same step time (2.99-3.26 s against 2.89-3.39 s;
2-core AMD EPYC, AVX2, glibc 2.36, gperftools 2.10; experiments/memory/).

malloc is fixed when a process starts (LD_PRELOAD). Where a run's config asks for an allocator this
process does not have, `python -m aamperf.train` starts itself again with the library preloaded (the
same process id, arguments and run directory: its start-up counts in the run's time). A plain run does
so before Hydra and torch load (headline shapes, first step 14.3 and 11.6 s against 12.2 and 14.4 s on
glibc's malloc); one with a flag from its job, after them (about 4.5 s more). A sweep's jobs share one
process, so there it stays as it is and the record says how to have it. `python -m aamperf.predict` does
the same with its `allocator` key (`PREDICT`).
"""

import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from aamperf.errors import this_command

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Allocator:
    libraries: tuple[str, ...]  # sonames, the first found is preloaded
    settings: dict[str, str] = field(default_factory=dict)  # its environment (a user's own values win)
    install: str = ""


ALLOCATORS = {
    "tcmalloc": Allocator(
        libraries=("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
        # keep freed spans for the next step (no page faults), and no report for a block over 1 GiB
        settings={"TCMALLOC_RELEASE_RATE": "0", "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)},
        install="apt install libtcmalloc-minimal4 (Debian, Ubuntu) or conda install gperftools",
    ),
}
RESTARTED = "AAMPERF_ALLOCATOR_RESTARTED"  # set in the restarted process: it never restarts twice


@dataclass(frozen=True)
class Command:
    """A command that can start itself again with an allocator: its module, console script, config
    and the key of that config naming the allocator."""

    module: str
    script: str
    config_name: str
    key: str

    def compose_allocator(self, args: list[str]) -> str | None:
        """The allocator the config of `args` names (the composition alone: 0.4 s, no torch; the
        config's schema registered by the command's module first)."""
        from hydra import compose, initialize_config_dir

        from aamperf.config import CONF_DIR

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return OmegaConf.select(compose(config_name=self.config_name, overrides=args), self.key)


TRAIN = Command("aamperf.train", "aamperf-train", "config", "system.allocator")
PREDICT = Command("aamperf.predict", "aamperf-predict", "predict", "allocator")


def check_allocator(name: str | None, command: Command = TRAIN) -> list[str]:
    if name is not None and name not in ALLOCATORS:
        names = ", ".join(ALLOCATORS)
        return [f"{command.key}={name} is not one of {names}, or null (the process's own malloc)"]
    return []


def in_process() -> str | None:
    """The allocator of ALLOCATORS this process runs with (preloaded), or None (the C library's)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((name for name, a in ALLOCATORS.items() if any(lib in maps for lib in a.libraries)), None)


def find(name: str) -> str | None:
    """Where `name`'s library is: the active environment's lib/ (conda), else its soname where the
    dynamic linker's cache has it; None where it is not installed."""
    allocator = ALLOCATORS[name]
    for prefix in dict.fromkeys(p for p in (os.environ.get("CONDA_PREFIX"), sys.prefix) if p):
        for library in allocator.libraries:
            if (path := Path(prefix) / "lib" / library).exists():
                return str(path)
    for library in allocator.libraries:
        stem = library.removeprefix("lib").split(".so")[0]
        if ctypes.util.find_library(stem) == library:
            return library
    return None


def why_not_restarted(name: str, in_sweep: bool, command: Command = TRAIN) -> str | None:
    """Why this process cannot be started again with `name` preloaded, or None where it can."""
    allocator = ALLOCATORS[name]
    how = f"LD_PRELOAD={allocator.libraries[0]} python -m {command.module} ..."
    if os.environ.get(RESTARTED) == name:
        return f"started again with {os.environ.get('LD_PRELOAD')} preloaded, which the process does not have"
    if find(name) is None:
        return f"{' or '.join(allocator.libraries)} is not installed here ({allocator.install})"
    if in_sweep:
        return (
            "a sweep's jobs share one process, whose malloc was chosen when it started: start the sweep as "
            f"{how} -m, or run a process per job (experiments/run_paired.sh)"
        )
    if not this_command(command.module, command.script):
        return (
            f"this process is not a python -m {command.module} command, which could start again with it "
            f"({how})"
        )
    return None


def restart_before_hydra(command: Command = TRAIN) -> None:
    """For a plain run (`python -m aamperf.train key=value ...`, no flags), before Hydra starts and
    torch is imported: compose its config (0.4 s) and, where it asks for an allocator this process does
    not have, start again with it preloaded. Anything else (a sweep, a flag, a config Hydra refuses) is
    left to `restart_with_allocator` in the job, or to Hydra's own report."""
    args = sys.argv[1:]
    if os.environ.get(RESTARTED) or any(a.startswith("-") for a in args):
        return
    if not this_command(command.module, command.script) or all(find(name) is None for name in ALLOCATORS):
        return  # nothing to preload: no composing
    try:
        name = command.compose_allocator(args)
    except Exception:  # noqa: BLE001 - bad input: Hydra's own run reports it, with its fix
        return
    if name in ALLOCATORS and in_process() != name and not why_not_restarted(name, False, command):
        _start_again(name, args)  # nothing is written yet: the run's directory is the new process's


def restart_with_allocator(name: str | None, run_dir: Path, command: Command = TRAIN) -> None:
    """Start this command again with allocator `name`'s library preloaded, in the same run directory,
    where the config asks for one this process does not have and it can be; else return (the run's
    record says why)."""
    if name not in ALLOCATORS or in_process() == name or why_not_restarted(name, sweeping(), command):
        return
    quoted = "'" + str(run_dir).replace("'", "\\'") + "'"  # Hydra's quoted string: any path
    # the same arguments, the run directory fixed (a dated one would be a new directory), among the other
    # overrides: Hydra takes them as one run of arguments between its flags
    args = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    last = max((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), default=-1)
    args.insert(last + 1, f"hydra.run.dir={quoted}")
    if HydraConfig.initialized():
        os.chdir(HydraConfig.get().runtime.cwd)  # where the command was started (hydra.job.chdir moves it)
    _start_again(name, args)


def _start_again(name: str, args: list[str]) -> None:
    """Replace this process by the same command (its interpreter options, -X, -u, kept) with `args` and
    `name`'s library preloaded: the same process id, so its start counts in the run's time."""
    allocator, library = ALLOCATORS[name], find(name)
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD")) if p)
    env = {**allocator.settings, **os.environ, "LD_PRELOAD": preload, RESTARTED: name}
    command = sys.orig_argv[: len(sys.orig_argv) - len(sys.argv) + 1]  # python [options] -m aamperf.train
    log.info("system.allocator=%s: starting again with %s preloaded", name, library)
    logging.shutdown()  # a run's log file is appended to by the new process
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *command[1:], *args], env)


def sweeping() -> bool:
    """Whether this process runs the jobs of a Hydra sweep (-m)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
