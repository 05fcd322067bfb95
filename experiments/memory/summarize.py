"""The memory study's table from its run directories (experiments/memory/run.sh): per level, the peak
RSS and process-tree PSS at the headline batch and the largest batch the finder fitted in the budget,
each as a ratio to the baseline's.
    python experiments/memory/summarize.py OUT_DIR > OUT_DIR/memory.md"""

import json
import sys
from pathlib import Path

GIB = 2**30


def main(out: Path) -> None:
    rows = {}
    for summary in sorted(out.glob("*_batch8/summary.json")):
        level = summary.parent.name.removesuffix("_batch8")
        at8 = json.loads(summary.read_text())
        largest = json.loads((out / f"{level}_largest" / "summary.json").read_text())
        finder = largest.get("batch_finder") or {}
        rows[level] = {
            "rss": at8["peak_rss_bytes"],
            "pss": at8["peak_tree_pss_bytes"],
            "step": at8["step_time_s"],
            "largest": finder.get("batch_size"),
            "budget": finder.get("budget_bytes"),
            "precision": at8["config"]["precision"]["dtype"],
        }
    base = rows["baseline"]
    print(f"Machine: {at8.get('machine', '?')}; budget per run {(base['budget'] or 0) / GIB:.2f} GiB\n")
    print(
        "| level | precision | step s (batch 8) | peak RSS GiB (vs baseline) "
        "| process tree PSS GiB (vs baseline) "
        "| largest batch in budget (vs baseline) |"
    )
    print("|---|---|---|---|---|---|")
    order = ["baseline", "basic", "advanced", "ultra"]
    for level, r in sorted(rows.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9):
        largest = f"{r['largest']} ({r['largest'] / base['largest']:.1f}x)" if r["largest"] else "-"
        print(
            f"| {level} | {r['precision']} | {r['step']:.2f} | "
            f"{r['rss'] / GIB:.2f} ({r['rss'] / base['rss']:.2f}) | "
            f"{r['pss'] / GIB:.2f} ({r['pss'] / base['pss']:.2f}) | {largest} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
