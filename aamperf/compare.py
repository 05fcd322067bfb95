"""Compare runs: `python -m aamperf.compare DIR [DIR ...]` -> comparison.{json,csv,md,png} in the first DIR.

Runs that differ only by seed form one configuration; each figure is the median over seeds with its
min-max spread. Ratios are configuration / baseline; a speed-up counts ("faster at equal quality")
only when its whole min-max interval lies above 1 and the validation loss is no worse than the
tolerance; a loss better by more than the tolerance is flagged too (not the same training).
"""

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from aamperf.errors import UserError
from aamperf.metrics.record import write_json_atomic

IGNORED_OVERRIDES = ("seed=", "hydra.", "trainer.progress=", "compare.", "logger.", "hparams_search=")


@dataclass
class Run:
    path: Path
    overrides: list[str]
    summary: dict[str, Any]

    @property
    def seed(self) -> Any:
        return self.summary.get("seed")


@dataclass
class Group:
    config: str
    runs: list[Run] = field(default_factory=list)

    def values(self, key: str) -> list[float]:
        return [r.summary[key] for r in self.ok_runs if isinstance(r.summary.get(key), int | float)]

    @property
    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.summary.get("status") == "completed"]

    def median(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.median(values) if values else None


def find_runs(dirs: list[Path]) -> list[Run]:
    runs = []
    for directory in dirs:
        for summary_path in sorted(Path(directory).rglob("summary.json")):
            overrides_path = summary_path.parent / ".hydra" / "overrides.yaml"
            overrides = (
                OmegaConf.to_container(OmegaConf.load(overrides_path)) if overrides_path.exists() else []
            )
            runs.append(Run(summary_path.parent, overrides or [], json.loads(summary_path.read_text())))
    return runs


def group_runs(runs: list[Run]) -> list[Group]:
    """Group by the overrides that are not the seed; label by those that differ between groups."""
    keys = [tuple(o for o in r.overrides if not o.startswith(IGNORED_OVERRIDES)) for r in runs]
    common = set.intersection(*(set(k) for k in keys)) if keys else set()
    groups: dict[str, Group] = {}
    for run, key in zip(runs, keys, strict=True):
        label = " ".join(o for o in key if o not in common) or f"optim={run.summary.get('optim')}"
        groups.setdefault(label, Group(label)).runs.append(run)
    return list(groups.values())


def pick_baseline(groups: list[Group], baseline: str) -> Group:
    """The group labelled `baseline`, or the only one whose overrides include all of its overrides."""
    matches = [g for g in groups if g.config == baseline]  # exact first: "optim=baseline" alone
    if not matches:
        wanted = set(baseline.split())
        matches = [g for g in groups if wanted <= set(g.config.split())]
    if not matches:
        matches = [g for g in groups if baseline == f"optim={g.runs[0].summary.get('optim')}"]
    if len(matches) != 1:
        names = ", ".join(f"'{g.config}'" for g in groups)
        raise UserError(
            f"compare.baseline={baseline!r} matches {len(matches)} configurations of {names}; "
            "name one of them with compare.baseline (--baseline for python -m aamperf.compare)"
        )
    return matches[0]


def ratio_interval(group: Group, base: Group, key: str) -> tuple[float | None, float | None, float | None]:
    """(median ratio, lowest, highest): the interval pairs the extremes, so it is never too narrow."""
    g, b = group.values(key), base.values(key)
    if not g or not b:
        return None, None, None
    return statistics.median(g) / statistics.median(b), min(g) / max(b), max(g) / min(b)


def compare(
    runs: list[Run], baseline: str = "optim=baseline", quality_tolerance: float = 0.02
) -> dict[str, Any]:
    groups = group_runs(runs)
    base = pick_baseline(groups, baseline)
    rows = []
    for group in groups:
        speedup, lo, hi = ratio_interval(group, base, "samples_per_s")
        step_ratio, step_lo, step_hi = ratio_interval(group, base, "step_time_s")
        rss = group.median("peak_rss_bytes"), base.median("peak_rss_bytes")
        val, base_val = group.median("val_loss"), base.median("val_loss")
        val_delta = val / base_val - 1 if val is not None and base_val else None
        train, base_train = group.median("train_loss"), base.median("train_loss")  # both at the last step
        row = {
            "config": group.config,
            "optim": group.runs[0].summary.get("optim"),
            "seeds": sorted(r.seed for r in group.ok_runs),
            "baseline_seeds": len(base.ok_runs),
            "samples_per_s": group.median("samples_per_s"),
            "samples_per_s_min": min(group.values("samples_per_s"), default=None),
            "samples_per_s_max": max(group.values("samples_per_s"), default=None),
            "speedup": speedup,
            "speedup_lo": lo,
            "speedup_hi": hi,
            "step_time_s": group.median("step_time_s"),
            "step_time_speedup": 1 / step_ratio if step_ratio else None,
            "compile_time_s": group.median("compile_time_s"),
            "time_to_first_step_s": group.median("time_to_first_step_s"),
            "mfu": group.median("mfu"),
            "data_wait_frac": group.median("data_wait_frac"),
            "peak_rss_bytes": rss[0],
            "peak_rss_ratio": rss[0] / rss[1] if None not in rss else None,
            "train_rss_growth_bytes": group.median("train_rss_growth_bytes"),
            "val_loss": val,
            "val_loss_delta": val_delta,
            "train_loss": train,
            "train_loss_delta": train / base_train - 1 if train is not None and base_train else None,
            "errors": [
                f"{r.path.name}: {r.summary.get('error')}" for r in group.runs if r not in group.ok_runs
            ],
        }
        row["verdict"] = verdict(row, group is base, quality_tolerance)
        rows.append(row)
    rows.sort(key=lambda r: (r["config"] != base.config, -(r["speedup"] or 0)))
    return {"baseline": base.config, "quality_tolerance": quality_tolerance, "rows": rows}


def verdict(row: dict[str, Any], is_baseline: bool, tolerance: float) -> str:
    if not row["seeds"]:
        errors = sorted({e.split(": ", 1)[-1] for e in row["errors"]})  # one line per distinct error
        return f"failed ({len(row['errors'])} runs): " + "; ".join(errors)
    if is_baseline:
        return "baseline"
    reasons = []
    if row["speedup_lo"] is None or row["speedup_lo"] <= 1:
        reasons.append(
            f"speed-up interval [{row['speedup_lo']:.2f}, {row['speedup_hi']:.2f}] is not above 1"
            if row["speedup_lo"] is not None
            else "no speed measured"
        )
    delta = row["val_loss_delta"]
    if delta is None:
        reasons.append("no validation loss to compare")
    elif delta > tolerance:
        reasons.append(f"val loss {100 * delta:+.1f}% worse (> {100 * tolerance:.0f}%)")
    if reasons:
        return "not counted: " + "; ".join(reasons)
    if delta < -tolerance:  # not a failure, but not the same training either: say so
        return f"faster, val loss {100 * delta:+.1f}% (better by more than {100 * tolerance:.0f}%: check why)"
    if min(len(row["seeds"]), row["baseline_seeds"]) < 2:
        return "faster at equal quality (one seed: no spread measured)"
    return "faster at equal quality"


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:+.2f}"


