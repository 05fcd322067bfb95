"""Compare runs: `python -m aamperf.compare DIR [DIR ...]` -> comparison.{json,csv,md,png} in the first DIR.

Runs that differ only by seed form one configuration, each paired with the baseline's run of the same
seed on the same data; verdicts from bootstrap intervals over the pairs (`aamperf/report/`).
"""

import argparse
import math
import sys
from pathlib import Path

from aamperf.errors import UserError
from aamperf.interrupts import stop_at_once
from aamperf.report import find_runs, make_report, to_markdown
from aamperf.report.regression import check_regression, regression_table


def fraction(text: str) -> float:
    """ "5%" or "0.05" -> 0.05 (argparse type): a finite fraction >= 0."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction >= 0 like 5% or 0.05")
    return value


def main(argv: list[str] | None = None) -> None:
    """The report, or one `error:` line (exit 2); SIGTERM / SIGINT: one `interrupted:` line (143 / 130)."""
    with stop_at_once(
        "stopped before the whole report was written (each file is whole or absent): run it again"
    ):
        report(argv)


def build_parser() -> argparse.ArgumentParser:
    """compare's command line (the docs' commands are checked against it: tests/test_docs.py)."""
    parser = argparse.ArgumentParser(prog="python -m aamperf.compare", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run or multirun directories")
    parser.add_argument("--baseline", default="optim=baseline", help="override string of the baseline runs")
    parser.add_argument(
        "--quality-tolerance",
        type=fraction,
        default=0.02,
        help="val loss counted as equal within +-this (2%%)",
    )
    parser.add_argument(
        "--confidence", type=fraction, default=0.95, help="confidence level of the intervals (95%%)"
    )
    parser.add_argument("--out", type=Path, help="where the report goes (default: the first DIR)")
    parser.add_argument("--against", type=Path, help="a stored comparison.json to check for regressions")
    parser.add_argument(
        "--max-regression", type=fraction, default=0.05, help="allowed slow-down against --against (5%%)"
    )
    parser.add_argument(
        "--wandb-report", action="store_true", help="build a W&B report for the sweep's group (online only)"
    )
    return parser


def report(argv: list[str] | None) -> None:
    args = build_parser().parse_args(argv)
    missing = [d for d in args.dirs if not d.is_dir()]
    try:
        if missing:
            raise UserError(f"not a directory: {missing[0]}")
        if not 0 < args.confidence < 1:  # before --out is made: a mistake writes nothing
            raise UserError(f"--confidence {args.confidence} is not between 0 and 1; e.g. --confidence 95%")
        out = args.out or args.dirs[0]
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--out {out}: cannot create it ({exc.strerror}); choose another --out") from exc
        result = make_report(args.dirs, args.baseline, args.quality_tolerance, out, args.confidence)
        checks = check_regression(result, args.against, args.max_regression) if args.against else []
        if args.wandb_report:
            from aamperf.report.wandb_report import build_report  # wandb-workspaces only when asked for

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
