"""The side-by-side table of experiments/original/run.sh: steady state, end to end, memory, losses.

Steady state: median step time over the steps after the first SKIP (warm-up and compilation), per
repeat; the table gives the median over repeats with the min-max, and the ratio to the original's
default taken within each repeat (the runs of a repeat ran one after another, under similar load).
Usage: python summarize.py RUNS_DIR
"""

import json
import re
import statistics
import sys
from pathlib import Path

SKIP = 3
ORDER = ["original-default", "original-fastest", "baseline"]
ORDER += ["basic", "advanced", "ultra"]


def steps_and_losses(run: Path) -> tuple[list[float], list[dict]]:
    if (run / "steps.json").is_file():  # the original, timed by time_original.py
        r = json.loads((run / "steps.json").read_text())
        return r["step_times_s"], r["losses"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]  # metrics.log_every=1: one line per step
    losses = [{"total": r["loss"], "unifrac": r["loss_unifrac"], "nuc": r["loss_nucleotide"]} for r in rows]
    return [r["step_time_s"] for r in rows], losses


def gnu_time(run: Path) -> tuple[float, float]:
    """(wall s, peak RSS GiB of the largest process) from /usr/bin/time -v."""
    text = (run / "time.txt").read_text()
    clock = re.search(r"Elapsed \(wall clock\) time .*: (\S+)", text).group(1)
    wall = sum(float(x) * 60**i for i, x in enumerate(reversed(clock.split(":"))))
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return wall, rss_kib / 2**20


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


runs_dir = Path(sys.argv[1])
repeats = sorted(p for p in runs_dir.iterdir() if p.is_dir())
data: dict[str, list[dict]] = {}
for rep in repeats:
    for cfg in ORDER:
        run = rep / cfg
        if "Elapsed" not in ((run / "time.txt").read_text() if (run / "time.txt").is_file() else ""):
            continue  # not run, or still running
        if not ((run / "steps.json").is_file() or (run / "metrics.jsonl").is_file()):
            continue  # stopped before its first step
        steps, losses = steps_and_losses(run)
        wall, rss = gnu_time(run)
        load = [float(line.split()[0]) for line in (run / "loadavg").read_text().splitlines()]
        data.setdefault(cfg, []).append(
            {
                "rep": rep.name,
                "step": statistics.median(steps[SKIP:]),
                "wall": wall,
                "rss": rss,
                "losses": losses,
                "load": load,
            }
        )

ref = {r["rep"]: r["step"] for r in data.get("original-default", [])}
print(
    "| configuration | steady step s | x original default (per repeat) | end to end s | peak RSS GiB |"
    " loss step 1: total / UniFrac / nucleotide | loss last step | 1-min load avg |"
)
print("|---|---|---|---|---|---|---|---|")
for cfg, rs in data.items():
    ratio = [ref[r["rep"]] / r["step"] for r in rs if r["rep"] in ref]
    first, last = rs[0]["losses"][0], rs[0]["losses"][-1]
    loads = [x for r in rs for x in r["load"]]
    print(
        f"| {cfg} | {spread([r['step'] for r in rs], '.2f')} | {spread(ratio, '.2f')}x |"
        f" {spread([r['wall'] for r in rs], '.0f')} | {spread([r['rss'] for r in rs], '.2f')} |"
        f" {first['total']:.3f} / {first['unifrac']:.3f} / {first['nuc']:.3f} | {last['total']:.3f} |"
        f" {min(loads):.1f}-{max(loads):.1f} |"
    )
print(
    f"\n{len(repeats)} repeat(s); steady state = median step time over steps {SKIP + 1}+ of each run;"
    " losses of the first repeat; x = original default's step time / this one's (higher is faster)."
)
