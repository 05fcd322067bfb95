"""Entry point: `python -m aamperf.train [overrides]` (Hydra composes conf/ into one run)."""

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
    error_line,
    exit_aborted,
    exit_bad_input,
)

register_configs()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    restart_with_allocator(cfg.system, run_dir)  # returns where this process keeps its malloc
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
        if not in_sweep:
            raise
        # a signal stops the whole sweep, not one job: its report is left to be asked for
        report = f"python -m aamperf.compare {hydra_cfg.sweep.dir} reports those before it"
        raise RunInterrupted(
            f"{exc}; sweep job #{hydra_cfg.job.num}: {report}", exc.result, exc.signum
        ) from None
    except (UserError, RunAborted) as exc:  # bad input, or a guard stopped the run (state kept)
        if not in_sweep:
            raise  # a failed job for Hydra's callbacks (aamperf/callbacks.py): one line, exit 2 or 3
        print(aborted_line(exc) if isinstance(exc, RunAborted) else error_line(exc), file=sys.stderr)
        return None  # the sweep goes on; summary.json holds the error and the report lists it
    except Exception:
        if in_sweep:  # a bug, not a user mistake: the traceback is shown, the other jobs still run
            traceback.print_exc()
            return None
        raise
    if summary.get("rank", 0) == 0:
        print_result(summary, run_dir)
    return objective(cfg, summary)  # what a sweeper maximizes: samples/s (at equal quality in a search)


def cli() -> None:
    """main() with every user mistake, Hydra's config errors included, as one `error:` line and exit
    code 2; a run a guard stopped as one `aborted:` line and exit code 3; a run a signal stopped as one
    `interrupted:` line and exit code 128 + the signal (143 for SIGTERM, 130 for SIGINT); a bug keeps its
    traceback and exit code 1. HYDRA_FULL_ERROR=1 keeps Hydra's own reports."""
    logging.raiseExceptions = False  # a log file on a full disk: no "--- Logging error ---" tracebacks
    restart_before_hydra()  # a plain run whose config preloads an allocator: before torch is imported
    with bad_input_exits():
        try:
            main()
        except RunAborted as exc:
            from aamperf.interrupts import RunInterrupted, exit_interrupted  # loaded by main() by then

            if isinstance(exc, RunInterrupted):
                exit_interrupted(exc)
            exit_aborted(exc)
        except ValueError as exc:  # Hydra's own check of its flags, before any config exists
            if not str(exc).startswith("Only one of --run, --multirun, --cfg"):
                raise
            exit_bad_input(
                f"{exc}: one of them per command; to see a sweep job's config, drop -m: "
                "python -m aamperf.train --cfg job <that job's overrides>"
            )


if __name__ == "__main__":
    cli()
