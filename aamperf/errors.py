"""User mistakes: the one exception type, and the one `error:` line (exit code 2) each one becomes;
runs that stop themselves (exit code 3)."""

import atexit
import contextlib
import dataclasses
import difflib
import errno
import json
import os
import re
import shutil
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from aamperf.config import CONF_DIR, Config

EXIT_BAD_INPUT = 2  # 0: done; 1: a bug, or a failed job of a sweep; 2: bad input; 3: aborted by a guard
EXIT_ABORTED = 3
LAUNCHER_SHOWS_LINES = "AAMPERF_LAUNCHER"  # set by `python -m aamperf.launch`: it shows the ranks' lines once


class UserError(Exception):
    """Bad input from the user: config, files or data. The entry point prints it and exits 2."""


class NoSpace(UserError):
    """A write failed for want of space (`no_space`): a cache may catch it and go on without its file."""


class RunAborted(Exception):
    """The run stopped itself to protect its state (non-finite steps, memory): status `aborted`, a
    checkpoint of the last good state, and a one-line message. The entry point exits 3."""

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result  # the trainer's FitResult up to the stop


FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk was full


def disk_full(exc: BaseException, path: Path) -> bool:
    """Did a write under `path` fail for want of space? ENOSPC / EDQUOT, or a writer that reports it in
    its own words (torch.save: "unexpected pos ...", "iostream error") on a file system now full. Ask
    before the partial file is removed."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(exc, RuntimeError | OSError):
        return False
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free < FULL_BYTES
    except OSError:
        return False


def no_space(path: Path, what: str, fix: str) -> NoSpace:
    return NoSpace(f"no space left on the file system of {path} to write {what}; {fix}")


def one_line(message: object) -> str:
    return " ".join(str(message).split())


def error_line(message: object) -> str:
    return "error: " + one_line(message)


def exit_with(line: str, code: int) -> NoReturn:
    """End the process with its one line on stderr. Under torchrun the line also goes to the rank's
    error file, where torchrun's report reads it, and `python -m aamperf.launch` shows an `error:` or
    `aborted:` line once for all ranks (the ranks then leave stderr to it)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    written = False
    if error_file:
        try:  # the format torchrun's ProcessFailure reads: the message, and when (seconds)
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": str(int(time.time()))}))
            written = True
        except OSError:
            pass  # a full disk: stderr still has the line
    shown_by_launcher = code in (EXIT_BAD_INPUT, EXIT_ABORTED) and os.environ.get(LAUNCHER_SHOWS_LINES)
    if not (written and shown_by_launcher):  # an `interrupted:` line: each rank says where it stopped
        print(line, file=sys.stderr)
    sys.exit(code)


def this_command(module: str = "aamperf.train", script: str = "aamperf-train") -> bool:
    """Whether this process is the command itself, `python [its options] -m <module> ...` or the
    `<script>` console script: not a program that runs it in its own process (a test calling cli(), a
    profiler as in `python -m cProfile -m aamperf.train`), whose process is not the command's to restart
    or to end."""
    orig, argv = sys.orig_argv, sys.argv
    n = len(orig) - len(argv) + 1  # the interpreter, its options, the program
    if n < 2 or orig[n:] != argv[1:]:
        return False
    head = orig[:n]
    if head[-2:] == ["-m", module]:
        options = head[1:-2]
    elif Path(head[-1]).name == script:
        options = head[1:-1]
    else:
        return False
    while options:  # the interpreter's own options alone: -X importtime, -W ..., -u, -O
        if options[0] in ("-X", "-W"):
            options = options[2:]
        elif options[0].startswith("-") and options[0] not in ("-m", "-c"):
            options = options[1:]
        else:
            return False
    return True


def end_process(command: Callable[[], None], module: str, script: str) -> None:
    """Run a command's entry point, then end the process at once with its exit code: its threads stopped
    and joined and its exit handlers run (logging's, W&B's, multiprocessing's for loader workers) as the
    interpreter's exit does, its streams flushed, then os._exit, which leaves out the interpreter's
    teardown of every module and torch's C++ destructors: 1.1 s of each command that has loaded torch and
    its compiler (2-core AMD EPYC, 2026-11-28), nothing aamperf needs (its files are closed as they are
    written). An exception other than SystemExit ends the process as Python would, traceback and all.
    Where the process is not the command's own (`this_command`: a profiler's, a test's), the command
    returns as any call does."""
    if not this_command(module, script):
        command()
        return
    try:
        command()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if not isinstance(code, int):  # as Python's own exit: None is 0, a message is printed and 1
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    # what the interpreter's own exit does first, in its order: threading's exit calls (which tell idle
    # executor workers to stop), its non-daemon threads joined, then the exit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_bad_input(message: object) -> NoReturn:
    exit_with(error_line(message), EXIT_BAD_INPUT)


