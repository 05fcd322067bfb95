"""Entry point: `python -m aamperf.train [overrides]` (Hydra composes conf/ into one run)."""

import errno
import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from aamperf.allocator import restart_before_hydra, restart_with_allocator
from aamperf.config import CONF_DIR, register_configs
from aamperf.errors import (
    RunAborted,
    UserError,
    aborted_line,
    bad_input_exits,
    end_process,
    error_line,
    exit_aborted,
    exit_bad_input,
    one_line,
)

register_configs()
log = logging.getLogger("aamperf.train")  # by its name: run as __main__ (python -m aamperf.train)
# conf/predict.yaml's groups that training's conf/config.yaml does not take (tests/test_cli.py checks)
PREDICTION_GROUPS = ("inference", "quantize")


def log_ending(line: str, exc: BaseException | None = None) -> None:
    """The line a run ends with (`error:`, `aborted:`, `interrupted:`; a bug's traceback), into its log
    file (train.log) beside its warnings; not to the console, whose stderr ends with it already."""
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, info)
    for handler in logging.getLogger().handlers:  # Hydra's job logging: the console's, and train.log's
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    restart_with_allocator(cfg.system.allocator, run_dir)  # returns where this process keeps its malloc
    # imported here, not at the top: cli()'s early restart of a plain run comes before torch loads (4.6 s)
    from aamperf.interrupts import Interrupts, RunInterrupted
    from aamperf.run import print_result, train
    from aamperf.search import objective

    try:
        with Interrupts() as interrupts:
            try:
                summary = train(cfg, run_dir, interrupts, sweep_job=in_sweep)
            finally:
                interrupts.hand_on()  # the summary is written: submitit's requeue, on its preemption signal
    except RunInterrupted as exc:
        if in_sweep:  # a signal stops the whole sweep, not one job: its report is left to be asked for
            report = f"python -m aamperf.compare {hydra_cfg.sweep.dir} reports those before it"
            exc = RunInterrupted(f"{exc}; sweep job #{hydra_cfg.job.num}: {report}", exc.result, exc.signum)
        log_ending(f"interrupted: {one_line(exc)}")
        raise exc from None
    except (UserError, RunAborted) as exc:  # bad input, or a guard stopped the run (state kept)
        line = aborted_line(exc) if isinstance(exc, RunAborted) else error_line(exc)
        log_ending(line)
        if not in_sweep:
            raise  # a failed job for Hydra's callbacks (aamperf/callbacks.py): one line, exit 2 or 3
        print(line, file=sys.stderr)
        return None  # the sweep goes on; summary.json holds the error and the report lists it
    except Exception as exc:
        log_ending(f"failed: {one_line(repr(exc))}", exc)  # a bug: its traceback in train.log too
        if in_sweep:  # a bug, not a user mistake: the traceback is shown, the other jobs still run
            traceback.print_exc()
            return None
        raise
    if summary.get("rank", 0) == 0:
        print_result(summary, run_dir)
    return objective(cfg, summary)  # what a sweeper maximizes: samples/s (at equal quality in a search)


def refuse_prediction_groups(args: list[str]) -> None:
    """`inference=fast` given to training: Hydra would advise `+inference=fast`, which is wrong (training
    has no such group); the command that takes it instead."""
    multirun = "-m " if any(arg in ("-m", "--multirun") for arg in args) else ""
    for arg in args:
        key, given, value = arg.partition("=")
        group = key.lstrip("+~").partition("@")[0]
        if given and not arg.startswith("-") and group in PREDICTION_GROUPS:
            raise UserError(
                f"{arg}: {group} sets how a trained model predicts, not training: "
                f"python -m aamperf.predict {multirun}run=<run dir> {group}={value}"
            )


def cli() -> None:
    """main() with every user mistake, Hydra's config errors included, as one `error:` line and exit
    code 2; a run a guard stopped as one `aborted:` line and exit code 3; a run a signal stopped as one
    `interrupted:` line and exit code 128 + the signal (143 for SIGTERM, 130 for SIGINT); a bug keeps its
    traceback and exit code 1. HYDRA_FULL_ERROR=1 keeps Hydra's own reports."""
    logging.raiseExceptions = False  # a log file on a full disk: no "--- Logging error ---" tracebacks
    restart_before_hydra()  # a plain run whose config preloads an allocator: before torch is imported
    with bad_input_exits():
        refuse_prediction_groups(sys.argv[1:])
        try:
            main()
        except RunAborted as exc:
            from aamperf.interrupts import RunInterrupted, exit_interrupted  # loaded by main() by then

            if isinstance(exc, RunInterrupted):
                exit_interrupted(exc)
            exit_aborted(exc)
        except OSError as exc:  # a disk full at the start: Hydra's own files (.hydra/, train.log)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" ({exc.filename})" if exc.filename else ""
            exit_bad_input(
                f"no space left on the file system of the run directory to write its files{where}; free "
                "space there or set hydra.run.dir elsewhere"
            )
        except ValueError as exc:  # Hydra's own check of its flags, before any config exists
            if not str(exc).startswith("Only one of --run, --multirun, --cfg"):
                raise
            exit_bad_input(
                f"{exc}: one of them per command; to see a sweep job's config, drop -m: "
                "python -m aamperf.train --cfg job <that job's overrides>"
            )


def command() -> None:
    """`python -m aamperf.train` and `aamperf-train`: cli(), then the process ends at once (end_process)."""
    end_process(cli, "aamperf.train", "aamperf-train")


if __name__ == "__main__":
    command()