def to_markdown(result: dict[str, Any]) -> str:
    header = [
        "config",
        "seeds",
        "samples/s",
        "speed-up [min, max]",
        "step s (speed-up)",
        "first step s",
        "compile s",
        "data wait",
        "MFU",
        "peak RSS GiB (ratio)",
        "val loss (delta %)",
        "train loss (delta %)",
        "verdict",
    ]
    lines = [
        f"Baseline: `{result['baseline']}`. Median over seeds; speed-up interval = min-max over seed pairs.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in result["rows"]:
        rss = None if r["peak_rss_bytes"] is None else r["peak_rss_bytes"] / 2**30
        cells = [
            f"`{r['config']}`",
            str(len(r["seeds"])),
            _fmt(r["samples_per_s"]),
            "n/a"
            if r["speedup"] is None
            else f"{r['speedup']:.2f}x [{_fmt(r['speedup_lo'], '.2f')}, {_fmt(r['speedup_hi'], '.2f')}]",
            "n/a"
            if r["step_time_s"] is None
            else f"{r['step_time_s']:.3g} ({_fmt(r['step_time_speedup'], '.2f')}x)",
            _fmt(r["time_to_first_step_s"], ".1f"),
            _fmt(r["compile_time_s"], ".1f"),
            "n/a" if r["data_wait_frac"] is None else f"{100 * r['data_wait_frac']:.1f}%",
            _fmt(r["mfu"], ".3f"),
            f"{_fmt(rss, '.2f')} ({_fmt(r['peak_rss_ratio'], '.2f')})",
            f"{_fmt(r['val_loss'], '.4f')} ({_pct(r['val_loss_delta'])})",
            f"{_fmt(r['train_loss'], '.4f')} ({_pct(r['train_loss_delta'])})",
            r["verdict"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: dict[str, Any], runs: list[Run], out: Path) -> None:
    write_json_atomic(out / "comparison.json", result)
    columns = [k for k in result["rows"][0] if k not in ("seeds", "errors")] + ["seeds", "errors"]
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in result["rows"]:
            writer.writerow(
                {**row, "seeds": " ".join(map(str, row["seeds"])), "errors": " | ".join(row["errors"])}
            )
    (out / "comparison.md").write_text(to_markdown(result))
    from aamperf.plots import plot_comparison  # matplotlib only when a report is drawn

    plot_comparison(result, group_runs(runs), out / "comparison.png")


def fraction(text: str) -> float:
    """ "5%" or "0.05" -> 0.05 (argparse type)."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction like 5% or 0.05") from None


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
            f"| `{c['config']}` | {_fmt(c['stored_samples_per_s'])} | {_fmt(c['samples_per_s'])} | "
            f"{change} | {outcome} |"
        )
    return "\n".join(lines) + "\n"


def make_report(dirs: list[Path], baseline: str, quality_tolerance: float, out: Path) -> dict[str, Any]:
    """Find the runs under `dirs`, compare them and write the report files into `out`."""
    runs = find_runs(dirs)
    if not runs:
        raise UserError(f"no summary.json under {', '.join(map(str, dirs))}: nothing to compare")
    result = compare(runs, baseline, quality_tolerance)
    write_report(result, runs, out)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aamperf.compare", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run or multirun directories")
    parser.add_argument("--baseline", default="optim=baseline", help="override string of the baseline runs")
    parser.add_argument("--quality-tolerance", type=float, default=0.02)
    parser.add_argument("--out", type=Path, help="where the report goes (default: the first DIR)")
    parser.add_argument("--against", type=Path, help="a stored comparison.json to check for regressions")
    parser.add_argument(
        "--max-regression", type=fraction, default=0.05, help="allowed slow-down against --against (5%%)"
    )
    parser.add_argument(
        "--wandb-report", action="store_true", help="build a W&B report for the sweep's group (online only)"
    )
    args = parser.parse_args(argv)
    missing = [d for d in args.dirs if not d.is_dir()]
    try:
        if missing:
            raise UserError(f"not a directory: {missing[0]}")
        out = args.out or args.dirs[0]
        result = make_report(args.dirs, args.baseline, args.quality_tolerance, out)
        checks = check_regression(result, args.against, args.max_regression) if args.against else []
        if args.wandb_report:
            from aamperf.dashboard import build_report  # wandb-workspaces only when asked for

            url = build_report(result, find_runs(args.dirs))
            if url:
                print(f"W&B report: {url}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(to_markdown(result))
    print(f"report: {out / 'comparison.md'}, {out / 'comparison.png'}")
    if checks:
        print(regression_table(checks, args.max_regression))
        regressed = [c["config"] for c in checks if c["regressed"]]
        if regressed:
            print(
                f"error: slower than {args.against} by more than {args.max_regression:.1%}: "
                + ", ".join(regressed),
                file=sys.stderr,
            )
            sys.exit(1)


if __name__ == "__main__":
    main()