def aborted_line(exc: RunAborted) -> str:
    return "aborted: " + one_line(exc)


def exit_aborted(exc: RunAborted) -> NoReturn:
    exit_with(aborted_line(exc), EXIT_ABORTED)


# Names changed so that each says what it sets (one meaning per name); the old ones are refused with the new.
RENAMED_OPTIONS = {
    ("memory", "checkpointing"): "full",  # it recomputes every layer; memory=selective every k-th
    ("optimizer", "adamw"): "adamw_for_loop",  # torch's AdamW one parameter at a time
}
RENAMED_KEYS = {
    # recomputation of every k-th layer, apart from trainer.checkpoint_every (steps between saves)
    "memory.checkpoint_every": "memory.recompute_every",
}


# the original AAM's names for a setting aamperf calls otherwise (docs/from-the-original.md)
ORIGINAL_NAMES = {
    ("trainer.lr_schedule", "cosine"): (
        "trainer.lr_schedule=warmup_cosine trainer.warmup_steps=0 trainer.min_lr_ratio=0"
    ),
    ("data.target_transform", "log-zscore"): "data.target_transform=log1p_zscore",
    ("data.target_transform", "log-minmax"): "data.target_transform=log1p_minmax",
    ("data.target_transform", "zscore-category"): (
        "data.target_transform=zscore_category data.normalize_by=[<column>,...]"
    ),
    ("data.unifrac_metric", "weighted"): "data.unifrac_metric=weighted_normalized",
}


def no_such_option(group: str, option: str, options: list[str]) -> str:
    if (group, option) in RENAMED_OPTIONS:
        return f"{group}={option} is now {group}={RENAMED_OPTIONS[group, option]} (the same setting, renamed)"
    return f"{group}={option}: no such option; choose one of {', '.join(options)} (conf/{group}/)"


# Hydra plugins behind an extra of pyproject.toml: the config each brings, and what installs it
PLUGIN_CONFIGS = {
    "hydra/sweeper/optuna": ("hparams_search=fastest", "search", "hydra-optuna-sweeper"),
    "hydra/launcher/submitit_slurm": ("hydra/launcher=slurm", "slurm", "hydra-submitit-launcher"),
    "hydra/launcher/submitit_local": ("hydra/launcher=submitit_local", "slurm", "hydra-submitit-launcher"),
}


def hydra_error_message(exc: CompactHydraException) -> str:
    """What Hydra reports in several lines for a config mistake, as one line that names the fix."""
    cause = exc.__cause__
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file in PLUGIN_CONFIGS:
        what, extra, package = PLUGIN_CONFIGS[exc.missing_cfg_file]
        return f"{what} needs the {package} package: pip install 'aamperf[{extra}]' (or {package})"
    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return no_such_option(group, option, list(exc.options))
    if isinstance(exc, OverrideParseException):
        lines = exc.message.splitlines()  # ["Error parsing override ..."], the parser's words, "See <docs>"
        reason = [line for line in lines if not line.startswith(("Error parsing override", "See https://"))]
        return (
            f"cannot parse the override {exc.override!r} ({' '.join(reason)}); write key=value, a value that "
            f"holds = or spaces in quotes ('key=\"a=b\"'), see "
            "https://hydra.cc/docs/advanced/override_grammar/basic/"
        )
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and cause.full_key:
        return unknown_key_message(cause.full_key, list(cause.parent_node or []))
    if isinstance(cause, ValidationError) and cause.full_key:
        choice = choice_type(cause.full_key)
        if choice is not None:
            return not_a_choice(cause.full_key, cause.value, choice)
        return f"{cause.full_key}={cause.value}: {expected_type(cause)}{str(cause.msg).splitlines()[0]}"
    swept = re.fullmatch(r"Sweeping over Hydra's configuration is not supported : '(.*)'", str(exc))
    if swept:  # `-m hydra.run.dir=a,b`: Hydra sweeps jobs, not its own settings
        return (
            f"{swept[1]}: a multirun sweeps the job's settings, not Hydra's own (hydra.*); give it one value "
            "(a multirun's directories: hydra.sweep.dir=... hydra.sweep.subdir=...)"
        )
    return str(exc)  # Hydra's own words name the fix (e.g. "Either remove + prefix: ...")


