"""The comparison figure: throughput, step time, peak memory and loss curves, baseline beside the rest."""

import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from aamperf.files import write_atomic  # noqa: E402

PART_COLORS = plt.get_cmap("Set3")  # the parts of a run's time: pastels, apart from the configurations' C0-C9
# the loss curves' styles: the baseline's above the others (zorder; Line2D's default is 2) and dashed
OTHER_LINE = {"ls": "-", "lw": 1.0, "ms": 3, "alpha": 0.8, "zorder": 2}
BASELINE_LINE = {"ls": "--", "lw": 1.6, "ms": 4, "alpha": 1.0, "zorder": 3}


def duration_bars(ax, rows: list[dict[str, Any]], ticks: list[str]) -> None:
    """Each configuration's end to end as stacked parts (summary.json duration_parts_s, the median of
    each over its seeds): where the time went besides the steps (start-up, probes, compile in setup)."""
    names = list(dict.fromkeys(name for r in rows for name in r.get("duration_parts_s") or {}))
    ys, left = range(len(rows)), [0.0] * len(rows)
    for i, name in enumerate(names):
        widths = [(r.get("duration_parts_s") or {}).get(name, 0.0) for r in rows]
        ax.barh(ys, widths, left=left, color=PART_COLORS(i % PART_COLORS.N), label=name)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(ys, ticks)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first configuration on top, as in the other panels
    for y, (r, total) in enumerate(zip(rows, left, strict=True)):
        label = f" {total:.3g} s" if r.get("duration_parts_s") else " n/a"
        ax.text(total, y, label, va="center", fontsize=8)
    ax.margins(x=0.15)
    ax.set_title("where the time went\n(s from the start; each part's median)")  # inside the figure's edge
    if names:  # under the bars, which it would cover inside
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=5, frameon=False)


