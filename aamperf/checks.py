"""Config checks that need more than a type: all problems found at once, each naming its override."""

import dataclasses
import inspect
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from aamperf import checkpoint
from aamperf.alerts import check_alerts
from aamperf.batch_size import check_budget
from aamperf.config import Config
from aamperf.data.checks import check_data
from aamperf.device import resolve_device
from aamperf.distributed import check_distributed
from aamperf.errors import UserError
from aamperf.files import read_json_cache
from aamperf.metrics.record import METRICS_FILE, SUMMARY_FILE
from aamperf.model import AAM, AAMLoss
from aamperf.model.aam_arguments import argument_problems as aam_problems
from aamperf.model.loss_arguments import argument_problems as loss_problems
from aamperf.phases.system import check_system
from aamperf.tokens import ASV_BP, TOKENS_PER_ASV, VOCAB_SIZE
from aamperf.trainer.best import monitor_problems
from aamperf.trainer.schedule import check_schedule
from aamperf.weights import MODEL_FILE, OWN_LOSSES, OWN_MODELS


def val_passes_problems(cfg: DictConfig) -> list[str]:
    """trainer.val_passes > 1 reads the validation samples anew each pass: only where their ASVs are drawn
    (data.asv_sampling=random) or the loss hides bases (AAMLoss with loss.nucleotide_weight > 0)."""
    passes = cfg.trainer.val_passes
    if passes < 1:
        return [f"trainer.val_passes={passes} must be >= 1"]
    hides = cfg.loss.get("_target_") in OWN_LOSSES and cfg.loss.get("nucleotide_weight", 1.0) > 0
    if passes == 1 or cfg.data.get("asv_sampling") == "random" or hides:
        return []
    return [
        f"trainer.val_passes={passes} reads each validation sample anew each pass, which neither "
        f"data.asv_sampling={cfg.data.get('asv_sampling')} nor the loss (it hides no bases) does: the same "
        "input every time; set data.asv_sampling=random, or trainer.val_passes=1"
    ]


