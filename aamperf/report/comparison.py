"""The comparison of configurations against a baseline, seed by seed: speed-up, val-loss change and
time to quality as per-seed paired values, summarized by their mean with a bootstrap interval
(`report/paired.py`), and each row's verdict (`report/verdict.py`)."""

import itertools
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from aamperf.errors import UserError
from aamperf.report.paired import (
    MIN_PAIRS,
    Interval,
    geometric,
    mean_interval,
    median_or_none,
    time_to_quality,
)
from aamperf.report.render import write_report
from aamperf.report.runs import (
    Group,
    Run,
    find_runs,
    group_runs,
    overlapping,
    paired,
    pick_baseline,
    same_training,
)
from aamperf.report.verdict import validity, verdict

# A target's headline figure (summary.json `val` key, its name in the report): a regression's, a classifier's
TARGET_FIGURES = (("val_target_r2", "R^2"), ("val_accuracy", "accuracy"))


def paired_values(pairs: list[tuple[Run, Run]], value) -> list[float]:
    """value(run, baseline run) of each pair where it is defined."""
    values = [value(run, base) for run, base in pairs]
    return [v for v in values if v is not None and math.isfinite(v)]


def log_ratio(key: str, invert: bool = False):
    """Per pair: log(run / baseline) of a summary figure (or baseline / run with `invert`)."""

    def value(run: Run, base: Run) -> float | None:
        a, b = run.summary.get(key), base.summary.get(key)
        if not (isinstance(a, int | float) and isinstance(b, int | float)) or a <= 0 or b <= 0:
            return None
        return math.log(b / a) if invert else math.log(a / b)

    return value


def relative_delta(run: Run, base: Run) -> float | None:
    a, b = run.summary.get("val_loss"), base.summary.get("val_loss")
    return a / b - 1 if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def quality_times(
    pairs: list[tuple[Run, Run]], tolerance: float
) -> tuple[list[float | None], list[float | None]]:
    """Per pair: seconds from the run's start until the run, and the baseline, first reach the baseline's
    final validation loss, within `tolerance` (the report's "equal quality"; None: not reached).
    Without the tolerance a run of equal quality would miss the exact figure half the time."""
    mine, theirs = [], []
    for run, base in pairs:
        final = base.summary.get("val_loss")
        if not isinstance(final, int | float):
            continue
        target = final * (1 + tolerance) if final > 0 else final
        mine.append(time_to_quality(run.validations, target))
        theirs.append(time_to_quality(base.validations, target))
    return mine, theirs


def target_figures(group: Group) -> dict[str, Any]:
    """The median over seeds of the model's headline target figure (its last validation's) and of the
    random forest's on the same samples (summary.json `rf_baseline`); None where the runs have none."""
    for key, name in TARGET_FIGURES:
        model = [(r.summary.get("val") or {}).get(key) for r in group.ok_runs]
        forest = [(r.summary.get("rf_baseline") or {}).get(key) for r in group.ok_runs]
        model, forest = ([v for v in vs if isinstance(v, int | float)] for vs in (model, forest))
        if model or forest:
            return {
                "target_figure": name,
                "target_value": median_or_none(model),
                "rf_value": median_or_none(forest),
            }
    return {"target_figure": None, "target_value": None, "rf_value": None}


def early_stops(group: Group) -> dict[str, Any]:
    """Where the runs stopped early (trainer.patience; summary.json `best`): each seed's step and its best
    validation's, or None where none did."""
    stops = [(run.seed, run.summary.get("best") or {}) for run in group.ok_runs]
    each = [
        f"seed {seed} at step {best['stopped_early_at']} (best {best['monitor']} at step {best['step']})"
        for seed, best in stops
        if best.get("stopped_early_at") is not None
    ]
    return {"stopped_early": "; ".join(each) or None}


