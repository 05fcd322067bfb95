"""Auto-tuning (`hparams_search=fastest`): Optuna searches phases and batch size for the highest
samples/s whose validation loss stays within `compare.quality_tolerance` of a baseline reference run.

The reference runs first, in `<sweep dir>/reference`, with `optim=baseline` and every value the
search fixes (a plain override, or a space narrowed to one value: `'compile=choice(disabled)'`), as each
trial gets it; a reference that fails stops the search before its trials. Each trial's objective is its
samples/s, or 0 when its val loss is worse than the reference by more than the tolerance. At the end the
best feasible trial becomes a ready optim level, `<sweep dir>/optim/fastest.yaml`.
"""

import datetime
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override
from omegaconf import DictConfig, OmegaConf

from aamperf.callbacks import CompareReport
from aamperf.distributed import torchrun_env
from aamperf.errors import error_line, exit_bad_input, exit_with
from aamperf.files import write_atomic
from aamperf.report import find_runs
from aamperf.report.verdict import val_batch

REFERENCE_DIR = "reference"


def lost_quality(summary: dict[str, Any], reference: dict[str, Any], tolerance: float) -> str | None:
    """Why a trial's val loss does not count as the reference's quality, or None where it does: within the
    tolerance, over validation batches of the reference's size (the UniFrac part of a val loss is over the
    pairs inside a batch, so a trial validated in batches of another size does not compare)."""
    val_loss, reference_val_loss = summary.get("val_loss"), reference["val_loss"]
    if val_loss is None:
        return "no validation"
    mine, theirs = val_batch(summary), val_batch(reference)
    if mine and theirs and mine != theirs:
        return (
            f"validated in batches of {mine} against the reference's {theirs}, so the val losses do not "
            f"compare: set trainer.val_batch_size={theirs}"
        )
    if val_loss > reference_val_loss * (1 + tolerance):
        return (
            f"val loss {val_loss:.4f} is worse than the reference's {reference_val_loss:.4f} by more than "
            f"{tolerance:.0%}"
        )
    return None


def objective(cfg: DictConfig, summary: dict[str, Any]) -> float:
    """What the sweeper maximizes: samples/s, or 0 for a trial that lost quality against the reference."""
    path = cfg.search.reference
    if path is None:
        return summary["samples_per_s"]
    try:
        reference = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        reference = {}
    if not (isinstance(reference, dict) and isinstance(reference.get("val_loss"), int | float)):
        print(f"warning: no reference run at {path}: quality is not checked", file=sys.stderr)
        return summary["samples_per_s"]
    reason = lost_quality(summary, reference, cfg.compare.quality_tolerance)
    if reason is None:
        return summary["samples_per_s"]
    print(f"search: {reason}: objective 0", file=sys.stderr)
    return 0.0


def one_choice(override: Override) -> str | None:
    """The value of a `choice(...)` of one value (a search narrowed to it: `compile=choice(disabled)`),
    as an override writes it; None for any other sweep."""
    sweep = override.value()
    if isinstance(sweep, ChoiceSweep) and len(sweep.list) == 1:
        return next(override.sweep_string_iterator())
    return None


def reference_overrides(params: dict[str, Any], task: list[str]) -> list[str]:
    """The reference run's overrides: each key the search gives one value, that value, as the Optuna
    sweeper gives it to every trial from `params` (hydra.sweeper.params) and the command line's `task`
    overrides (which win; a plain value wins over a search of the same key). A key still searched is
    left to optim=baseline, which the caller adds."""
    parsed = OverridesParser.create().parse_overrides([*(f"{k}={v}" for k, v in params.items()), *task])
    plain: dict[str, Override] = {}
    searched: dict[str, Override] = {}
    for override in parsed:
        if override.is_hydra_override() or override.key_or_group in ("hparams_search", "optim"):
            continue
        (searched if override.is_sweep_override() else plain)[override.get_key_element()] = override
    narrowed = {key: one_choice(override) for key, override in searched.items() if key not in plain}
    return [
        *(override.input_line for override in plain.values()),
        *(f"{key}={value}" for key, value in narrowed.items() if value is not None),
    ]


def searched_keys(params: dict[str, Any], task: list[str]) -> list[str]:
    """The keys the search varies: those of `params` (hydra.sweeper.params) and of the command line's sweeps
    (`'trainer.batch_size=choice(8,16)'`: the Optuna sweeper searches those too), but Hydra's own."""
    parsed = OverridesParser.create().parse_overrides(list(task))
    swept = [o.key_or_group for o in parsed if o.is_sweep_override() and not o.is_hydra_override()]
    return list(dict.fromkeys([*params, *swept]))


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


def run_reference(config: DictConfig) -> None:
    """The reference run, in `<sweep dir>/reference`, before the first trial. One that fails ends the
    search with its exit code: without its val loss every trial would pass unchecked."""
    reference_dir = Path(config.hydra.sweep.dir) / REFERENCE_DIR
    params = config.hydra.sweeper.get("params")
    overrides = reference_overrides(
        OmegaConf.to_container(params, resolve=False) if params else {},
        OmegaConf.to_container(config.hydra.overrides.task, resolve=False),
    )
    val_batch_size = config.trainer.get("val_batch_size")  # the trials' (hparams_search=fastest sets it)
    if val_batch_size is not None:  # validated alike whatever batch the reference trains at
        overrides = [o for o in overrides if not o.startswith("trainer.val_batch_size=")]
        overrides.append(f"trainer.val_batch_size={val_batch_size}")
    cmd = [
        sys.executable,
        "-m",
        "aamperf.train",
        *overrides,
        "optim=baseline",
        f"hydra.run.dir={reference_dir}",
    ]
    print(f"search: reference run (the quality bar): {' '.join(cmd[3:])}", flush=True)
    code = subprocess.run(cmd).returncode
    if code != 0:
        exit_with(
            error_line(
                f"the search's reference run failed (exit code {code}; its own error is above, its "
                f"directory {reference_dir}): without its validation loss no trial's quality can be "
                "checked, so the search stops before its trials; fix what the reference reports and run "
                "the search again"
            ),
            code if code > 0 else 128 - code,  # killed by signal N (-N here): 128 + N, as a shell says
        )


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
        run_reference(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.write_level(config)
        super().on_multirun_end(config, **kwargs)

    def write_level(self, config: DictConfig) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        reference = next((r for r in find_runs([sweep_dir / REFERENCE_DIR])), None)
        ref_loss = reference.summary.get("val_loss") if reference else None  # None: quality not checked
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
                or lost_quality(r.summary, reference.summary, config.compare.quality_tolerance) is None
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
        params = config.hydra.sweeper.get("params")
        task = OmegaConf.select(config, "hydra.overrides.task", default=None)  # the command line's
        searched = searched_keys(
            OmegaConf.to_container(params, resolve=False) if params else {},
            OmegaConf.to_container(task, resolve=False) if task else [],
        )
        write_atomic(out, level_yaml(best.overrides, searched, note))
        print(
            f"search: best trial {best.path.name}: {s['samples_per_s']:.3g} samples/s{speedup}; "
            f"written to {out}"
        )
