"""The W&B dashboard of a sweep: a report (wandb-workspaces) with the comparison panels for its group.

Built by `python -m aamperf.compare DIR --wandb-report`. It needs W&B online: an API key, and the
sweep's runs synced. Offline, it says what to do instead and builds nothing.
"""

import os
import sys
from typing import Any

from omegaconf import OmegaConf

from aamperf.errors import UserError
from aamperf.loggers import wandb_mode
from aamperf.report.runs import Run

PANELS = [  # (title, metric, kind): what a performance engineer looks at first
    ("throughput (samples/s)", "samples_per_s", "bar"),
    ("step time (s)", "step_time_s", "bar"),
    ("peak memory (bytes)", "peak_rss_bytes", "bar"),
    ("MFU", "mfu", "bar"),
    ("train loss", "train/loss", "line"),
    ("samples/s over training", "perf/samples_per_s", "line"),
    ("memory over training", "mem/rss_bytes", "line"),
]


def wandb_runs(runs: list[Run]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The logger settings of these runs and the W&B info each recorded in summary.json."""
    infos = [i for r in runs for i in r.summary.get("logger") or [] if i.get("backend") == "wandb"]
    if not infos:
        raise UserError("--wandb-report: these runs were not logged to W&B; run the sweep with logger=wandb")
    groups = {i.get("group") for i in infos}
    if len(groups) != 1 or None in groups:
        raise UserError(
            f"--wandb-report: the runs belong to W&B groups {sorted(map(str, groups))}; pass one sweep"
        )
    settings = next(r.summary["config"]["logger"] for r in runs if r.summary.get("logger"))
    return settings, infos


def build_report(result: dict[str, Any], runs: list[Run]) -> str | None:
    """Save the report and return its URL, or say why it cannot be built here and return None."""
    settings, infos = wandb_runs(runs)
    group = infos[0]["group"]
    run_dirs = sorted({i["dir"].rsplit("/files", 1)[0] for i in infos})  # .../wandb/offline-run-*
    parent = os.path.commonpath(run_dirs)
    sync = " ".join(f"'{d}'" for d in run_dirs) if len(run_dirs) < 3 else f"'{parent}'/*/wandb/offline-run-*"
    if wandb_mode(OmegaConf.create({"logger": settings})) != "online":
        print(
            "W&B is offline here (no API key, or logger.mode is not online): no report built. "
            "The local report is written; to build the dashboard: wandb login, then "
            f"wandb sync {sync}, then rerun with --wandb-report.",
            file=sys.stderr,
        )
        return None
    unsynced = [i for i in infos if i.get("mode") != "online"]
    if unsynced:
        print(f"W&B: {len(unsynced)} runs were logged offline; wandb sync {sync} first", file=sys.stderr)
        return None
    report = make_report(result, settings, group)
    report.save()
    return report.url


def make_report(result: dict[str, Any], settings: dict[str, Any], group: str):
    """The report (not saved): the verdicts, then bar and line panels of the sweep's runs by job type."""
    import wandb_workspaces.reports.v2 as wr

    runset = wr.Runset(
        entity=settings.get("entity") or "", project=settings["project"], filters=f"Group = '{group}'"
    )
    panels = [
        wr.BarPlot(title=title, metrics=[metric], groupby="JobType")
        if kind == "bar"
        else wr.LinePlot(title=title, x="Step", y=[metric], groupby="JobType")
        for title, metric, kind in PANELS
    ]
    rows = "\n".join(f"- `{r['config']}`: {r['verdict']}" for r in result["rows"])
    return wr.Report(
        project=settings["project"],
        title=f"aamperf: {group}",
        description=f"Baseline {result['baseline']} against each configuration of sweep {group}.",
        blocks=[
            wr.H1(f"Sweep {group}"),
            wr.MarkdownBlock(text=f"Baseline: `{result['baseline']}`.\n\n{rows}"),
            wr.PanelGrid(runsets=[runset], panels=panels),
        ],
        **({"entity": settings["entity"]} if settings.get("entity") else {}),
    )
