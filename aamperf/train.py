"""Entry point: `python -m aamperf.train [overrides]` (Hydra composes conf/ into one run)."""

import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from aamperf.config import register_configs
from aamperf.errors import RunAborted, UserError
from aamperf.run import train
from aamperf.search import objective

register_configs()


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
            f"  trainer.batch_size=auto: {found['batch_size']} = {found['micro_batch']} x "
            f"{found['grad_accum_steps']} accumulated (largest fitting {found['largest_fitting']}, "
            f"limited by {found['limited_by']})"
        )


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        summary = train(cfg, run_dir)
    except UserError as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)  # one line, always
        if in_sweep:
            return None  # the sweep goes on; summary.json holds the error and the report lists it
        sys.exit(2)
    except RunAborted as exc:  # a guard stopped the run and kept its last good state
        print("aborted: " + " ".join(str(exc).split()), file=sys.stderr)
        if in_sweep:
            return None
        sys.exit(3)
    except Exception:
        if in_sweep:  # a bug, not a user mistake: the traceback is shown, the other jobs still run
            traceback.print_exc()
            return None
        raise
    if summary.get("rank", 0) == 0:
        _print_result(summary, run_dir)
    return objective(cfg, summary)  # what a sweeper maximizes: samples/s (at equal quality in a search)


if __name__ == "__main__":
    main()
