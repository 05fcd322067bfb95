"""The comparison report's files: comparison.json, .csv, .md (the table) and .png (the figure)."""

import csv
import io
from pathlib import Path
from typing import Any

from aamperf.files import write_atomic, write_json_atomic


def fmt(value: Any, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:+.2f}"


def _ratio(value: float | None, lo: float | None, hi: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}x" + ("" if lo is None else f" [{lo:.2f}, {hi:.2f}]")


def _interval_pct(row: dict[str, Any]) -> str:
    lo, hi = row["val_loss_delta_lo"], row["val_loss_delta_hi"]
    return "" if lo is None else f" [{_pct(lo)}, {_pct(hi)}]"


def machine_lines(machines: dict[str, int]) -> list[str]:
    """Where the figures were measured (summary.json `machine`), and a warning where the runs come from
    more than one machine: a pair across two machines measures the machines as much as the configs."""
    if len(machines) == 1:
        return [f"Measured on {next(iter(machines))}.", ""]
    if not machines:
        return []
    each = "; ".join(f"{name}: {n} runs" for name, n in sorted(machines.items()))
    return [
        f"**Runs from {len(machines)} machines** ({each}): a speed-up of a run over a baseline run on "
        "another machine is the machines' difference as much as the configurations'. Compare the runs "
        "of one machine (`python -m aamperf.compare` on their directories alone).",
        "",
    ]


def overlap_lines(overlaps: list[dict[str, Any]]) -> list[str]:
    """A warning where runs of one machine ran at the same time: their timings shared its cores."""
    if not overlaps:
        return []
    runs = {run for o in overlaps for run in o["runs"]}
    first = max(overlaps, key=lambda o: o["shared_s"])
    a, b = (Path(run).name for run in first["runs"])
    return [
        f"**{len(runs)} runs ran at the same time as another run on one machine** (e.g. `{a}` and `{b}` "
        f"shared {first['shared_s']:.0f} s on {first['host']}): their timings measure the contention as much "
        "as the configurations, and their verdicts stay undecided. A launcher that starts jobs at once "
        "(`hydra/launcher=submitit_local`, joblib) does this; time configurations one job at a time "
        "(Hydra's basic launcher, the default).",
        "",
    ]


def load_lines(under_load: list[dict[str, Any]]) -> list[str]:
    """A warning where runs were timed while other processes used their cores (summary.json loop_load)."""
    if not under_load:
        return []
    first = under_load[0]
    return [
        f"**Runs timed while other processes used their cores: {len(under_load)}** (e.g. "
        f"`{Path(first['run']).name}`: {first['reason']}): their speed figures include that contention; "
        "run them again on a quiet machine to compare them.",
        "",
    ]


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where runs have a target: each configuration's headline target figure beside the random forest's on
    the same samples (summary.json rf_baseline), the reference a fine-tuned model is read against."""
    shown = [r for r in rows if r.get("target_figure")]
    if not shown:
        return []
    each = "; ".join(
        f"`{r['config']}` {r['target_figure']} {fmt(r['target_value'])} (random forest {fmt(r['rf_value'])})"
        for r in shown
    )
    return [
        "",
        "Target, median over seeds of each run's last validation, beside a random forest on the same "
        f"samples' ASV counts (metrics.rf_baseline; n/a: none fitted): {each}.",
    ]


def early_stop_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Configurations whose runs stopped early (trainer.patience): their figures are of fewer steps."""
    shown = [r for r in rows if r.get("stopped_early")]
    if not shown:
        return []
    each = "; ".join(f"`{r['config']}`: {r['stopped_early']}" for r in shown)
    return ["", f"Stopped early (trainer.patience), before trainer.max_steps: {each}."]


def same_training_lines(found: list[dict[str, Any]]) -> list[str]:
    """Configurations that trained the same way as each other (the same phases applied after `auto`, the
    rest of the config equal): the difference between their rows is the machine's."""
    if not found:
        return []
    each = "; ".join(
        f"`{f['configs'][0]}` as `{f['configs'][1]}` ({_ratio(f['speed_ratio'], None, None)} its samples/s, "
        f"{f['seeds']} paired seeds)"
        for f in found
    )
    return [
        "",
        f"Trained the same way (their phases applied the same choices, the rest of their configs equal): "
        f"{each}. The difference between such rows is the machine's (its load, the run order), not the "
        "configurations'.",
    ]


