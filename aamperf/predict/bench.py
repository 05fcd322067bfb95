"""`bench.enabled=true`: inference latency per batch size (p50 / p95 over `bench.calls` calls after
`bench.warmup`), throughput and peak memory, at the composed level; and after a sweep of levels
(`python -m aamperf.predict -m inference=baseline,fast,int8 bench.enabled=true`) the comparison report:
comparison.{json,md,png} in the sweep directory, with the fastest level that keeps quality named."""

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from aamperf.device import sync
from aamperf.files import write_atomic, write_json_atomic
from aamperf.metrics.monitor import peak_rss, release_freed_memory, reset_peak_rss
from aamperf.predict.config import DEFAULT_MAX_PROBABILITY_DIFF
from aamperf.predict.levels import forward
from aamperf.report.runs import Run, canonical, find_runs


def latencies(model, autocast, batches: dict[int, dict], cfg: DictConfig) -> dict[str, dict[str, float]]:
    """{batch size: p50 / p95 seconds a call, samples/s at the p50, peak RSS while it ran, and on a GPU
    the CUDA allocator's peak (None elsewhere)}."""
    result = {}
    for size, batch in batches.items():
        device = batch["tokens"].device
        release_freed_memory()
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(cfg.bench.warmup):
            forward(model, batch, autocast)
        times = []
        for _ in range(cfg.bench.calls):
            start = time.perf_counter()
            forward(model, batch, autocast)
            sync(device)  # host sync: a GPU call returns once its kernels are queued, not done (no-op on CPU)
            times.append(time.perf_counter() - start)
        p50, p95 = statistics.median(times), statistics.quantiles(times, n=20)[-1]
        result[str(size)] = {
            "p50_s": p50,
            "p95_s": p95,
            "samples_per_s": size / p50,
            "peak_rss_bytes": peak_rss(),
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        }
    return result


def keeps_quality(
    summary: dict[str, Any],
    min_cosine: float,
    max_target_mae_std: float,
    max_probability_diff: float = DEFAULT_MAX_PROBABILITY_DIFF,
) -> bool:
    """The level's embeddings and target agree with the fp32 eager model's within the bench's bounds: a
    regression's target within `max_target_mae_std` of its scale (the model's units: target standard
    deviations for a zscore), a classification's probabilities each within `max_probability_diff`."""
    q = summary.get("quality") or {}
    if "target_probability_max_diff" in q:
        target_kept = q["target_probability_max_diff"] <= max_probability_diff
    elif "target_mae_scale" in q:
        target_kept = q["target_mae_scale"] <= max_target_mae_std
    else:  # a summary written before: its target_mae in own units, the scale as `std` (or `scale`)
        target = summary.get("target") or {}
        scale = target.get("scale") or target.get("std") or 1.0
        target_kept = q.get("target_mae", 0) <= max_target_mae_std * scale
    return q.get("embedding_cosine_min", 0) >= min_cosine and target_kept


# a job's overrides that say nothing about its level: not part of a row's label
UNLABELLED = ("run=", "inference=", "bench.", "progress=", "hydra.", "device=", "probe.", "quality_samples=")


def row_labels(runs: list[Run]) -> list[str]:
    """Each job's level, and the overrides that set it apart from the sweep's other jobs of that level
    (`fast aam_ops.unmask_full_length=true`): two jobs of one level are two rows, not one name twice."""
    keys = [[canonical(o) for o in run.overrides if not o.startswith(UNLABELLED)] for run in runs]
    labels = []
    for run, key in zip(runs, keys, strict=True):
        level = run.summary["inference"]
        others = [k for r, k in zip(runs, keys, strict=True) if r.summary["inference"] == level]
        common = set.intersection(*(set(k) for k in others))
        labels.append(" ".join([level, *(o for o in key if o not in common)]))
    return labels


