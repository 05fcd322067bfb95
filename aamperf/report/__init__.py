"""The comparison report: the runs (`runs.py`), their paired comparison and verdicts (`comparison.py`,
`paired.py`), its files (`render.py`, `plots.py`), the regression check (`regression.py`) and the W&B
report (`wandb_report.py`). `python -m aamperf.compare` is its command line; a multirun ends with it
(`aamperf/callbacks.py`)."""

from aamperf.report.comparison import compare, make_report
from aamperf.report.render import to_markdown, write_report
from aamperf.report.runs import Group, Run, find_runs, group_runs

__all__ = ["Group", "Run", "compare", "find_runs", "group_runs", "make_report", "to_markdown", "write_report"]