def to_markdown(result: dict[str, Any]) -> str:
    header = [
        "config",
        "seeds (paired)",
        "samples/s",
        "speed-up [interval]",
        "step s (speed-up)",
        "time to quality s (speed-up [interval])",
        "first step s",
        "compile s (recompiles)",
        "auto s (max)",
        "data wait",
        "MFU / HFU",
        "peak memory GiB (ratio)",
        "val loss (delta % [interval])",
        "verdict",
    ]
    confidence = result.get("confidence", 0.95)
    lines = [
        f"Baseline: `{result['baseline']}`. Each run is paired with the baseline run of its seed on the same "
        f"data; speed-ups are geometric means of the per-seed ratios, val-loss deltas means of the per-seed "
        f"changes, each with a {confidence:.0%} bootstrap interval. Time to quality: seconds from the run's "
        f"start (its process's launch; a sweep job's own start) until the val loss is within the tolerance "
        f"of the same seed's baseline final val loss (median over seeds; reached in k/n seeds). Equal "
        f"quality: the "
        f"val-loss interval inside +-{result['quality_tolerance']:.0%}. Step s: mean over the timed steps. "
        f"Peak memory: the process tree's PSS, summed over the ranks of a run on several (the main "
        f"process's VmHWM for runs without that figure). "
        f"Auto s: seconds a run spent measuring to decide its `auto` options (median, and the most one "
        f"seed's run spent: the first run on a device pays the probes, later runs read their cache); "
        f"time to quality and first step include it. Recompiles: graphs compiled for new shapes while "
        f"training (median), whose time is inside the compile s and the timed steps.",
        "",
        *machine_lines(result.get("machines") or {}),
        *overlap_lines(result.get("overlaps") or []),
        *load_lines(result.get("under_load") or []),
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in result["rows"]:
        rss = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**30
        delta = r["val_loss_delta"]
        cells = [
            f"`{r['config']}`",
            f"{len(r['seeds'])} ({len(r['paired_seeds'])})",
            fmt(r["samples_per_s"]),
            _ratio(r["speedup"], r["speedup_lo"], r["speedup_hi"]),
            f"{fmt(r['step_time_s'])} ({_ratio(r['step_time_speedup'], None, None)})",
            f"{fmt(r['time_to_quality_s'], '.1f')} ({r['time_to_quality_reached']}) "
            + _ratio(*(r[f"time_to_quality_speedup{end}"] for end in ("", "_lo", "_hi"))),
            fmt(r["time_to_first_step_s"], ".1f"),
            f"{fmt(r['compile_time_s'], '.1f')} ({fmt(r.get('recompiles'), 'g')})",
            "n/a" if r.get("auto_s") is None else f"{r['auto_s']:.1f} ({r['auto_s_max']:.1f})",
            "n/a" if r["data_wait_frac"] is None else f"{100 * r['data_wait_frac']:.1f}%",
            f"{fmt(r['mfu'], '.3f')} / {fmt(r['hfu'], '.3f')}",
            f"{fmt(rss, '.2f')} ({fmt(r['peak_rss_ratio'], '.2f')})",
            f"{fmt(r['val_loss'], '.4f')} ({_pct(delta)}{_interval_pct(r)})",
            r["verdict"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += target_lines(result["rows"])
    lines += early_stop_lines(result["rows"])
    lines += same_training_lines(result.get("same_trainings") or [])
    return "\n".join(lines) + "\n"


def write_report(result: dict[str, Any], groups: list, out: Path) -> None:
    """Every report file into `out`; `groups` (compare.Group) give the figure its loss curves."""
    write_json_atomic(out / "comparison.json", result)
    lists = ("seeds", "paired_seeds", "errors")
    columns = [k for k in result["rows"][0] if k not in lists] + list(lists)
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=columns)
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow(
            {
                **row,
                "seeds": " ".join(map(str, row["seeds"])),
                "paired_seeds": " ".join(map(str, row["paired_seeds"])),
                "errors": " | ".join(row["errors"]),
            }
        )
    write_atomic(out / "comparison.csv", table.getvalue())
    write_atomic(out / "comparison.md", to_markdown(result))
    from aamperf.report.plots import plot_comparison  # matplotlib only when a report is drawn

    plot_comparison(result, groups, out / "comparison.png")
