"""The regression check: each configuration's samples/s against a stored comparison.json
(`python -m aamperf.compare DIR --against old/comparison.json --max-regression 5%`)."""

import json
from pathlib import Path
from typing import Any

from aamperf.errors import UserError
from aamperf.report.render import fmt


def check_regression(
    result: dict[str, Any], stored_path: Path, max_regression: float
) -> list[dict[str, Any]]:
    """Each configuration's samples/s against the same configuration in a stored comparison.json.
    A row regresses when it is slower than the stored figure by more than `max_regression`."""
    try:
        stored = json.loads(stored_path.read_text())
        before = {row["config"]: row["samples_per_s"] for row in stored["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"--against {stored_path}: not a comparison.json of aamperf.compare ({exc}); "
            "pass the comparison.json of an earlier sweep"
        ) from exc
    checks = []
    for row in result["rows"]:
        old, new = before.get(row["config"]), row["samples_per_s"]
        change = new / old - 1 if old and new else None
        checks.append(
            {
                "config": row["config"],
                "stored_samples_per_s": old,
                "samples_per_s": new,
                "change": change,
                "regressed": change is not None and change < -max_regression,
            }
        )
    if not any(c["change"] is not None for c in checks):
        raise UserError(
            f"--against {stored_path}: no configuration of this report is in it; nothing to check"
        )
    return checks


def regression_table(checks: list[dict[str, Any]], max_regression: float) -> str:
    lines = [
        f"Regression check: slower than stored by more than {100 * max_regression:.1f}% fails.",
        "",
        "| config | stored samples/s | samples/s | change | result |",
        "|---|---|---|---|---|",
    ]
    for c in checks:
        outcome = "not in stored report" if c["change"] is None else "REGRESSED" if c["regressed"] else "ok"
        change = "n/a" if c["change"] is None else f"{100 * c['change']:+.1f}%"
        lines.append(
            f"| `{c['config']}` | {fmt(c['stored_samples_per_s'])} | {fmt(c['samples_per_s'])} | "
            f"{change} | {outcome} |"
        )
    return "\n".join(lines) + "\n"
