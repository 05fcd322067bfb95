"""Hydra callbacks: the comparison report a multirun ends with (registered in conf/config.yaml)."""

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from aamperf.compare import find_runs, make_report, to_markdown
from aamperf.errors import UserError


class CompareReport(Callback):
    """After the last job: comparison.{json,csv,md,png} in the sweep directory, the table printed,
    and the comparison logged to W&B beside the jobs when logger=wandb.

    Exit status: 2 when the baseline cannot be found (compare.baseline names the fix), 1 when a job
    failed (it is a row of the report with its error), 0 otherwise.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():  # every job refused before it made its directory
            return
        try:
            result = make_report(
                [sweep_dir], config.compare.baseline, config.compare.quality_tolerance, sweep_dir
            )
        except UserError as exc:
            print(
                f"error: no comparison report: {exc}; the runs are kept: python -m aamperf.compare "
                f"{sweep_dir} --baseline '<config>'",
                file=sys.stderr,
            )
            sys.exit(2)
        print(to_markdown(result))
        print(f"report: {sweep_dir / 'comparison.md'}, {sweep_dir / 'comparison.png'}")
        if config.logger.backend == "wandb":
            from aamperf.loggers import log_comparison

            log_comparison(result, sweep_dir, config)
        failed = [run for run in find_runs([sweep_dir]) if run.summary.get("status") != "completed"]
        if failed:
            names = ", ".join(run.path.name for run in failed)
            print(f"error: {len(failed)} job(s) failed: {names} (errors in the report)", file=sys.stderr)
            sys.exit(1)
