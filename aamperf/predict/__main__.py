"""Entry point: `python -m aamperf.predict run=<run dir> [data.table=... pairwise=true ...]`."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from aamperf.allocator import PREDICT, restart_before_hydra, restart_with_allocator
from aamperf.config import CONF_DIR
from aamperf.errors import UserError, bad_input_exits, end_process, exit_bad_input
from aamperf.interrupts import stop_at_once
from aamperf.predict.config import register_predict_configs

register_predict_configs()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="predict")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    restart_with_allocator(cfg.allocator, out_dir, PREDICT)  # returns where this process keeps its malloc
    # imported here, not at the top: cli()'s early restart comes before torch loads
    from aamperf.predict.categorical import categorical_line
    from aamperf.predict.run import predict
    from aamperf.predict.target import summary_line

    try:
        summary = predict(cfg, out_dir)
    except UserError as exc:  # here, before Hydra adds its own line about the failed job
        exit_bad_input(exc)
    if not summary:  # a rank other than the first: its share is in the first rank's files
        return
    if "bench" in summary:
        figures = ", ".join(
            f"batch {size}: p50 {1e3 * f['p50_s']:.3g} ms, p95 {1e3 * f['p95_s']:.3g} ms"
            for size, f in summary["bench"].items()
        )
        print(f"benchmark of inference={summary['inference']}: {out_dir}\n  {figures}")
        return
    print(f"predictions: {out_dir}")
    print(
        f"  {summary['n_samples']} samples | {summary['samples_per_s']:.4g} samples/s | batch latency p50 "
        f"{summary['batch_latency_s']['p50']:.3g} s | files: {', '.join(summary['files'])}"
    )
    target = summary_line(summary)
    if target:
        print(target)
    categorical = categorical_line(summary)
    if categorical:
        print(categorical)


def cli() -> None:
    """main() with bad input (a run without a model, files that cannot be read, Hydra's config errors)
    as one `error:` line and exit code 2; SIGTERM / SIGINT as one `interrupted:` line, exit 143 / 130."""
    left = "stopped before all predictions were written (each file is whole or absent): run it again"
    restart_before_hydra(PREDICT)  # a plain command whose config preloads an allocator: before torch loads
    with bad_input_exits(), stop_at_once(left):
        main()


def command() -> None:
    """`python -m aamperf.predict` and `aamperf-predict`: cli(), then the process ends at once."""
    end_process(cli, "aamperf.predict", "aamperf-predict")


if __name__ == "__main__":
    command()