def report(sweep_dir: Path, cfg: DictConfig) -> dict[str, Any]:
    """The levels of a benchmark sweep side by side: latency and speed-up per batch size over the sweep's
    inference=baseline (its first job without one), peak memory, quality; the fastest row at the largest
    batch that keeps quality."""
    runs = [run for run in find_runs([sweep_dir], predictions=True) if run.summary.get("bench")]
    if not runs:
        raise ValueError(f"no benchmark summary under {sweep_dir} (bench.enabled=true)")
    labels = row_labels(runs)
    base = next((i for i, r in enumerate(runs) if r.summary["inference"] == "baseline"), 0)
    bounds = {
        "min_cosine": cfg.bench.min_cosine,
        "max_target_mae_std": cfg.bench.max_target_mae_std,
        "max_probability_diff": cfg.bench.get("max_probability_diff", DEFAULT_MAX_PROBABILITY_DIFF),
    }
    rows = []
    for run, label in zip(runs, labels, strict=True):
        summary = run.summary
        row = {
            "label": label,
            "inference": summary["inference"],
            "keeps_quality": keeps_quality(summary, **bounds),
        }
        row["quality"] = summary.get("quality")
        for size, figures in summary["bench"].items():
            row[size] = dict(figures)
            row[size]["speedup"] = runs[base].summary["bench"][size]["p50_s"] / figures["p50_s"]
        rows.append(row)
    largest = max(runs[0].summary["bench"], key=int)
    good = [r for r in rows if r["keeps_quality"]]
    fastest = min(good, key=lambda r: r[largest]["p50_s"])["label"] if good else None
    return {
        "device": runs[0].summary.get("cpu") or runs[0].summary["device"],
        "rows": rows,
        "reference": labels[base],
        "fastest_keeping_quality": fastest,
        "quality_bounds": bounds,
    }


def to_markdown(result: dict[str, Any]) -> str:
    sizes = [k for k in result["rows"][0] if k.isdigit()]
    reference = result["reference"]
    has_baseline = any(row["inference"] == "baseline" for row in result["rows"])
    head = (
        ["level"]
        + [f"batch {s}: p50 / p95 ms (x {'baseline' if has_baseline else 'first'})" for s in sizes]
        + ["peak RSS MiB", "cosine min", "target MAE", "keeps quality"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [row["label"]]
        for s in sizes:
            f = row[s]
            cells.append(
                f"{1e3 * f['p50_s']:.3g} / {1e3 * f['p95_s']:.3g} ({f.get('speedup', float('nan')):.2f}x)"
            )
        q = row["quality"] or {}
        cells += [
            f"{max(row[s]['peak_rss_bytes'] for s in sizes) / 2**20:.0f}",
            f"{q.get('embedding_cosine_min', float('nan')):.6f}",
            target_difference(q),
            "yes" if row["keeps_quality"] else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if not has_baseline:
        lines.append(f"Speed-ups over the first row ({reference}): the sweep has no inference=baseline.")
    elif reference != "baseline":  # baseline jobs that differ: the first of them
        lines.append(f"Speed-ups over {reference}, the sweep's first inference=baseline.")
    largest, fastest = max(sizes, key=int), result["fastest_keeping_quality"]
    lines.append(f"Fastest level that keeps quality (at batch {largest}): {fastest}; on {result['device']}")
    return "\n".join(lines) + "\n"


def target_difference(quality: dict) -> str:
    """The report's target cell: a regression's MAE in its own units, a classification's largest
    difference of a class probability."""
    if "target_probability_max_diff" in quality:
        return f"p diff {quality['target_probability_max_diff']:.3g}"
    return f"{quality.get('target_mae', float('nan')):.3g}"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [k for k in result["rows"][0] if k.isdigit()]
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.2), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        names = [r["label"] for r in result["rows"]]
        p50 = [1e3 * r[size]["p50_s"] for r in result["rows"]]
        p95 = [1e3 * r[size]["p95_s"] for r in result["rows"]]
        colors = ["tab:green" if r["keeps_quality"] else "tab:red" for r in result["rows"]]
        ax.bar(names, p50, color=colors, label="p50")
        ax.scatter(names, p95, color="black", marker="_", s=200, label="p95", zorder=3)
        ax.set_title(f"batch {size}: latency per call (ms)")
        ax.legend()
    fig.suptitle(f"inference levels on {result['device']} (green: keeps quality)")
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


class BenchReport(Callback):
    """After a predict sweep with bench.enabled=true: comparison.{json,md,png} in the sweep directory."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not config.bench.enabled or not sweep_dir.is_dir():
            return
        try:
            result = report(sweep_dir, config)
        except ValueError as exc:
            print(f"error: no benchmark report: {exc}", file=sys.stderr)
            sys.exit(1)
        write_json_atomic(sweep_dir / "comparison.json", result)
        write_atomic(sweep_dir / "comparison.md", to_markdown(result))
        plot(result, sweep_dir / "comparison.png")
        print(to_markdown(result))
        print(f"report: {sweep_dir / 'comparison.md'}, {sweep_dir / 'comparison.png'}")
