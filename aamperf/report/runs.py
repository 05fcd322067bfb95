"""The runs a report reads: each run directory's summary.json, overrides and metrics.jsonl, grouped into
configurations (runs that differ only by seed) and paired with the baseline's run of the same seed on
the same data (`data.seed`)."""

import datetime
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException

from aamperf.config import config_diff, flat
from aamperf.errors import UserError, one_line
from aamperf.files import read_json_lines

IGNORED_OVERRIDES = ("seed=", "hydra.", "trainer.progress=", "compare.", "logger.", "hparams_search=")
OVERLAP_SLACK_S = 1.0  # one job's end and the next one's start: clock round-off, no shared time


@dataclass
class Run:
    path: Path
    overrides: list[str]
    summary: dict[str, Any]

    @property
    def seed(self) -> Any:
        return self.summary.get("seed")

    @property
    def pair_key(self) -> tuple[Any, Any, Any]:
        """(data.seed, data.val_samples, seed): runs pair when they trained on the same data, split alike,
        from the same seed."""
        data = (self.summary.get("config") or {}).get("data") or {}
        return data.get("seed"), data.get("val_samples"), self.seed

    @cached_property
    def metrics(self) -> list[dict[str, Any]]:
        """The run's metrics.jsonl rows (none if it has no file; a line a crash cut short left out)."""
        return read_json_lines(self.path / "metrics.jsonl")

    @property
    def window(self) -> tuple[float, float] | None:
        """(start, end) in seconds since the epoch: summary.json's `ended_at` less its `duration_s`
        (None for a run from before `ended_at`)."""
        ended, duration = self.summary.get("ended_at"), self.summary.get("duration_s")
        if not isinstance(ended, str) or not isinstance(duration, int | float):
            return None
        try:
            end = datetime.datetime.fromisoformat(ended).timestamp()
        except ValueError:
            return None
        return end - duration, end

    @property
    def validations(self) -> list[tuple[float, float]]:
        """(elapsed_s from the run's start, val_loss) of each validation in metrics.jsonl, in order."""
        return [(r.get("elapsed_s"), r["val_loss"]) for r in self.metrics if r.get("val_loss") is not None]


# Config groups whose effect is the phase record in summary.json `phases` (an `auto` option and the
# choice it resolved to record the same thing), and keys that do not change the training at all.
PHASE_GROUPS = tuple(
    "precision compile attention dropout memory optimizer aam_ops system distributed dataloader".split()
)
BOOKKEEPING = tuple("optim seed logger compare search probe alerts trainer.progress data.cache_dir".split())


def applied(run: Run) -> dict[str, dict[str, Any]]:
    """What each phase applied: its record without the reason, the `auto` trial and measured figures,
    which differ between runs of the same choices."""
    phases = run.summary.get("phases") or {}
    return {
        name: {
            k: v
            for k, v in record.items()
            if k not in ("reason", "auto", "notes") and not isinstance(v, float)
        }
        for name, record in phases.items()
        if isinstance(record, dict)
    }


def same_training(run: Run, base: Run) -> bool:
    """Whether two runs trained the same way: their phases applied the same choices (e.g. `optim=ultra`
    whose `compile=auto` chose eager is `optim=advanced`) and the rest of their configs is equal."""
    if not run.summary.get("phases") or applied(run) != applied(base):
        return False
    config = (r.summary.get("config") or {} for r in (base, run))
    return not config_diff(*config, ignored=PHASE_GROUPS + BOOKKEEPING)


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


def core_ids(run: Run) -> set[int]:
    """The CPUs the run's loop could use (summary.json loop_load), none where it does not say."""
    return set((run.summary.get("loop_load") or {}).get("core_ids") or [])


def overlapping(runs: list[Run]) -> list[tuple[Run, Run, float]]:
    """(run, run, seconds shared) for runs of one host that ran at the same time on the same cores (a
    launcher that starts jobs at once: submitit_local, joblib; two sweeps started side by side): their
    timings shared the cores, so their speed measures the contention as much as the configuration.
    Runs given disjoint cores (Slurm's jobs packed on one node, each with its own) shared none."""
    timed = [run for run in runs if run.window is not None and run.summary.get("host")]
    found = []
    for a, b in itertools.combinations(timed, 2):
        shared = min(a.window[1], b.window[1]) - max(a.window[0], b.window[0])
        disjoint = core_ids(a) and core_ids(b) and not core_ids(a) & core_ids(b)
        if a.summary["host"] == b.summary["host"] and shared > OVERLAP_SLACK_S and not disjoint:
            found.append((a, b, shared))
    return found


def find_runs(dirs: list[Path], predictions: bool = False) -> list[Run]:
    """The training runs under `dirs` (each directory with a summary.json); a prediction's directory
    (`python -m aamperf.predict`) is left out with a note, or, with `predictions`, only those are read.
    A record that cannot be read is a one-line error naming its file. Records are read as data: JSON,
    and YAML without Python tags."""
    runs = []
    for directory in dirs:
        for summary_path in sorted(Path(directory).rglob("summary.json")):
            summary = read_summary(summary_path)
            predicted = "inference" in summary and "optim" not in summary
            if predicted != predictions:
                if predicted:
                    print(
                        f"note: {summary_path.parent} holds predictions (python -m aamperf.predict), not a "
                        "training run: left out of the comparison",
                        file=sys.stderr,
                    )
                continue
            overrides = read_overrides(summary_path.parent / ".hydra" / "overrides.yaml")
            runs.append(Run(summary_path.parent, overrides, summary))
    return runs


