"""The comparison figure: throughput, step time, peak memory and loss curves, baseline beside the rest."""

import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402


def _loss_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("loss") is not None]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def plot_comparison(result: dict[str, Any], groups: list, out: Path) -> None:
    rows = result["rows"]
    labels = [r["config"] for r in rows]
    ticks = [textwrap.fill(label, 40) for label in labels]  # long override strings on several lines
    colors = ["tab:gray" if r["config"] == result["baseline"] else f"C{i}" for i, r in enumerate(rows)]
    fig, axes = plt.subplots(2, 2, figsize=(14, 4 + 1.2 * len(rows)))

    def bars(ax, key: str, title: str, scale: float = 1.0, spread: tuple[str, str] | None = None) -> None:
        values = [(r[key] or 0) / scale for r in rows]
        err = None
        if spread:
            lo = [
                max(0.0, v - (r[spread[0]] or v * scale) / scale) for v, r in zip(values, rows, strict=True)
            ]
            hi = [
                max(0.0, (r[spread[1]] or v * scale) / scale - v) for v, r in zip(values, rows, strict=True)
            ]
            err = [lo, hi]
        ax.barh(ticks, values, xerr=err, color=colors, capsize=4)
        ax.set_title(title)
        ax.invert_yaxis()
        for y, (v, r) in enumerate(zip(values, rows, strict=True)):
            note = f" {r['speedup']:.2f}x" if key == "samples_per_s" and r["speedup"] else ""
            ax.text(v, y, f" {v:.3g}{note}", va="center", fontsize=8)

    bars(
        axes[0, 0],
        "samples_per_s",
        "throughput (samples/s, median, min-max over seeds)",
        spread=("samples_per_s_min", "samples_per_s_max"),
    )
    bars(axes[0, 1], "step_time_s", "step time (s, median)")
    bars(axes[1, 0], "peak_rss_bytes", "peak memory (GiB, process tree RSS)", scale=2**30)
    ax = axes[1, 1]
    by_label = {g.config: g for g in groups}
    for label, color in zip(labels, colors, strict=True):
        for i, run in enumerate(by_label[label].runs):
            steps, losses = _loss_curve(run.path)
            ax.plot(steps, losses, color=color, alpha=0.8, lw=1, label=label if i == 0 else None)
    ax.set_title("train loss per logged step (each seed)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.suptitle(f"baseline: {result['baseline']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
