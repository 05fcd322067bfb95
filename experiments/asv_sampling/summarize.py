"""The ASV sampling study's table (run.sh): each way's target R^2 and MAE on the validation samples, as
predicted by each run's model on whole sequences (mask=none), on its bases hidden as training hid them
(predict's default) and as the mean of several such passes, paired by seed with abundance's whole-sequence
predictions (what predict gave before it hid bases).
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


def runs(out: Path) -> dict[tuple[str, str, int], dict]:
    """{(way, reading, seed): {"r2", "mae"}} for each reading predict made ("whole", "1", "<passes>"), and
    {(way, "run", seed)}: the run's own last validation (val_target_r2, on its masked inputs)."""
    found = {}
    for run in sorted((out / "sweep").iterdir()):
        if not (run / "summary.json").is_file():
            continue
        summary = json.loads((run / "summary.json").read_text())
        way, seed = summary["config"]["data"]["asv_sampling"], summary["seed"]
        val_ids = (run / "val_samples.txt").read_text().split()
        for reading in (out / "predict" / run.name).iterdir():
            found[(way, reading.name, seed)] = scores(reading, val_ids)
        found[(way, "run", seed)] = {
            "r2": summary["val"]["val_target_r2"], "mae": summary["val"]["val_target_mae"],
            "forest_r2": summary["rf_baseline"]["val_target_r2"],
        }  # fmt: skip
    return found


def reading_name(reading: str) -> str:
    if reading == "whole":
        return "whole sequences (`mask=none`)"
    if reading == "run":
        return "the run's last validation (its masks)"
    if reading == "1":
        return "bases hidden as in training (`mask=run`, the default)"
    return f"the mean of {reading} draws (`passes={reading}`)"


def table(found: dict) -> str:
    """The markdown table: each (way, reading)'s medians over seeds and its paired change against
    abundance's whole-sequence predictions."""
    seeds = sorted({seed for *_, seed in found})
    readings = sorted({r for _, r, _ in found}, key=lambda r: {"whole": 0, "run": 1, "1": 2}.get(r, 3))
    lines = [
        "| way | predicted on | seeds | val R^2 (median) | R^2 change [95% interval] | val MAE (median) "
        "| MAE change [95% interval] |",
        "|---|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        for reading in readings:
            pairs = [
                (found[(way, reading, s)], found[("abundance", "whole", s)])
                for s in seeds
                if (way, reading, s) in found and ("abundance", "whole", s) in found
            ]
            if not pairs:
                continue
            cells = [f"`{way}`", reading_name(reading), str(len(pairs))]
            for metric in ("r2", "mae"):
                cells.append(f"{np.median([mine[metric] for mine, _ in pairs]):.3f}")
                if (way, reading) == ("abundance", "whole"):
                    cells.append("(the reference)")
                    continue
                iv = mean_interval([mine[metric] - base[metric] for mine, base in pairs], 0.95)
                cells.append(f"{iv.mean:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]")
            lines.append("| " + " | ".join(cells) + " |")
    forest = [found[("abundance", "run", s)]["forest_r2"] for s in seeds if ("abundance", "run", s) in found]
    lines.append(
        "\nChanges: paired by seed with `abundance` on whole sequences. A random forest on every rarefied "
        "ASV count (summary.json rf_baseline, on the samples the run's last validation read): val R^2 "
        f"{np.median(forest):.3f} (median)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(runs(Path(sys.argv[1]))))
