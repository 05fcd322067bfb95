"""Entry point: `python -m aamperf.train [overrides]` (Hydra composes conf/ into one run)."""

import os
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from aamperf.config import register_configs
from aamperf.errors import (
    RunAborted,
    UserError,
    error_line,
    exit_aborted,
    exit_bad_input,
    hydra_error_message,
)
from aamperf.run import train
from aamperf.search import objective

register_configs()
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # absolute: main() also works imported (tests)


def _print_result(summary: dict, run_dir: Path) -> None:
    def fmt(key: str, unit: str = "", scale: float = 1.0) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value / scale:.4g}{unit}"

    print(f"run directory: {run_dir}")
    print(
        f"  {fmt('samples_per_s', ' samples/s')} | step {fmt('step_time_s', ' s')} | "
        f"MFU {fmt('mfu')} | peak RSS {fmt('peak_rss_bytes', ' GiB', 2**30)} | "
        f"train loss {fmt('train_loss')} | val loss {fmt('val_loss')}"
    )
    found = summary.get("batch_finder")
    if found:
        print(
            f"  trainer.batch_size=auto: {found['batch_size']} per step, micro-batches of "
            f"{found['micro_batch']} x {found['grad_accum_steps']} (largest that fits: "
            f"{found['largest_fitting']}, limited by {found['limited_by']})"
        )


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        summary = train(cfg, run_dir)
    except UserError as exc:
        if not in_sweep:
            raise  # a failed job for Hydra's callbacks (aamperf/callbacks.py), then one line from cli()
        print(error_line(exc), file=sys.stderr)
        return None  # the sweep goes on; summary.json holds the error and the report lists it
    except RunAborted as exc:  # a guard stopped the run and kept its last good state
        if not in_sweep:
            raise  # cli() prints it
        print("aborted: " + " ".join(str(exc).split()), file=sys.stderr)
        return None
    except Exception:
        if in_sweep:  # a bug, not a user mistake: the traceback is shown, the other jobs still run
            traceback.print_exc()
            return None
        raise
    if summary.get("rank", 0) == 0:
        _print_result(summary, run_dir)
    return objective(cfg, summary)  # what a sweeper maximizes: samples/s (at equal quality in a search)


def cli() -> None:
    """main() with every user mistake, Hydra's config errors included, as one `error:` line and exit
    code 2; a bug keeps its traceback and exit code 1. HYDRA_FULL_ERROR=1 keeps Hydra's own reports."""
    # The user's HYDRA_FULL_ERROR=1, not the one a parent aamperf (a search's reference run) passed on
    hydra_reports = (
        os.environ.get("HYDRA_FULL_ERROR") == "1" and "AAMPERF_SET_HYDRA_FULL_ERROR" not in os.environ
    )
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises its errors instead of printing them
    os.environ["AAMPERF_SET_HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except UserError as exc:
        exit_bad_input(exc)
    except RunAborted as exc:
        exit_aborted(exc)
    except CompactHydraException as exc:  # Hydra's class of errors it shows without a traceback
        if hydra_reports:
            raise
        exit_bad_input(hydra_error_message(exc))
    finally:
        del os.environ["AAMPERF_SET_HYDRA_FULL_ERROR"]
        if not hydra_reports:
            del os.environ["HYDRA_FULL_ERROR"]


if __name__ == "__main__":
    cli()
