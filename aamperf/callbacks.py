"""Hydra callbacks (registered in conf/config.yaml): the checks before a run or a sweep writes
anything, and the comparison report a multirun ends with."""

import contextlib
import importlib.resources
import io
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from aamperf.checks import check_config, check_values, earlier_run, earlier_sweep, unwritable
from aamperf.device import resolve_device
from aamperf.errors import (
    RunAborted,
    UserError,
    exit_aborted,
    exit_bad_input,
    hydra_error_message,
    hydra_reports_wanted,
    no_such_option,
    one_line,
)
from aamperf.files import Claim, write_atomic
from aamperf.interrupts import RunInterrupted, exit_interrupted
from aamperf.loggers import wandb_mode, wandb_unreachable
from aamperf.phases import check_phases
from aamperf.report import Run, find_runs, group_runs, make_report, to_markdown
from aamperf.report.runs import IGNORED_OVERRIDES, named_by, pick_baseline

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def check_start(config: DictConfig) -> None:
    """What can be checked without reading data and without writing: the values and the user's files
    (check_config), the chosen options, the phases on this device and the run directory (writable; that
    it holds no earlier run is checked once the run has claimed it, CheckBeforeRun)."""
    check_job(config)
    check_phases(config, resolve_device(config.device))
    problem = unwritable(config.hydra.run.dir, "hydra.run.dir", "the run directory")
    if problem:
        raise UserError(problem)


def check_job(config: DictConfig) -> None:
    """The values, the user's files and the chosen options: what a sweep checks of each of its jobs
    before the first runs. Not what this device can run: a study that sweeps precision=fp16 for a GPU
    runs its other jobs on a CPU, where fp16's refusal (with its fix) is a failed row of the report."""
    try:
        check_config(config)  # its messages name the fix of each value it knows
    except (MissingMandatoryValue, InterpolationResolutionError):
        check_values(config)  # a value that has none, or cannot be resolved: which, and how to give it
        raise
    check_values(config)
    loader = GlobalHydra.instance().config_loader()
    for group, option in config.hydra.runtime.choices.items():
        # Hydra skips an option of an optional group (experiment=...) that does not exist, silently
        if option is None or group.startswith("hydra/") or in_file_sources(config, group, option):
            continue
        options = group_options(loader.get_group_options(group), config.hydra.searchpath, group)
        if option not in options:
            raise UserError(no_such_option(group, option, options))


def in_file_sources(config: DictConfig, group: str, option: str) -> bool:
    """Whether `group/option.yaml` is a file of one of the run's config directories: then it is an
    option, found without Hydra's listing of the group (42 ms a group, 0.6 s of each run's start)."""
    sources = config.hydra.runtime.get("config_sources") or []
    return any(s.schema == "file" and (Path(s.path) / group / f"{option}.yaml").is_file() for s in sources)


def group_options(options: list[str], searchpath: list[str], group: str) -> list[str]:
    """A group's options: conf/'s (`options`) and those of the directories `hydra.searchpath` adds
    (the level hparams_search=fastest writes: optim=fastest 'hydra.searchpath=[file://<sweep dir>]'),
    which the loader's own list leaves out."""
    found = set(options)
    for entry in searchpath or []:
        scheme, _, where = str(entry).partition("://")
        try:
            root = Path(where) if scheme == "file" else importlib.resources.files(where)  # pkg://
            names = [p.name for p in (root / group).iterdir()]
        except (OSError, ImportError, TypeError, ValueError):
            continue  # not there: Hydra's composition says so where it matters
        found.update(name.removesuffix(".yaml") for name in names if name.endswith(".yaml"))
    return sorted(found)


def sweep_jobs(config: DictConfig) -> tuple[list[list[str]], set[str]]:
    """The overrides of each job of a sweep that runs its jobs here, one after another, and knows them
    all before the first (Hydra's basic sweeper and launcher), and the keys it sweeps; none for any
    other (a search picks its trials as it goes; a cluster's jobs run on other machines and devices)."""
    hydra = config.hydra
    if hydra.sweeper.get("_target_") != BASIC_SWEEPER or hydra.launcher.get("_target_") != BASIC_LAUNCHER:
        return [], set()
    # imported here, where Hydra's config has just named it: a Hydra whose private module moved names
    # another _target_ and returns above, instead of failing every run at import
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    loader = GlobalHydra.instance().config_loader()
    # as written: an override's ${...} is its job's to resolve (or refuse), not this reading's
    params = hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=False) if params else {}
    task = OmegaConf.to_container(hydra.overrides.task, resolve=False)
    overrides = [*(f"{key}={value}" for key, value in params.items()), *task]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch], swept


