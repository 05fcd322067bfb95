"""The data_scale study's table from its run directories (experiments/data_scale/run.sh): per UniFrac
mode and n, time to first step (cold: store or matrix built; warm: from the cache), peak RSS and
samples/s, and how the cold start-up grows between sizes (the exponent k of t ~ n^k).
    python experiments/data_scale/summarize.py OUT_DIR > OUT_DIR/data_scale.md"""

import json
import math
import re
import sys
from pathlib import Path

MIB = 2**20


def main(out: Path) -> None:
    runs = {}
    for path in out.glob("*_n*_*/summary.json"):
        mode, n, temp = re.fullmatch(r"(\w+)_n(\d+)_(cold|warm)", path.parent.name).groups()
        runs[mode, int(n), temp] = json.loads(path.read_text())
    machine = next(iter(runs.values())).get("machine", "?")  # CPU model, flags, cores
    shapes = "model aam_tiny, batch 16, 20 steps; data: data=simulated at its defaults but n"
    print(f"Machine: {machine}; {shapes}\n")
    print(
        "| UniFrac | n | time to first step, cold s | growth from the n before | warm s "
        "| peak RSS MiB (cold / warm) | samples/s (warm) | status |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("batch", "precomputed"):
        before = None
        for n in sorted(n for m, n, t in runs if m == mode and t == "cold"):
            cold, warm = runs[mode, n, "cold"], runs.get((mode, n, "warm"), {})
            t = cold.get("time_to_first_step_s")
            growth = "-"
            if before and t:
                growth = f"n^{math.log(t / before[1]) / math.log(n / before[0]):.2f}"
            before = (n, t)
            rss = "/".join(
                f"{r['peak_rss_bytes'] / MIB:.0f}" for r in (cold, warm) if r.get("peak_rss_bytes")
            )
            sps = warm.get("samples_per_s")
            print(
                f"| {mode} | {n:,} | {fmt(t)} | {growth} | {fmt(warm.get('time_to_first_step_s'))} | {rss} | "
                f"{fmt(sps)} | {cold.get('status')}/{warm.get('status', '-')} |"
            )


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    main(Path(sys.argv[1]))
