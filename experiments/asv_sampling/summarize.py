"""The ASV sampling study's table (run.sh): each way's target R^2 and MAE on the validation samples, as
predicted by each run's model (draw 0; random also the mean of its passes), paired by seed with abundance's.
  python experiments/asv_sampling/summarize.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.metrics import mean_absolute_error, r2_score

from aamperf.report.paired import mean_interval

WAYS = ("abundance", "first", "random")


def scores(predict_dir: Path, val_ids: list[str]) -> dict[str, float]:
    """R^2 and MAE of targets.tsv's predictions on the validation samples (the run's val_samples.txt)."""
    table = pd.read_csv(predict_dir / "targets.tsv", sep="\t", index_col=0).loc[val_ids]
    return {
        "r2": r2_score(table["observed"], table["predicted"]),
        "mae": mean_absolute_error(table["observed"], table["predicted"]),
    }


def runs(out: Path) -> dict[tuple[str, int], dict]:
    """{(way, seed): {"r2", "mae", "val_loss", "forest_r2", and for random "r2_passes", "mae_passes"}}."""
    found = {}
    for run in sorted((out / "sweep").iterdir()):
        if not (run / "summary.json").is_file():
            continue
        summary = json.loads((run / "summary.json").read_text())
        way, seed = summary["config"]["data"]["asv_sampling"], summary["seed"]
        val_ids = (run / "val_samples.txt").read_text().split()
        row = {**scores(out / "predict" / run.name / "1", val_ids), "val_loss": summary["val_loss"]}
        row["forest_r2"] = summary["rf_baseline"]["val_target_r2"]
        passes = [p for p in (out / "predict" / run.name).iterdir() if p.name != "1"]
        for p in passes:
            row.update({f"{k}_passes": v for k, v in scores(p, val_ids).items()}, passes=int(p.name))
        found[(way, seed)] = row
    return found


def table(found: dict) -> str:
    """The markdown table: each way's medians over seeds and its paired change against abundance."""
    seeds = sorted({seed for _, seed in found})
    lines = [
        "| way | seeds (paired) | val R^2 (median) | R^2 change vs abundance [95% interval] "
        "| val MAE (median) | MAE change vs abundance [95% interval] |",
        "|---|---|---|---|---|---|",
    ]

    def row(name: str, way: str, suffix: str = "") -> str:
        pairs = [
            (found[(way, s)], found[("abundance", s)])
            for s in seeds
            if (way, s) in found and f"r2{suffix}" in found[(way, s)] and ("abundance", s) in found
        ]
        cells = [name, str(len(pairs))]
        for metric in ("r2", "mae"):
            cells.append(f"{np.median([mine[metric + suffix] for mine, _ in pairs]):.3f}")
            if way == "abundance" and not suffix:
                cells.append("-")
                continue
            iv = mean_interval([mine[metric + suffix] - base[metric] for mine, base in pairs], 0.95)
            cells.append(f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]")
        return "| " + " | ".join(cells) + " |"

    for way in WAYS:
        lines.append(row(f"`{way}` (draw 0)" if way == "random" else f"`{way}`", way))
    passes = sorted({r["passes"] for r in found.values() if "passes" in r})
    if passes:
        lines.append(
            row(f"`random`, the mean of {passes[0]} draws (`passes={passes[0]}`)", "random", "_passes")
        )
    forest = [found[("abundance", s)]["forest_r2"] for s in seeds if ("abundance", s) in found]
    lines.append(
        "\nA random forest on every rarefied ASV count (summary.json rf_baseline, on the samples the run's "
        f"last validation read): val R^2 {np.median(forest):.3f} (median)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(runs(Path(sys.argv[1]))))