def check_config(cfg: DictConfig) -> None:
    """Raise one UserError listing every problem of `cfg`, or return."""
    t, m = cfg.trainer, cfg.metrics
    problems = check_auto_batch(t, cfg.device) if t.batch_size == "auto" else []
    if t.batch_size != "auto" and (isinstance(t.batch_size, bool) or not isinstance(t.batch_size, int)):
        problems.append(f"trainer.batch_size={t.batch_size} must be an integer >= 2 or auto")
    elif t.batch_size != "auto" and t.batch_size < 2:
        problems.append(f"trainer.batch_size={t.batch_size} must be >= 2 (UniFrac compares pairs of samples)")
    if t.max_steps <= 0:
        problems.append(f"trainer.max_steps={t.max_steps} must be > 0")
    if t.val_batch_size is not None and t.val_batch_size < 2:
        problems.append(
            f"trainer.val_batch_size={t.val_batch_size} must be >= 2 (UniFrac compares pairs of samples), "
            "or null: the training micro-batch"
        )
    if t.grad_accum_steps < 1:
        problems.append(f"trainer.grad_accum_steps={t.grad_accum_steps} must be >= 1")
    elif isinstance(t.batch_size, int) and t.batch_size >= 2 and t.batch_size // t.grad_accum_steps < 2:
        problems.append(
            f"trainer.batch_size={t.batch_size} / trainer.grad_accum_steps={t.grad_accum_steps} leaves fewer "
            "than 2 samples per micro-batch (UniFrac compares pairs)"
        )
    else:
        problems += check_distributed(cfg)
    if not 0 < cfg.compare.confidence < 1:
        problems.append(f"compare.confidence={cfg.compare.confidence} must be between 0 and 1 (e.g. 0.95)")
    if cfg.compare.quality_tolerance < 0:
        problems.append(f"compare.quality_tolerance={cfg.compare.quality_tolerance} must be >= 0 (e.g. 0.02)")
    if t.max_nonfinite < 1:
        problems.append(f"trainer.max_nonfinite={t.max_nonfinite} must be >= 1")
    if t.lr <= 0:
        problems.append(f"trainer.lr={t.lr} must be > 0")
    if t.weight_decay < 0:
        problems.append(f"trainer.weight_decay={t.weight_decay} must be >= 0")
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(f"trainer.min_lr_ratio={t.min_lr_ratio} must be between 0 and 1")
    if t.warmup_steps < 0:
        problems.append(f"trainer.warmup_steps={t.warmup_steps} must be >= 0")
    problems += check_schedule(t)
    if t.grad_clip < 0:
        problems.append(f"trainer.grad_clip={t.grad_clip} must be >= 0 (0: no clipping)")
    if t.val_every < 1 or t.val_batches < 1:
        problems.append("trainer.val_every and trainer.val_batches must be >= 1")
    problems += val_passes_problems(cfg)
    problems += monitor_problems(t, cfg.data.get("target"))
    if t.checkpoint_every < 0 or t.keep_last < 1:
        problems.append("trainer.checkpoint_every must be >= 0 (0: none) and trainer.keep_last >= 1")
    for key, seed in (("seed", cfg.seed), ("data.seed", cfg.data.get("seed"))):
        if seed is not None and not 0 <= seed < 2**32:  # numpy's and torch's seeds are 32-bit
            problems.append(f"{key}={seed} must be an integer from 0 to 4294967295 (2**32 - 1)")
    if m.log_every < 1:
        problems.append(f"metrics.log_every={m.log_every} must be >= 1")
    if m.skip_steps < 0:
        problems.append(f"metrics.skip_steps={m.skip_steps} must be >= 0")
    if m.flop_batches < 1:
        problems.append(f"metrics.flop_batches={m.flop_batches} must be >= 1")
    if not m.monitor_interval_s > 0:
        problems.append(f"metrics.monitor_interval_s={m.monitor_interval_s} must be > 0 (seconds)")
    if m.profile_steps < 0:
        problems.append(f"metrics.profile_steps={m.profile_steps} must be >= 0 (0: no profile)")
    if cfg.dropout.threads is not None and cfg.dropout.threads < 1:
        problems.append(f"dropout.threads={cfg.dropout.threads} must be >= 1, or null: torch's thread count")
    if cfg.distributed.timeout_s <= 0:
        problems.append(f"distributed.timeout_s={cfg.distributed.timeout_s} must be > 0 (seconds)")
    if m.peak_flops is not None and not m.peak_flops > 0:
        problems.append(f"metrics.peak_flops={m.peak_flops} must be > 0 (FLOP/s, e.g. 1.25e14), or null")
    if cfg.device not in ("auto", "cpu") and not str(cfg.device).startswith("cuda"):
        problems.append(f"device={cfg.device} is not one of auto, cpu, cuda, cuda:N")
    model_asvs = cfg.model.get("max_asvs")
    if model_asvs is None and OmegaConf.is_interpolation(cfg.data, "max_asvs"):
        problems.append(
            f"data.max_asvs follows model.max_asvs, which model {cfg.model.get('_target_')} has not; "
            "set data.max_asvs=<ASVs kept per sample>"
        )
    elif cfg.data.max_asvs < 1:
        problems.append(f"data.max_asvs={cfg.data.max_asvs} must be >= 1 (the ASVs kept per sample)")
    elif model_asvs is not None and cfg.data.max_asvs > model_asvs:
        problems.append(
            f"data.max_asvs={cfg.data.max_asvs} exceeds model.max_asvs={model_asvs}: the model has no "
            "position for the extra ASVs; lower data.max_asvs or raise model.max_asvs"
        )
    categorical_lr = cfg.optimizer.get("categorical_lr")
    if categorical_lr is not None and not categorical_lr > 0:
        problems.append(f"optimizer.categorical_lr={categorical_lr} must be > 0, or null: trainer.lr")
    elif categorical_lr is not None and not cfg.data.get("categorical"):
        problems.append(
            f"optimizer.categorical_lr={categorical_lr} is the lr of the categorical conditioning "
            "(data.categorical), which names no column: set it, or optimizer.categorical_lr=null"
        )
    if cfg.model.get("categorical_output_scaling") is True and not cfg.data.get("categorical"):
        problems.append(
            "model.categorical_output_scaling=true scales the target per category of data.categorical's "
            "columns, and it names none: set data.categorical=[<column>], or "
            "model.categorical_output_scaling=false"
        )
    problems += check_arguments(cfg, "model") + check_arguments(cfg, "loss") + check_system(cfg.system)
    problems += unread_keys(cfg, Config) + check_alerts(cfg) + check_data(cfg)
    cache_problem = (
        unwritable(cfg.data.cache_dir, "data.cache_dir", "the cache") if "cache_dir" in cfg.data else None
    )
    problems += [cache_problem] if cache_problem else []
    problems += cache_file_problem(str(cfg.probe.cache), "probe.cache", "the device probe's answers")
    if problems:
        raise UserError("; ".join(problems))


