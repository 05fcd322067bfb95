"""A comparison row's verdict ("faster at equal quality" only when the speed-up interval lies above 1 and the
val-loss interval inside +-tolerance; otherwise what is undecided, and about how many paired seeds would
decide it) and what could make it say less than it seems (`validity`: failed runs, pairs that trained alike,
pairs timed beside other runs, pairs validated in batches of other sizes or over other passes)."""

from pathlib import Path
from typing import Any

from aamperf.report.paired import MIN_PAIRS, Interval, seeds_needed
from aamperf.report.runs import Group, Run, same_training


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