def unknown_key_message(full_key: str, siblings: list[str]) -> str:
    """`trainer.batchsize` -> the close match among the keys at `trainer`, or those keys."""
    if full_key in RENAMED_KEYS:
        return f"{full_key} is now {RENAMED_KEYS[full_key]} (the same setting, renamed)"
    path, _, key = full_key.rpartition(".")
    prefix = f"{path}." if path else ""
    close = difflib.get_close_matches(key, siblings, n=1)
    hint = (
        f"did you mean {prefix}{close[0]}?"
        if close
        else f"the keys at {path or 'the top'}: {', '.join(siblings)}"
    )
    if full_key.split(".")[0] in ("model", "loss"):  # open nodes: their keys are the _target_'s arguments
        hint += f" (+{full_key}=<value> passes a new argument)"
    return f"{full_key} is not a config key; {hint}"


def choice_type(full_key: str) -> type[Enum] | None:
    """The enum the Config schema gives `full_key` (its elements' for `key[i]`), or None."""
    annotation: Any = Config
    for name in full_key.split("."):
        name, _, index = name.partition("[")
        if not dataclasses.is_dataclass(annotation):
            return None  # within an open node (model, loss)
        annotation = {f.name: f.type for f in dataclasses.fields(annotation)}.get(name)
        if index:
            annotation = next(iter(typing.get_args(annotation)), None)
    optional = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(optional) == 1 and type(None) in typing.get_args(annotation):  # `Enum | None`: null allowed too
        annotation = optional[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, Enum) else None


def not_a_choice(full_key: str, value: object, choice: type[Enum]) -> str:
    """`compile.mode=fastest` -> its choices, and the options of conf/compile/ that set compile.mode."""
    key = full_key.partition("[")[0]
    if (key, str(value)) in ORIGINAL_NAMES:
        return f"{key}={value} is the original AAM's name; here it is {ORIGINAL_NAMES[key, str(value)]}"
    group, _, inner = key.partition(".")
    options = [
        p.stem
        for p in sorted((CONF_DIR / group).glob("*.yaml"))
        if OmegaConf.select(OmegaConf.load(p), inner) is not None
    ]
    if "[" in full_key:  # an element of a list
        shown, setting = f"{key}: {value}", f"{key}=[<some of them>]"
    else:
        shown, setting = f"{key}={value}", f"{key}=<one of them>"
    by_option = f", or {group}=<option> of conf/{group}/: {', '.join(options)}" if options else ""
    return f"{shown} is not one of {', '.join(choice)}; set {setting}{by_option}"


def expected_type(cause: ValidationError) -> str:
    """'expected int: ' from the schema dataclass that holds the key, or '' for an open node."""
    if not dataclasses.is_dataclass(cause.object_type):
        return ""
    annotation = {f.name: f.type for f in dataclasses.fields(cause.object_type)}.get(cause.key)
    if annotation is None:
        return ""
    return f"expected {annotation.__name__ if isinstance(annotation, type) else annotation}: "


OURS = "AAMPERF_SET_HYDRA_FULL_ERROR"  # set while HYDRA_FULL_ERROR=1 is aamperf's, not the user's


def hydra_reports_wanted() -> bool:
    """Did the user ask for Hydra's own full reports of its config errors (HYDRA_FULL_ERROR=1)?"""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and OURS not in os.environ


@contextmanager
def hydra_errors_raised() -> Iterator[bool]:
    """Within: Hydra raises its config errors (HYDRA_FULL_ERROR=1) instead of printing them, so the
    entry point can put them in one line. Yields whether the user asked for Hydra's own full reports:
    their HYDRA_FULL_ERROR=1, not the one a parent aamperf (a search's reference run) passed on."""
    users = hydra_reports_wanted()
    os.environ["HYDRA_FULL_ERROR"] = os.environ[OURS] = "1"
    try:
        yield users
    finally:
        del os.environ[OURS]
        if not users:
            del os.environ["HYDRA_FULL_ERROR"]


def refuse_pickle_rerun(argv: list[str]) -> None:
    """Hydra's `--experimental-rerun FILE` unpickles FILE, which runs whatever code it holds: refused
    before it is read (a run is repeated from its overrides, which are text)."""
    if any(arg == "--experimental-rerun" or arg.startswith("--experimental-rerun=") for arg in argv):
        raise UserError(
            "--experimental-rerun loads a pickle, which can run any code: aamperf does not read one; repeat "
            "a run with the overrides listed in its <run dir>/.hydra/overrides.yaml"
        )


@contextmanager
def bad_input_exits() -> Iterator[None]:
    """Within: a user mistake (UserError), or a config error of Hydra's, ends the process with its one
    `error:` line and exit code 2; HYDRA_FULL_ERROR=1 keeps Hydra's own reports."""
    with hydra_errors_raised() as hydra_reports:
        try:
            refuse_pickle_rerun(sys.argv[1:])
            yield
        except UserError as exc:
            exit_bad_input(exc)
        except CompactHydraException as exc:  # Hydra's class of errors it shows without a traceback
            if hydra_reports:
                raise
            exit_bad_input(hydra_error_message(exc))