def check_jobs(config: DictConfig) -> None:
    """check_job of every job sweep_jobs lists, and the baseline the sweep's report compares with; one
    UserError naming the jobs of each problem."""
    loader = GlobalHydra.instance().config_loader()
    jobs_of: dict[str, list[str]] = {}
    jobs, swept = sweep_jobs(config)
    runs, default = [], None  # each job as its report will read it; the first with the default values
    configured = [key for key in swept if not f"{key}=".startswith(IGNORED_OVERRIDES)]  # not the seed
    for number, overrides in enumerate(jobs):
        try:
            job = loader.load_sweep_config(master_config=config, sweep_overrides=overrides)
        except CompactHydraException as exc:  # a job that does not compose: in one line, or Hydra's report
            if hydra_reports_wanted():
                return
            raise UserError(hydra_error_message(exc)) from exc
        runs.append(Run(Path(str(number)), overrides, {"optim": job.get("optim")}))
        if default is None and all(swept_value(job, key) == swept_value(config, key) for key in configured):
            default = number
        try:
            check_job(job)
        except UserError as exc:
            values = " ".join(o for o in overrides if o.split("=", 1)[0] in swept)
            jobs_of.setdefault(str(exc), []).append(f"#{number} ({values})")
    problems = [
        problem if len(numbers) == len(jobs) else f"sweep job {', '.join(numbers)}: {problem}"
        for problem, numbers in jobs_of.items()
    ]
    callbacks = config.hydra.callbacks.values()
    reported = any(c and c.get("_target_") == f"{__name__}.CompareReport" for c in callbacks)
    problem = baseline_problem(config.compare.baseline, runs, default) if runs and reported else None
    if problems or problem:
        raise UserError("; ".join([*problems, *([problem] if problem else [])]))


def swept_value(config: DictConfig, key: str) -> Any:
    """The value of a swept `key` in `config`: a group's option, or a key's value (None where unset)."""
    if key in config.hydra.runtime.choices:
        return config.hydra.runtime.choices[key]
    return OmegaConf.select(config, key.lstrip("+~"), default=None, throw_on_resolution_failure=False)


def baseline_problem(baseline: str, runs: list[Run], default: int | None) -> str | None:
    """The problem with compare.baseline for a sweep of `runs` (each job's overrides and level, as its
    report reads them), or None: the report compares every other configuration with the one baseline
    names (aamperf/report/runs.py pick_baseline), so it must name one. The fix suggested: the
    configuration of job `default` (the values the sweep would have without its swept ones), else the
    first job's."""
    groups = group_runs(runs)
    try:
        pick_baseline(groups, baseline)
        return None
    except UserError:
        pass
    named = [group for group in groups if named_by([group], baseline)]
    labels = ", ".join(f"'{group.config}'" for group in groups)
    matches = f"matches {len(named)} configurations" if named else "matches none of the configurations"
    suggested = next(g.config for g in groups if any(run is runs[default or 0] for run in g.runs))
    why = "the first job's" if default is None else "the default"
    return (
        f"compare.baseline={baseline!r} {matches} of this sweep ({labels}), and its report compares every "
        f"other with one; name it: 'compare.baseline=\"{suggested}\"' ({why}), or another of them"
    )


