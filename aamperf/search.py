"""Auto-tuning (`hparams_search=fastest`): Optuna searches phases and batch size for the highest
samples/s whose validation loss stays within `compare.quality_tolerance` of a baseline reference run.

The reference runs first, in `<sweep dir>/reference`, with the search's other overrides and
`optim=baseline`; each trial's objective is its samples/s, or 0 when its val loss is worse than the
reference by more than the tolerance. At the end the best feasible trial becomes a ready optim level,
`<sweep dir>/optim/fastest.yaml`.
"""

import datetime
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from aamperf.callbacks import CompareReport
from aamperf.distributed import torchrun_env
from aamperf.errors import exit_bad_input
from aamperf.files import write_atomic
from aamperf.report import find_runs

REFERENCE_DIR = "reference"


def quality_ok(val_loss: float | None, reference_val_loss: float | None, tolerance: float) -> bool:
    return (
        val_loss is not None
        and reference_val_loss is not None
        and val_loss <= reference_val_loss * (1 + tolerance)
    )


def objective(cfg: DictConfig, summary: dict[str, Any]) -> float:
    """What the sweeper maximizes: samples/s, or 0 for a trial that lost quality against the reference."""
    reference = cfg.search.reference
    if reference is None:
        return summary["samples_per_s"]
    try:
        reference_val_loss = json.loads(Path(reference).read_text())["val_loss"]
    except (OSError, ValueError, KeyError):
        print(f"warning: no reference run at {reference}: quality is not checked", file=sys.stderr)
        return summary["samples_per_s"]
    if quality_ok(summary.get("val_loss"), reference_val_loss, cfg.compare.quality_tolerance):
        return summary["samples_per_s"]
    print(
        f"search: val loss {summary.get('val_loss')} is worse than the reference's {reference_val_loss:.4f} "
        f"by more than {cfg.compare.quality_tolerance:.0%}: objective 0",
        file=sys.stderr,
    )
    return 0.0


def level_yaml(overrides: list[str], searched: list[str], note: str) -> str:
    """An optim level file from a trial's overrides: groups become `override /group: option`."""
    chosen = [o for o in overrides if o.split("=", 1)[0] in searched]
    groups = [o.split("=", 1) for o in chosen if "." not in o.split("=", 1)[0]]
    values = OmegaConf.from_dotlist([o for o in chosen if "." in o.split("=", 1)[0]])
    lines = ["# @package _global_", *(f"# {line}" for line in note.splitlines())]
    if groups:
        lines += ["defaults:", *(f"  - override /{group}: {option}" for group, option in groups)]
    body = OmegaConf.to_yaml(OmegaConf.merge(values, {"optim": "fastest"}))
    return "\n".join(lines) + "\n\n" + body


class FastestSearch(CompareReport):
    """Runs the reference before the trials, writes the best trial as an optim level after them, then
    the comparison report (it replaces CompareReport in a search, so the level is written first)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if torchrun_env():  # every rank would run a study of its own, each choosing its own trials
            exit_bad_input(
                "hparams_search=fastest runs in one process (its trials timed one at a time, its Optuna "
                "study in that process), not under torchrun: run python -m aamperf.train -m "
                "hparams_search=fastest, then train the level it writes on several ranks: python -m "
                "aamperf.launch --nproc_per_node=N -m aamperf.train distributed=ddp optim=fastest "
                "'hydra.searchpath=[file://<sweep dir>]'"
            )
        sweep_dir = Path(config.hydra.sweep.dir)
        keep = [
            o
            for o in config.hydra.overrides.task
            if not o.startswith(("hparams_search=", "optim=", "hydra.")) and "," not in o
        ]
        cmd = [
            sys.executable,
            "-m",
            "aamperf.train",
            *keep,
            "optim=baseline",
            f"hydra.run.dir={sweep_dir / REFERENCE_DIR}",
        ]
        print(f"search: reference run (the quality bar): {' '.join(cmd[3:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            print("warning: the reference run failed: trials are not checked for quality", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.write_level(config)
        super().on_multirun_end(config, **kwargs)

    def write_level(self, config: DictConfig) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        reference = next((r for r in find_runs([sweep_dir / REFERENCE_DIR])), None)
        ref_loss = reference.summary.get("val_loss") if reference else None
        ref_speed = reference.summary.get("samples_per_s") if reference else None
        trials = [
            r for r in find_runs([sweep_dir]) if REFERENCE_DIR not in r.path.relative_to(sweep_dir).parts
        ]
        feasible = [
            r
            for r in trials
            if r.summary.get("status") == "completed"
            and (
                ref_loss is None
                or quality_ok(r.summary.get("val_loss"), ref_loss, config.compare.quality_tolerance)
            )
        ]
        if not feasible:
            print(
                f"search: none of {len(trials)} trials kept the quality; no optim level written",
                file=sys.stderr,
            )
            return
        best = max(feasible, key=lambda r: r.summary["samples_per_s"])
        s = best.summary
        speedup = (
            f", {s['samples_per_s'] / ref_speed:.2f}x the baseline's {ref_speed:.3g}" if ref_speed else ""
        )
        delta = f"{100 * (s['val_loss'] / ref_loss - 1):+.1f}%" if ref_loss and s.get("val_loss") else "n/a"
        out = sweep_dir / "optim" / "fastest.yaml"
        note = "\n".join(
            textwrap.wrap(
                f"optim=fastest: found by hparams_search=fastest on {datetime.date.today()} in {sweep_dir} "
                f"(trial {best.path.name}): {s['samples_per_s']:.3g} samples/s{speedup}; val loss {delta} "
                f"against the baseline (tolerance {config.compare.quality_tolerance:.0%}); "
                f"{len(feasible)} of {len(trials)} trials kept the quality. "
                f"Measured at: {' '.join(best.overrides)}",
                98,
            )
            + [
                f"Use: python -m aamperf.train optim=fastest 'hydra.searchpath=[file://{sweep_dir.resolve()}]'",
                "(or copy this file to conf/optim/)",
            ]
        )
        write_atomic(out, level_yaml(best.overrides, list(config.hydra.sweeper.params), note))
        print(
            f"search: best trial {best.path.name}: {s['samples_per_s']:.3g} samples/s{speedup}; "
            f"written to {out}"
        )