def read_summary(path: Path) -> dict[str, Any]:
    """A run's summary.json, or a one-line error naming it."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(
            f"{path} is not a run's summary ({one_line(exc)[:120]}); remove it or its directory, or give "
            "python -m aamperf.compare only the directories of aamperf runs"
        ) from exc
    if not isinstance(summary, dict):
        raise UserError(f"{path} is not a run's summary (JSON, not an object); remove it or its directory")
    return summary


def read_overrides(path: Path) -> list[str]:
    """A run's .hydra/overrides.yaml (a list of strings; [] where it has none), or a one-line error. Read
    with YAML's safe loader: a tag that would build a Python object is refused, not run."""
    if not path.exists():
        return []
    try:
        overrides = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(
            f"{path} is not a run's overrides ({one_line(exc)[:120]}); remove its run directory, or "
            "give python -m aamperf.compare only the directories of aamperf runs"
        ) from exc
    if overrides is None:
        return []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"{path} is not a run's overrides (a list of key=value); remove its directory")
    return overrides


def canonical(override: str) -> str:
    """`key=value` as the command line writes it: Optuna's sweeper writes a boolean back as True / False
    (`metrics.rf_baseline=False` in a trial, `=false` in the search's reference run): one configuration."""
    key, sep, value = override.partition("=")
    return f"{key}{sep}{value.lower()}" if value in ("True", "False") else override


def group_runs(runs: list[Run]) -> list[Group]:
    """Group by the overrides that are not the seed; label by those that differ between groups. An override
    of the value every run's config holds anyway (the search's reference given `trainer.val_batch_size=8`,
    which its trials take from hparams_search=fastest) sets nothing apart."""
    keys = [tuple(canonical(o) for o in r.overrides if not o.startswith(IGNORED_OVERRIDES)) for r in runs]
    configs = [flat(r.summary.get("config") or {}) for r in runs]
    keys = [tuple(o for o in key if not everyones_value(o, configs)) for key in keys]
    common = set.intersection(*(set(k) for k in keys)) if keys else set()
    groups: dict[str, Group] = {}
    for run, key in zip(runs, keys, strict=True):
        label = " ".join(o for o in key if o not in common) or f"optim={run.summary.get('optim')}"
        groups.setdefault(label, Group(label)).runs.append(run)
    return list(groups.values())


def everyones_value(override: str, configs: list[dict[str, Any]]) -> bool:
    """Whether a plain override's value, as Hydra parses it, is the one every run's resolved config holds
    (`configs`: flattened to dotted keys); False for a choice of a config group, which is no leaf."""
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException:  # not an override (a hand-written overrides.yaml): a label as written
        return False
    if parsed.type is not OverrideType.CHANGE or parsed.is_sweep_override():
        return False
    missing = object()
    return all(config.get(parsed.key_or_group, missing) == parsed.value() for config in configs)


def named_by(groups: list[Group], baseline: str) -> list[Group]:
    """The groups compare.baseline `baseline` names: labelled so, else those whose overrides include all
    of its overrides, else those of its level (`optim=...`)."""
    baseline = " ".join(canonical(o) for o in baseline.split())  # `=True` as `=true`, as groups are labelled
    matches = [g for g in groups if g.config == baseline]  # exact first: "optim=baseline" alone
    if not matches:
        wanted = set(baseline.split())
        matches = [g for g in groups if wanted <= set(g.config.split())]
    if not matches:
        matches = [g for g in groups if baseline == f"optim={g.runs[0].summary.get('optim')}"]
    return matches


def pick_baseline(groups: list[Group], baseline: str) -> Group:
    """The group labelled `baseline`, or the only one whose overrides include all of its overrides; a lone
    configuration (a sweep of seeds of one level) is its own baseline: its figures, nothing to compare."""
    if len(groups) == 1:
        return groups[0]
    matches = named_by(groups, baseline)
    if len(matches) != 1:
        names = ", ".join(f"'{g.config}'" for g in groups)
        raise UserError(
            f"compare.baseline={baseline!r} matches {len(matches)} configurations of {names}; "
            "name one of them with compare.baseline (--baseline for python -m aamperf.compare)"
        )
    return matches[0]


def median_repeats(runs: list[Run]) -> dict[Any, Run]:
    """Each pair key's run; of a seed run more than once, the run of the median samples/s (the lower of the
    middle two): repeats of one seed measure the machine's noise, not the seeds' spread that an interval
    over pairs stands for, and the median one is the least touched by it."""
    repeats: dict[Any, list[Run]] = {}
    for r in runs:
        repeats.setdefault(r.pair_key, []).append(r)
    median = {}
    for key, same in repeats.items():
        same.sort(key=lambda r: r.summary.get("samples_per_s") or 0.0)
        median[key] = same[(len(same) - 1) // 2]
    return median


def paired(group: Group, base: Group) -> list[tuple[Run, Run]]:
    """(run, baseline run) of each seed both completed on the same data (`data.seed`), by seed. A seed run
    more than once (a search's repeated trial, `seed=0,0,0`) pairs once, by its median run on either side
    (`median_repeats`)."""
    runs, base_runs = median_repeats(group.ok_runs), median_repeats(base.ok_runs)
    pairs = [(r, base_runs[key]) for key, r in runs.items() if key in base_runs]
    return sorted(pairs, key=lambda pair: str(pair[0].seed))
