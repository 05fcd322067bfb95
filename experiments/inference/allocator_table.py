"""The table of experiments/inference/allocator.sh: each level with tcmalloc against glibc's malloc
(allocator=null, freed blocks kept), paired by repeat (the two ran one after the other).

Per level and job: the benchmark's batch-1 and batch-32 p50 latency and the peak RSS of its process; the
plain command's wall time from launch (the restart included) and peak RSS (/usr/bin/time). A ratio is
glibc's figure over tcmalloc's (above 1: tcmalloc faster or smaller): geometric mean [95% bootstrap
interval] over the repeats.
Usage: python allocator_table.py OUT_DIR
"""

import json
import math
import re
import statistics
import sys
from pathlib import Path

from aamperf.report.paired import MIN_PAIRS, geometric, mean_interval

ALLOCATORS = ("tcmalloc", "null")


def read(stem: Path) -> dict | None:
    """One process's figures, or None where it did not finish."""
    timed = stem.with_name(stem.name + ".time")
    text = timed.read_text() if timed.is_file() else ""
    if "Exit status: 0" not in text or not (stem / "summary.json").is_file():
        return None
    clock = re.search(r"Elapsed \(wall clock\) time .*: (\S+)", text).group(1)
    summary = json.loads((stem / "summary.json").read_text())
    figures = {
        "wall_s": sum(float(x) * 60**i for i, x in enumerate(reversed(clock.split(":")))),
        "rss_mib": int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 1024,
        "allocator": summary["allocator"]["status"],
    }
    for size, f in summary.get("bench", {}).items():
        figures[f"p50_{size}_ms"] = 1e3 * f["p50_s"]
    return figures


def ratio(pairs: list[tuple[float, float]]) -> str:
    """glibc's over tcmalloc's, paired: geometric mean [interval], or the ratios themselves."""
    values = [glibc / tc for tc, glibc in pairs]
    if len(values) < MIN_PAIRS:
        return " / ".join(f"{v:.2f}x" for v in values) or "-"
    mean, lo, hi = geometric(mean_interval([math.log(v) for v in values], 0.95))
    return f"{mean:.2f}x [{lo:.2f}, {hi:.2f}]"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}]"


def main(out: Path) -> str:
    runs: dict[tuple[str, str, str], dict[int, dict]] = {}
    for stem in sorted(p for p in out.iterdir() if p.is_dir() and p.name.count("-") == 3):
        job, level, allocator, repeat = stem.name.split("-")
        if (figures := read(stem)) is not None:
            runs.setdefault((job, level, allocator), {})[int(repeat)] = figures
    figures_of = {"bench": ("p50_1_ms", "p50_32_ms", "rss_mib"), "files": ("wall_s", "rss_mib")}
    lines = []
    for job, keys in figures_of.items():
        heads = " | ".join(f"{k}: tcmalloc, glibc, glibc / tcmalloc" for k in keys)
        lines += [f"| {job} | level | {heads} |", "|---|---|" + "---|" * len(keys)]
        for level in dict.fromkeys(level for j, level, _ in runs if j == job):
            tc, glibc = runs.get((job, level, "tcmalloc"), {}), runs.get((job, level, "null"), {})
            paired = sorted(tc.keys() & glibc.keys())
            cells = []
            for k in keys:
                pairs = [(tc[r][k], glibc[r][k]) for r in paired]
                if not pairs:
                    cells.append("-")
                    continue
                a, b = spread([p[0] for p in pairs]), spread([p[1] for p in pairs])
                cells.append(f"{a}, {b}, {ratio(pairs)}")
            preloaded = sum(tc[r]["allocator"] == "applied" for r in paired)
            row = f"| {job} | {level} ({len(paired)} pairs, {preloaded} preloaded) | "
            lines.append(row + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