# The modules aamperf builds from a _target_ and whose arguments it checks before a run builds anything;
# a plug-in checks its own as it is built (a ValueError there names the override to fix too).
BUILT_IN = {
    **{target: (AAM, aam_problems) for target in OWN_MODELS},
    **{target: (AAMLoss, loss_problems) for target in OWN_LOSSES},
}


def check_arguments(cfg: DictConfig, name: str) -> list[str]:
    """The problems of cfg.`name`'s arguments (model, loss) where its _target_ is aamperf's own: one it
    does not take, or a value it refuses; and an AAM too small for aamperf's tokens."""
    node = cfg[name]
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if target not in BUILT_IN:
        return []
    cls, problems_of = BUILT_IN[target]
    given = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}
    try:
        args = inspect.signature(cls).bind(**given)
    except TypeError as exc:
        return [f"{name}: {cls.__name__} {exc}; fix the {name}.* overrides or conf/{name}/"]
    args.apply_defaults()
    problems = problems_of(args.arguments, prefix=f"{name}.")
    if cls is AAM and not problems:
        vocab, length = args.arguments["vocab_size"], args.arguments["seq_len"]
        if vocab < VOCAB_SIZE:
            problems.append(
                f"model.vocab_size={vocab} is below the {VOCAB_SIZE} token ids of aamperf's data (PAD, A, C, "
                f"G, T, START, MASK); set model.vocab_size={VOCAB_SIZE}"
            )
        if length < TOKENS_PER_ASV:
            problems.append(
                f"model.seq_len={length} is shorter than an ASV's {TOKENS_PER_ASV} tokens (START + {ASV_BP} "
                f"bp); set model.seq_len={TOKENS_PER_ASV}"
            )
    return problems


def cache_file_problem(value: str, key: str, what: str) -> list[str]:
    """[the problem with `key`=`value` as a file to keep `what` in], or []."""
    path = Path(value).expanduser()
    if path.is_dir():
        return [f"{key}={value} is a directory; give a file in it, e.g. {key}={path / 'cache.json'}"]
    if unwritable(str(path.parent), key, what):
        return [f"{key}={value}: cannot write {what} in {path.parent}; choose another {key}"]
    return []


def unwritable(value: str, key: str, what: str) -> str | None:
    """The problem with `key`=`value` as a directory to create and write `what` in, or None. Tried: a
    directory is made in its nearest existing parent and removed (permission bits do not tell for root,
    a read-only file system, /proc or /sys)."""
    path = Path(str(value)).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(existing)
        os.rmdir(tempfile.mkdtemp(prefix=".aamperf-check-", dir=existing))
    except OSError:
        return (
            f"{key}={value}: cannot write {what} there ({existing} is not a writable directory); "
            f"choose another {key}"
        )
    return None


def earlier_run(run_dir: str | Path, resume: str) -> str | None:
    """The problem with starting a run in `run_dir`, or None: an earlier run's record there (summary.json,
    metrics.jsonl, model.pt, checkpoints) that a new run would write over: its rows would follow the old
    ones in metrics.jsonl, its summary and model replace theirs. trainer.resume=auto goes on from the
    newest checkpoint, or starts over a run that did not complete (its rows dropped, aamperf/trainer/)."""
    run_dir = Path(str(run_dir)).expanduser()
    left = [name for name in (SUMMARY_FILE, METRICS_FILE, MODEL_FILE) if (run_dir / name).is_file()]
    saved = checkpoint.checkpoints(run_dir)
    if not left and not saved:
        return None
    summary = read_json_cache(run_dir / SUMMARY_FILE)  # {} where absent or damaged
    status = summary.get("status")
    if resume == "auto" and (saved or status != "completed"):
        return None
    found = [*left, f"{checkpoint.CHECKPOINT_DIR}/"] if saved else left
    what = f"{status} at step {summary.get('steps')}" if status else ", ".join(found)
    if resume == "auto":  # a completed run and no checkpoint: going on would train it again from the start
        what += ", no checkpoint to go on from"
    go_on = f", go on from its step {checkpoint.step_of(saved[-1])} with trainer.resume=auto" if saved else ""
    return (
        f"run directory {run_dir} holds an earlier run ({what}) that this run would write over; give this "
        f"run its own hydra.run.dir{go_on}, or remove {run_dir} to run there again"
    )


