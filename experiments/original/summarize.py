"""The side-by-side table of experiments/original/run.sh, paired by seed: speed, end to end, memory, quality.

Steady state: the median step time over the steps after the first SKIP (warm-up and compilation) of each
run. Each configuration is paired with the original's default (and its fastest flags) seed by seed, both
run one after the other on the same machine, data and validation samples; a ratio's mean is geometric with
a 95% bootstrap interval over the seeds, the val-loss change a relative one (aamperf.report.paired, as
`aamperf-compare` decides). Quality: the loss over the seed's validation samples after the run's one epoch.
Usage: python summarize.py OUT_DIR   (run.sh's OUT: runs/seed<N>/<configuration>/, lscpu.txt)
"""

import json
import math
import re
import statistics
import sys
from pathlib import Path

from aamperf.report.paired import MIN_PAIRS, geometric, mean_interval

SKIP = 3
ORDER = [
    "original-default",
    "original-fastest",
    "original-default-tcmalloc",
    "original-fastest-tcmalloc",
    "baseline",
    "baseline-tcmalloc",
    "basic",
    "basic-tcmalloc",
    "advanced",
    "ultra",
]
REFERENCES = ["original-default", "original-fastest", "original-fastest-tcmalloc"]
TOLERANCE = 0.02  # compare.quality_tolerance's default: equal quality within +-2% of the val loss
CONFIDENCE = 0.95


def read_run(run: Path) -> dict | None:
    """A finished run's figures, or None (not run, still running, or stopped before its first step)."""
    text = (run / "time.txt").read_text() if (run / "time.txt").is_file() else ""
    if "Elapsed" not in text or "Exit status: 0" not in text:
        return None
    clock = re.search(r"Elapsed \(wall clock\) time .*: (\S+)", text).group(1)
    wall = sum(float(x) * 60**i for i, x in enumerate(reversed(clock.split(":"))))
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    if (run / "steps.json").is_file():  # the original, timed by experiments/gpu_scale/time_original.py
        r = json.loads((run / "steps.json").read_text())
        steps, val_loss = r["step_times_s"], r["val_losses"][-1]
    else:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step_time_s"] for r in rows if "step_time_s" in r]  # metrics.log_every=1: every step
        val_loss = json.loads((run / "summary.json").read_text())["val_loss"]
    load = [float(line.split()[0]) for line in (run / "loadavg").read_text().splitlines()]
    return {
        "step_s": statistics.median(steps[SKIP:]),
        "wall_s": wall,
        "rss_gib": rss_kib / 2**20,
        "val_loss": val_loss,
        "load": load,
    }


def read_runs(out: Path) -> dict[str, dict[int, dict]]:
    """configuration -> seed -> figures, of the runs that finished."""
    runs: dict[str, dict[int, dict]] = {}
    for seed_dir in sorted(out.glob("runs/seed*"), key=lambda p: int(p.name[4:])):
        for cfg in ORDER:
            figures = read_run(seed_dir / cfg)
            if figures is not None:
                runs.setdefault(cfg, {})[int(seed_dir.name[4:])] = figures
    return runs


def ratio(values: list[float]) -> str:
    """Paired ratios as their geometric mean [95% interval], or the one ratio, or '-'."""
    if not values:
        return "-"
    if len(values) < MIN_PAIRS:
        return " / ".join(f"{v:.2f}" for v in values) + f"x ({len(values)} seed{'s' * (len(values) > 1)})"
    mean, lo, hi = geometric(mean_interval([math.log(v) for v in values], CONFIDENCE))
    return f"{mean:.2f}x [{lo:.2f}, {hi:.2f}]"


def quality(changes: list[float]) -> str:
    """The relative val-loss changes against the original's default: mean [interval] and what they say."""
    if len(changes) < MIN_PAIRS:
        n = len(changes)
        return " / ".join(f"{100 * c:+.1f}%" for c in changes) + f" (undecided: {n} seed{'s' * (n > 1)})"
    i = mean_interval(changes, CONFIDENCE)
    text = f"{100 * i.mean:+.1f}% [{100 * i.lo:+.1f}, {100 * i.hi:+.1f}]"
    if i.hi < -TOLERANCE:
        return f"{text}: better"
    if i.hi <= TOLERANCE:
        return f"{text}: {'equal' if i.lo >= -TOLERANCE else 'equal or better'}"
    return f"{text}: {'worse' if i.lo > TOLERANCE else 'undecided'}"


def spread(values: list[float], spec: str) -> str:
    """The median [min-max] of one figure over the seeds."""
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{med:{spec}}" + (f" [{lo:{spec}}-{hi:{spec}}]" if len(values) > 1 else "")


def against(cfg: str, seeds: dict[int, dict], reference: dict, name: str, key: str) -> str:
    """`key` of the reference configuration `name` over this one's, paired by seed."""
    pairs = [(r, reference[s]) for s, r in seeds.items() if s in reference]
    return "1" if cfg == name else ratio([o[key] / r[key] for r, o in pairs])


def to_markdown(runs: dict[str, dict[int, dict]]) -> str:
    ref, fast, best = (runs.get(name, {}) for name in REFERENCES)
    lines = [
        "| configuration | seeds | steady step s | speed x original default | speed x original fastest"
        " | speed x original fastest + tcmalloc | end to end s | end to end x original default"
        " | end to end x original fastest + tcmalloc | peak RSS GiB | val loss"
        " | val loss vs original default |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cfg in [c for c in ORDER if c in runs]:
        seeds = runs[cfg]

        d = [(r, ref[s]) for s, r in seeds.items() if s in ref]  # (this run, the original default's)
        cells = [
            cfg,
            ", ".join(str(s) for s in seeds),
            spread([r["step_s"] for r in seeds.values()], ".2f"),
            against(cfg, seeds, ref, REFERENCES[0], "step_s"),
            against(cfg, seeds, fast, REFERENCES[1], "step_s"),
            against(cfg, seeds, best, REFERENCES[2], "step_s"),
            spread([r["wall_s"] for r in seeds.values()], ".0f"),
            against(cfg, seeds, ref, REFERENCES[0], "wall_s"),
            against(cfg, seeds, best, REFERENCES[2], "wall_s"),
            spread([r["rss_gib"] for r in seeds.values()], ".2f"),
            spread([r["val_loss"] for r in seeds.values()], ".3f"),
            "-" if cfg == "original-default" else quality([r["val_loss"] / o["val_loss"] - 1 for r, o in d]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    loads = [x for seeds in runs.values() for r in seeds.values() for x in r["load"]]
    lines.append(
        "\nSeeds paired: each configuration against the original's of the same seed (same validation"
        f" samples, run one after the other). Steady step = median step time after the first {SKIP} of each"
        " run; figures of one configuration: median [min-max] over seeds; x = the original's step time (or"
        " end to end) over this one's (higher is faster), geometric mean"
        f" [{CONFIDENCE:.0%} bootstrap interval] over seeds; val loss vs the original's: mean relative"
        f" change [interval], equal within +-{TOLERANCE:.0%}. 1-minute load average"
        f" {min(loads):.1f}-{max(loads):.1f} before and after the runs."
    )
    return "\n".join(lines)


def main(args: list[str]) -> int:
    if len(args) != 1 or not (Path(args[0]) / "runs").is_dir():
        print("usage: python summarize.py OUT_DIR  (run.sh's OUT, holding runs/)", file=sys.stderr)
        return 2
    runs = read_runs(Path(args[0]))
    if not runs:
        print(f"error: no finished run under {args[0]}/runs/seed*/", file=sys.stderr)
        return 2
    print(to_markdown(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
