"""The comparison of configurations against a baseline, seed by seed: speed-up, val-loss change and
time to quality as per-seed paired values, summarized by their mean with a bootstrap interval
(`report/paired.py`). A configuration is "faster at equal quality" only when the speed-up interval lies
above 1 and the val-loss interval inside +-tolerance; otherwise the verdict says what is undecided and
about how many paired seeds would decide it."""

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
    seeds_needed,
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


def val_batch(s: dict[str, Any]) -> int | None:
    """The samples in each validation batch of a run (its summary) where its val loss has a UniFrac part
    (over the pairs inside a batch, so it depends on the batch's size); None where it has none, or it is not
    known. A run from before summary.json held it validated in its training micro-batches, as the data
    loader made them then (at most the validation set, a multiple of the ranks)."""
    config = s.get("config") or {}
    if not (config.get("loss") or {}).get("unifrac_weight", 1.0):
        return None
    if "val_batch_size" in s:
        return s["val_batch_size"]
    trainer = config.get("trainer") or {}
    batch, accum = trainer.get("batch_size"), trainer.get("grad_accum_steps", 1)
    micro = (s.get("batch_finder") or {}).get("micro_batch") or (
        batch // accum if isinstance(batch, int) and accum else None
    )
    n_val, world = s.get("n_val"), s.get("world_size") or 1
    return min(micro, n_val) // world * world if micro and n_val else None


def validity(group: Group, pairs: list[tuple[Run, Run]], beside: set[Path]) -> dict[str, Any]:
    """What could make the comparison say less than it seems: failed runs, pairs that trained the same
    way, pairs timed while another run shared their host, pairs validated in batches of other sizes."""
    sizes = [(val_batch(r.summary), val_batch(b.summary)) for r, b in pairs]
    passes = [(val_passes(r.summary), val_passes(b.summary)) for r, b in pairs]
    return {
        "errors": [f"{r.path.name}: {r.summary.get('error')}" for r in group.runs if r not in group.ok_runs],
        # every pair trained the same way (the same phases applied after `auto`, the same config else)
        "same_training": bool(pairs) and all(same_training(r, b) for r, b in pairs),
        # pairs whose run or baseline run ran at the same time as another run on its host
        "overlapped_pairs": sum(r.path in beside or b.path in beside for r, b in pairs),
        # [run's, baseline's] validation batch of each pair whose val losses do not compare (UniFrac's pairs)
        "val_batches_differ": sorted({(a, b) for a, b in sizes if a and b and a != b}),
        # [run's, baseline's] trainer.val_passes of each pair: the figures of other draws, or of their mean
        "val_passes_differ": sorted({(a, b) for a, b in passes if a != b}),
    }


def val_passes(s: dict[str, Any]) -> int:
    """A run's trainer.val_passes (its summary; 1 before the key)."""
    return ((s.get("config") or {}).get("trainer") or {}).get("val_passes", 1)


def verdict(
    row: dict[str, Any],
    is_baseline: bool,
    speed: Interval | None,
    quality: Interval | None,
    tolerance: float,
    confidence: float,
) -> tuple[str, int | None]:
    """(verdict, paired seeds that would decide it). Faster at equal quality only when the speed-up
    interval lies above 1 and the val-loss interval inside +-tolerance; otherwise what is known."""
    if not row["seeds"]:
        errors = sorted({e.split(": ", 1)[-1] for e in row["errors"]})  # one line per distinct error
        return f"failed ({len(row['errors'])} runs): " + "; ".join(errors), None
    if is_baseline:
        return "baseline", None
    n = len(row["paired_seeds"])
    if row["overlapped_pairs"]:
        return (
            f"undecided: {row['overlapped_pairs']} of {n} pairs ran at the same time as other runs on one "
            "machine, so their timings measure the contention as much as the configuration; run the jobs "
            "one at a time (Hydra's basic launcher, the default)",
            None,
        )
    if row["val_batches_differ"]:
        run_batch, base_batch = row["val_batches_differ"][0]
        return (
            f"undecided: validated in batches of {run_batch} against the baseline's {base_batch}, and the "
            "UniFrac part of a val loss is over the pairs inside a batch, so the val losses do not compare; "
            f"run both with trainer.val_batch_size={base_batch}",
            None,
        )
    if row["val_passes_differ"]:
        run_passes, base_passes = row["val_passes_differ"][0]
        return (
            f"undecided: validated over {run_passes} passes against the baseline's {base_passes}, so the val "
            f"losses are of other draws; run both with trainer.val_passes={base_passes}",
            None,
        )
    if speed is None or quality is None or n < MIN_PAIRS:
        return (
            f"undecided: {n} seed(s) paired with the baseline on the same data; an interval needs at "
            f"least {MIN_PAIRS} (run both with seed=0,1,2)",
            MIN_PAIRS,
        )
    pct = f"{confidence:.0%}"
    speed_text = f"{row['speedup']:.2f}x [{row['speedup_lo']:.2f}, {row['speedup_hi']:.2f}]"
    if row["same_training"]:  # a measured difference is the machine's (load, run order), not the config's
        return (
            f"the same training as the baseline (its phases applied the same choices): {speed_text} "
            f"({pct} interval, {n} seeds) is the machine's difference, not the configuration's",
            None,
        )
    quality_text = f"val loss {100 * quality.mean:+.1f}% [{100 * quality.lo:+.1f}, {100 * quality.hi:+.1f}]"
    if quality.lo > tolerance:
        return f"worse: {quality_text}, beyond the +{tolerance:.0%} tolerance ({pct} interval)", None
    if quality.hi < -tolerance:
        return f"not the same training: {quality_text}, better by more than {tolerance:.0%}; check why", None
    equal = -tolerance <= quality.lo and quality.hi <= tolerance
    decided_speed = speed.lo > 0 or speed.hi < 0
    if equal and decided_speed:
        side = "faster" if speed.lo > 0 else "slower"
        return f"{side} at equal quality: {speed_text}, {quality_text} ({pct} intervals, {n} seeds)", None
    reasons, needs = [], []
    if not decided_speed:
        reasons.append(f"speed-up {speed_text} contains 1")
        needs.append(seeds_needed(speed, 0.0, confidence))
    if not equal:
        reasons.append(f"{quality_text} crosses the +-{tolerance:.0%} tolerance")
        needs.append(seeds_needed(quality, tolerance, confidence, inside=True))
    if any(need is None for need in needs):
        return f"undecided: {'; '.join(reasons)}; more seeds would not decide it at this mean", None
    need = max(needs)
    more = f"about {need} paired seeds would decide it ({need - n} more)"
    return f"undecided: {'; '.join(reasons)}; {more}", need


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