def earlier_sweep(sweep_dir: str | Path) -> str | None:
    """The problem with starting a sweep in `sweep_dir`, or None: runs of an earlier sweep there (its jobs'
    directories are numbered the same: each job would write over one)."""
    sweep_dir = Path(str(sweep_dir)).expanduser()
    runs = {p.parent for name in (SUMMARY_FILE, METRICS_FILE) for p in sweep_dir.rglob(name)}
    if not runs:
        return None
    directories = f"{len(runs)} run director{'y' if len(runs) == 1 else 'ies'}"
    return (
        f"sweep directory {sweep_dir} holds the runs of an earlier sweep ({directories}) that this sweep "
        f"would write over; give this sweep its own hydra.sweep.dir (or trainer.resume=auto to go on from "
        f"their checkpoints), or remove {sweep_dir} to sweep there again"
    )


def unread_keys(node: DictConfig, schema: type, path: str = "") -> list[str]:
    """Keys added with `+` to a section aamperf's schema fixes (not model/loss, which are open):
    nothing would read them, so a `+trainer.lr_decay=...` would silently do nothing."""
    fields = {f.name: f.type for f in dataclasses.fields(schema)}
    problems = []
    for key in node:
        if key == "hydra" and not path:  # Hydra's own node, in the config a run is checked with first
            continue
        if key not in fields:
            problems.append(
                f"{path}{key} is not a setting aamperf reads (added with +); remove it, or see "
                f"the settings of {path.rstrip('.') or 'the top level'} in aamperf/config.py"
            )
        elif dataclasses.is_dataclass(fields[key]) and isinstance(node[key], DictConfig):
            problems += unread_keys(node[key], fields[key], f"{path}{key}.")
    return problems


def check_auto_batch(t: DictConfig, device_name: str) -> list[str]:
    a, problems = t.auto_batch, []
    if not 0 < a.budget_fraction < 1:
        problems.append(f"trainer.auto_batch.budget_fraction={a.budget_fraction} must be in (0, 1)")
    if a.budget_gib is not None and a.budget_gib <= 0:
        problems.append(f"trainer.auto_batch.budget_gib={a.budget_gib} must be > 0 (GiB per rank)")
    elif a.budget_gib is not None:
        try:
            problems += check_budget(a.budget_gib, resolve_device(device_name))
        except (UserError, RuntimeError):  # no such device: said by check_config, or as the run starts
            pass
    if a.max_batch < 2 or a.tolerance <= 0:
        problems.append("trainer.auto_batch.max_batch must be >= 2 and trainer.auto_batch.tolerance > 0")
    if a.effective_batch is not None and a.effective_batch < 2:
        problems.append(f"trainer.auto_batch.effective_batch={a.effective_batch} must be >= 2")
    return problems


def check_values(config: Any, fixes: dict[str, str] | None = None) -> None:
    """A UserError for the first value of `config` (its `hydra` node aside) that has none (`???`), whose
    interpolation fails (an environment variable not set), or a number that is not finite (inf, nan):
    found now, not midway through a run. `fixes`: a key's own way to give it (predict's `run`)."""
    for key in config:
        if key == "hydra":
            continue
        try:
            value = config[key]  # a plain value is resolved as it is read
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as exc:
            full_key = exc.full_key or key
            fix = (fixes or {}).get(full_key, f"set {full_key}=<value> on the command line or in its config")
            raise UserError(f"{full_key} has no value (???); {fix}") from exc
        except InterpolationResolutionError as exc:
            full_key, cause = exc.full_key or key, str(exc.msg).splitlines()[0]
            fix = f"set what it refers to, or give it: {full_key}=<value>"
            raise UserError(f"{full_key}: {cause}; {fix}") from exc
        for full_key, number in floats(value, str(key)):
            if not math.isfinite(number):
                raise UserError(f"{full_key}={number} must be a finite number")


def floats(value: Any, key: str) -> Iterator[tuple[str, float]]:
    """(full key, number) of every float in a plain config value."""
    if isinstance(value, dict):
        for name, inner in value.items():
            yield from floats(inner, f"{key}.{name}")
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from floats(inner, f"{key}[{index}]")
    elif isinstance(value, float):
        yield key, value