def plot_comparison(result: dict[str, Any], groups: list, out: Path) -> plt.Figure:
    """Seven panels: the two verdict intervals (speed-up, val-loss change), peak memory, MFU, the train
    loss per step, the val loss over wall time from the run's start (time to quality), and where each
    configuration's time went."""
    rows = result["rows"]
    labels = [r["config"] for r in rows]
    ticks = [textwrap.fill(label, 40) for label in labels]  # long override strings on several lines
    colors = ["tab:gray" if r["config"] == result["baseline"] else f"C{i}" for i, r in enumerate(rows)]
    lines = max(tick.count("\n") + 1 for tick in ticks)  # the tallest label: each row must hold it
    fig = plt.figure(figsize=(28, 4 + len(rows) * max(1.2, 0.5 * lines)))
    grid = fig.add_gridspec(2, 4)
    axes = np.array([[fig.add_subplot(grid[row, col]) for col in range(3)] for row in range(2)])

    def bars(ax, values: list[float | None], title: str, interval: tuple[list, list] | None = None) -> None:
        shown = [v or 0.0 for v in values]
        err = None
        if interval:  # asymmetric error bars from the interval's ends (none where there is no interval)
            lo = [
                max(0.0, v - lo) if lo is not None else 0.0 for v, lo in zip(shown, interval[0], strict=True)
            ]
            hi = [
                max(0.0, hi - v) if hi is not None else 0.0 for v, hi in zip(shown, interval[1], strict=True)
            ]
            err = [lo, hi]
        ax.barh(ticks, shown, xerr=err, color=colors, capsize=4)
        ax.set_title(title)
        ax.invert_yaxis()
        for y, (v, s) in enumerate(zip(values, shown, strict=True)):
            end = s + (err[1][y] if err else 0.0)  # past the whisker, not over it
            ax.text(end, y - 0.3, " n/a" if v is None else f" {v:.3g}", va="center", fontsize=8)
        ax.margins(x=0.15)  # room for the labels past the longest bar

    pct = f"{result.get('confidence', 0.95):.0%}"
    bars(
        axes[0, 0],
        [r["speedup"] for r in rows],
        f"speed-up (samples/s vs the same seed's baseline; geometric mean, {pct} interval)",
        ([r["speedup_lo"] for r in rows], [r["speedup_hi"] for r in rows]),
    )
    axes[0, 0].axvline(1.0, color="black", lw=0.8)
    scale = 100.0
    bars(
        axes[0, 1],
        [None if r["val_loss_delta"] is None else scale * r["val_loss_delta"] for r in rows],
        f"val loss change (% vs the same seed's baseline; mean, {pct} interval)",
        (
            [None if r["val_loss_delta_lo"] is None else scale * r["val_loss_delta_lo"] for r in rows],
            [None if r["val_loss_delta_hi"] is None else scale * r["val_loss_delta_hi"] for r in rows],
        ),
    )
    tolerance = scale * result["quality_tolerance"]
    axes[0, 1].axvspan(-tolerance, tolerance, color="tab:green", alpha=0.12, label="equal quality")
    axes[0, 1].legend(fontsize=7)
    bars(
        axes[0, 2],
        [None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**30 for r in rows],
        "peak memory (GiB, process tree PSS, median over seeds)",
    )
    bars(axes[1, 2], [r.get("mfu") for r in rows], "MFU (model FLOPs on the real ASVs / peak of the dtype)")
    duration_bars(fig.add_subplot(grid[:, 3]), rows, ticks)

    by_label = {g.config: g for g in groups}
    train_ax, val_ax = axes[1, 0], axes[1, 1]
    # the baseline's curves on top of the others (where the losses are equal, as they should be, a line
    # drawn later covers it), dashed and thicker, so the curves under them show through the gaps
    styles = [BASELINE_LINE if label == result["baseline"] else OTHER_LINE for label in labels]
    for label, color, style in zip(labels, colors, styles, strict=True):
        for run in by_label[label].runs:
            logged = [r for r in run.metrics if r.get("loss") is not None]
            steps, losses = [r["step"] for r in logged], [r["loss"] for r in logged]
            few = len(steps) < 20  # markers: a run that logged one point still shows it
            train_ax.plot(steps, losses, color=color, marker="o" if few else "", **style)
            points = [(t, v) for t, v in run.validations if t is not None]
            if points:
                val_ax.plot(*zip(*points, strict=True), color=color, marker="o", **style)
    for run in by_label[result["baseline"]].ok_runs:  # the quality every configuration is timed to
        if run.summary.get("val_loss") is not None:
            val_ax.axhline(run.summary["val_loss"], color="tab:gray", ls=":", lw=0.8)
    train_ax.set_title("train loss per logged step (each seed; the baseline dashed, on top)")
    train_ax.set_xlabel("step")
    val_ax.set_title("val loss over time from the run's start (dotted: the baseline's final, per seed)")
    val_ax.set_xlabel("seconds from the run's start")
    # one legend for the curves, below the panels: however many configurations, it covers none
    handles = [
        plt.Line2D([], [], color=color, marker="o", **style)
        for color, style in zip(colors, styles, strict=True)
    ]
    columns = min(len(labels), 3)
    fig.legend(handles, ticks, loc="lower center", ncol=columns, fontsize=7, frameon=False)
    legend_rows = sum(label.count("\n") + 1 for label in ticks[::columns])
    machines = result.get("machines") or {}
    where = next(iter(machines)) if len(machines) == 1 else f"{len(machines)} machines" if machines else ""
    title = f"baseline: {result['baseline']}" + (f"; measured on {where}" if where else "")
    overlapped = {run for o in result.get("overlaps") or [] for run in o["runs"]}
    if overlapped:  # the bars of runs that shared the machine's time: contention as much as configuration
        title += (
            f"\n{len(overlapped)} runs ran at the same time as another run: their speeds are not comparable"
        )
    fig.suptitle(title, color="tab:red" if overlapped else "black")
    height = fig.get_figheight()  # the legend's lines below, the title's above (tight_layout leaves it out)
    top = 1 - 0.2 * (title.count("\n") + 1) / height
    fig.tight_layout(rect=(0, min(0.4, 0.02 + 0.14 * legend_rows / height), 1, top))
    write_atomic(out, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return fig  # closed: its artists can still be inspected