def compare(
    runs: list[Run],
    baseline: str = "optim=baseline",
    quality_tolerance: float = 0.02,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Each configuration of `runs` against the one `baseline` names: a row of figures and a verdict,
    the baseline's first, then the others by speed-up; and what the figures were measured on."""
    groups = group_runs(runs)
    base = pick_baseline(groups, baseline)
    overlaps = overlapping(runs)
    beside = {run.path for a, b, _ in overlaps for run in (a, b)}  # runs that shared their host's time
    rows = [compare_group(group, base, beside, quality_tolerance, confidence) for group in groups]
    rows.sort(key=lambda r: (r["config"] != base.config, -(r["speedup"] or 0)))
    return {
        "baseline": base.config,
        "quality_tolerance": quality_tolerance,
        "confidence": confidence,
        **timing_conditions(runs, overlaps, beside),
        "rows": rows,
        "same_trainings": same_trainings(groups, base),
    }


def same_trainings(groups: list[Group], base: Group) -> list[dict[str, Any]]:
    """Each two configurations, neither the baseline (its row's verdict says so), whose runs trained the
    same way seed by seed (`same_training`: e.g. `optim=ultra compile=disabled` where ultra's `compile=auto`
    chose eager too): the first's samples/s over the second's (geometric mean over the paired seeds) is the
    machine's difference, not theirs."""
    found = []
    for a, b in itertools.combinations([g for g in groups if g is not base], 2):
        pairs = paired(a, b)
        if pairs and all(same_training(r, s) for r, s in pairs):
            logs = paired_values(pairs, log_ratio("samples_per_s"))
            ratio = math.exp(statistics.fmean(logs)) if logs else None
            found.append({"configs": [a.config, b.config], "seeds": len(pairs), "speed_ratio": ratio})
    return found


def timing_conditions(
    runs: list[Run], overlaps: list[tuple[Run, Run, float]], beside: set[Path]
) -> dict[str, Any]:
    """What the runs were timed on: the machines, runs that ran at the same time on one host (`overlaps`,
    `beside`: the runs in them), and runs whose cores other processes shared."""
    # what each run's summary names (runs from before it: none)
    machines = Counter(run.summary["machine"] for run in runs if run.summary.get("machine"))
    return {
        "machines": dict(machines),
        "overlaps": [
            {"runs": [str(a.path), str(b.path)], "host": a.summary["host"], "shared_s": shared}
            for a, b, shared in overlaps
        ],
        # runs whose loop shared its cores with other processes (summary.json loop_load), besides those
        "under_load": [
            {"run": str(run.path), "reason": run.summary["loop_load"]["under_load"]}
            for run in runs
            if run.path not in beside and (run.summary.get("loop_load") or {}).get("under_load")
        ],
    }


def compare_group(
    group: Group, base: Group, beside: set[Path], tolerance: float, confidence: float
) -> dict[str, Any]:
    """One configuration's row: its figures, each beside the baseline's seed by seed where it is paired,
    and its verdict. `beside`: the runs that ran at the same time as another run on their host."""
    pairs = paired(group, base)
    few = len(pairs) < MIN_PAIRS  # too few seeds for an interval: the means alone, no pretend spread
    speed = mean_interval(paired_values(pairs, log_ratio("samples_per_s")), confidence)
    quality = mean_interval(paired_values(pairs, relative_delta), confidence)
    row = {
        "config": group.config,
        "optim": group.runs[0].summary.get("optim"),
        "seeds": sorted(r.seed for r in group.ok_runs),
        "baseline_seeds": len(base.ok_runs),
        "paired_seeds": [r.seed for r, _ in pairs],
        **speed_figures(group, pairs, speed, few, confidence),
        **quality_time_figures(pairs, few, tolerance, confidence),
        **cost_figures(group, pairs),
        **memory_figures(group, base),
        **quality_figures(group, base, quality, few),
        **target_figures(group),  # a fine-tuning run's: the model's beside a random forest's
        **early_stops(group),
        **validity(group, pairs, beside),
    }
    row["verdict"], row["seeds_needed"] = verdict(row, group is base, speed, quality, tolerance, confidence)
    return row


def speed_figures(
    group: Group, pairs: list[tuple[Run, Run]], speed: Interval | None, few: bool, confidence: float
) -> dict[str, Any]:
    """Samples/s and step time: the configuration's medians, and its speed-up over the baseline."""
    speedup, lo, hi = geometric(speed)
    step = mean_interval(paired_values(pairs, log_ratio("step_time_s", invert=True)), confidence)
    return {
        "samples_per_s": group.median("samples_per_s"),
        "samples_per_s_min": min(group.values("samples_per_s"), default=None),
        "samples_per_s_max": max(group.values("samples_per_s"), default=None),
        # geometric mean of the per-seed speed-ups, with the bootstrap interval of that mean
        "speedup": speedup,
        "speedup_lo": None if few else lo,
        "speedup_hi": None if few else hi,
        "step_time_s": group.median("step_time_s"),
        "step_time_speedup": geometric(step)[0],
    }


def quality_time_figures(
    pairs: list[tuple[Run, Run]], few: bool, tolerance: float, confidence: float
) -> dict[str, Any]:
    """Time to quality: the seconds until the baseline's final val loss (within `tolerance`), and the
    speed-up in it over the baseline, with an interval only when every paired seed reached it."""
    mine, theirs = quality_times(pairs, tolerance)
    reached = [(m, t) for m, t in zip(mine, theirs, strict=True) if m is not None and t is not None]
    ttq = mean_interval([math.log(t / m) for m, t in reached if m > 0 and t > 0], confidence)
    every_seed = len(reached) == len(pairs) and not few
    speedup, lo, hi = geometric(ttq) if every_seed else (None, None, None)
    return {
        "time_to_quality_s": median_or_none([m for m in mine if m is not None]),
        "time_to_quality_reached": f"{sum(m is not None for m in mine)}/{len(pairs)}",
        "time_to_quality_speedup": speedup,
        "time_to_quality_speedup_lo": lo,
        "time_to_quality_speedup_hi": hi,
    }


def cost_figures(group: Group, pairs: list[tuple[Run, Run]]) -> dict[str, Any]:
    """What the start costs (compile, the first step, measuring for `auto`) and how well the steps use the
    device (MFU, HFU, the FLOPs they count, the time spent waiting for data)."""
    model_flops = {
        (r.summary.get("model_flops_per_step"), b.summary.get("model_flops_per_step")) for r, b in pairs
    }
    return {
        "compile_time_s": group.median("compile_time_s"),
        "recompiles": group.median("recompiles"),  # graphs compiled for new shapes while training
        "time_to_first_step_s": group.median("time_to_first_step_s"),
        # measuring for `auto` options: a run's first on a device pays it, later ones read the cache
        "auto_s": group.median("auto_s"),
        "auto_s_max": max(group.values("auto_s"), default=None),
        "mfu": group.median("mfu"),
        "hfu": group.median("hfu"),
        "model_flops_per_step": group.median("model_flops_per_step"),
        "hardware_flops_per_step": group.median("hardware_flops_per_step"),
        # the same batches must cost the same model FLOPs in every configuration: else MFUs differ in work
        "model_flops_match_baseline": all(a == b for a, b in model_flops) if pairs else None,
        "data_wait_frac": group.median("data_wait_frac"),
        "duration_parts_s": duration_parts(group),
    }


def duration_parts(group: Group) -> dict[str, float] | None:
    """The median of each part of its runs' duration (summary.json duration_parts_s), in the runs' order
    of the parts; None where no run has them (runs from before they were recorded, or a damaged record's
    parts that are not numbers: left out)."""
    parts = [r.summary.get("duration_parts_s") for r in group.ok_runs]
    parts = [p for p in parts if isinstance(p, dict) and all(isinstance(v, int | float) for v in p.values())]
    names = dict.fromkeys(name for p in parts for name in p)
    return {name: statistics.median(p.get(name, 0.0) for p in parts) for name in names} or None


def memory_figures(group: Group, base: Group) -> dict[str, Any]:
    """Peak host memory of a run (all its ranks', where it ran on several), and its ratio to the
    baseline's."""
    # the process tree's memory (loader workers' PSS included) where both have it, else the main process's
    memory_key = (
        "peak_tree_pss_bytes"
        if group.values("peak_tree_pss_bytes") and base.values("peak_tree_pss_bytes")
        else "peak_rss_bytes"
    )
    peak, base_peak = job_memory(group, memory_key), job_memory(base, memory_key)
    return {
        "peak_rss_bytes": group.median("peak_rss_bytes"),
        "peak_tree_pss_bytes": group.median("peak_tree_pss_bytes"),
        "peak_memory_bytes": peak,  # what peak_rss_ratio compares: memory_key's figure, all ranks' summed
        "memory_key": memory_key,
        "peak_rss_ratio": peak / base_peak if None not in (peak, base_peak) else None,
        "train_rss_growth_bytes": group.median("train_rss_growth_bytes"),
        "peak_device_bytes": group.median("peak_device_bytes"),  # the CUDA allocator's peak; None on CPU
    }


def job_memory(group: Group, key: str) -> float | None:
    """The median over runs of a run's peak memory `key`: a multi-process run's sum over its ranks
    (`<key>_all_ranks`, each rank's own process tree), where it has it; its first rank's else."""
    values = [
        r.summary.get(f"{key}_all_ranks") or r.summary.get(key)
        for r in group.ok_runs
        if isinstance(r.summary.get(key), int | float)
    ]
    return statistics.median(values) if values else None


def quality_figures(group: Group, base: Group, quality: Interval | None, few: bool) -> dict[str, Any]:
    """The final val and train losses, and their change from the baseline's."""
    train, base_train = group.median("train_loss"), base.median("train_loss")  # both at the last step
    return {
        "val_loss": group.median("val_loss"),
        # mean over seeds of (val loss / the same seed's baseline val loss - 1), with its interval
        "val_loss_delta": None if quality is None else quality.mean,
        "val_loss_delta_lo": None if quality is None or few else quality.lo,
        "val_loss_delta_hi": None if quality is None or few else quality.hi,
        "train_loss": train,
        "train_loss_delta": train / base_train - 1 if train is not None and base_train else None,
    }


def make_report(
    dirs: list[Path], baseline: str, quality_tolerance: float, out: Path, confidence: float = 0.95
) -> dict[str, Any]:
    """Find the runs under `dirs`, compare them and write the report files into `out`."""
    runs = find_runs(dirs)
    if not runs:
        raise UserError(f"no summary.json under {', '.join(map(str, dirs))}: nothing to compare")
    result = compare(runs, baseline, quality_tolerance, confidence)
    write_report(result, group_runs(runs), out)
    return result