class CheckBeforeRun(Callback):
    """A single run is checked before Hydra creates its directory or writes .hydra/ in it, a sweep's
    jobs all before the first runs: a config mistake writes nothing at all.

    Then the run claims its directory (`files.Claim`) before Hydra writes there, and holds it to the
    end: a second run started in it while the first is on is refused before it rewrites the first's
    .hydra/ (the config `compare` groups runs by).

    Bad input found later (a damaged BIOM table, a checkpoint of another model, ...) refuses the start
    too, and a refused start leaves an earlier run in its directory (one with a summary.json) as it
    was: train() writes its summary to summary.refused.json instead, and this callback puts back the
    .hydra/ files and logs Hydra rewrote. A start that fails any other way is a run that failed.
    """

    def __init__(self) -> None:
        self.earlier_files: dict[Path, bytes] = {}
        self.claim: Claim | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Every job of a sweep checked before the first one runs: a mistake in its last job, or a
        compare.baseline its report cannot find, refuses the sweep at once (exit 2, nothing written),
        not after the others have run. What only a run can
        find (its data, its checkpoint) still fails that job alone, and the sweep goes on."""
        try:
            problem = unwritable(config.hydra.sweep.dir, "hydra.sweep.dir", "the sweep directory")
            if not problem and config.trainer.resume != "auto":
                problem = earlier_sweep(config.hydra.sweep.dir)
            if problem:
                raise UserError(problem)
            check_jobs(config)
        except UserError as exc:
            exit_bad_input(exc)
        if config.logger.backend == "wandb" and wandb_mode(config) == "online":
            wandb_unreachable()  # asked once here, the sweep's start: no job's clock carries it

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_start(config)
            # taken before the run's own check (an earlier run's record there): a live run's is "in use"
            self.claim = Claim(Path(config.hydra.run.dir))
            problem = earlier_run(config.hydra.run.dir, config.trainer.resume)
            if problem:
                self.claim.release()
                raise UserError(problem)
        except UserError as exc:
            exit_bad_input(exc)  # SystemExit: Hydra turns an Exception of a callback into a warning
        run_dir = Path(config.hydra.run.dir)
        if (run_dir / "summary.json").is_file():
            kept = [*run_dir.glob(".hydra/*"), *run_dir.glob("*.log")]
            self.earlier_files = {path: path.read_bytes() for path in kept if path.is_file()}

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """A refused start: the earlier run's files put back. A refused or aborted run ends here with
        its one line and exit code, before Hydra adds its own lines about the failed job. The run
        directory is let go however the run ended."""
        try:
            self.put_back_and_exit(job_return)
        finally:
            if self.claim is not None:
                self.claim.release()

    def put_back_and_exit(self, job_return: JobReturn) -> None:
        if job_return.status != JobStatus.FAILED:
            return
        with contextlib.redirect_stderr(io.StringIO()):  # Hydra prints a line as it re-raises
            try:
                _ = job_return.return_value
            except Exception as exc:
                error = exc
        if isinstance(error, UserError):
            for path, content in self.earlier_files.items():
                write_atomic(path, content)
            exit_bad_input(error)
        if isinstance(error, RunInterrupted):  # a stop signal: 128 + its number
            exit_interrupted(error)
        if isinstance(error, RunAborted):
            exit_aborted(error)
        # any other failure is a bug: Hydra shows its traceback


class CompareReport(Callback):
    """After the last job: comparison.{json,csv,md,png} in the sweep directory, the table printed,
    and the comparison logged to W&B beside the jobs when logger=wandb.

    Exit status: 2 when the baseline cannot be found (compare.baseline names the fix), 1 when a job
    failed (it is a row of the report with its error) or the report could not be made (its traceback,
    then one line), 0 otherwise.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():  # every job refused before it made its directory
            return
        if int(os.environ.get("RANK", "0")) > 0:  # under torchrun every rank ran the sweep: the first reports
            return
        try:
            settings = config.compare
            result = make_report(
                [sweep_dir], settings.baseline, settings.quality_tolerance, sweep_dir, settings.confidence
            )
        except UserError as exc:
            print(
                f"error: no comparison report: {exc}; the runs are kept: python -m aamperf.compare "
                f"{sweep_dir} --baseline '<config>'",
                file=sys.stderr,
            )
            sys.exit(2)
        except Exception as exc:  # the disk, or a bug: Hydra would turn it into a warning and exit 0
            traceback.print_exc()
            print(
                f"error: the comparison report failed ({one_line(f'{type(exc).__name__}: {exc}')}); the runs "
                f"are kept: python -m aamperf.compare {sweep_dir}",
                file=sys.stderr,
            )
            sys.exit(1)
        print(to_markdown(result))
        print(f"report: {sweep_dir / 'comparison.md'}, {sweep_dir / 'comparison.png'}")
        if config.logger.backend == "wandb":
            from aamperf.loggers import log_comparison

            log_comparison(result, sweep_dir, config)
        failed = [run for run in find_runs([sweep_dir]) if run.summary.get("status") != "completed"]
        if failed:
            names = ", ".join(run.path.name for run in failed)
            print(f"error: {len(failed)} job(s) failed: {names} (errors in the report)", file=sys.stderr)
            sys.exit(1)
