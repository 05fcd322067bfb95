"""Training checkpoints (`trainer.checkpoint_every`, `trainer.resume=auto`): all a run needs to go on
exactly where it stopped, written atomically, read back without running code from the file.

One process and DDP: rank 0 writes one file, `<run dir>/checkpoints/step_<N>.pt` (model, optimizer,
scheduler, GradScaler, every rank's RNG states, the data position, the loop's counters; the
scheduler's state is kept to be read, a resume rebuilds the schedule from its config). FSDP2: a
sharded checkpoint directory `step_<N>/` through torch.distributed.checkpoint, which can be read by
another number of ranks. A half-written checkpoint never replaces a good one: a file, or a directory
once DCP has finished, is fsynced and renamed into place (aamperf/files.py).

No code from a file runs on resume: `.pt` files are read with `torch.load(weights_only=True)`; a sharded
directory's `.metadata` (a pickle) through an unpickler that builds only DCP's own metadata classes, and
its non-tensor items with `weights_only=True` too (`SafeReader`, `SafePlanner`).
"""

import io
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from aamperf.config import config_diff, under
from aamperf.distributed import rank, unwrap, world_size
from aamperf.errors import NoSpace, UserError, disk_full, no_space, one_line
from aamperf.files import replace_durably, write_atomic
from aamperf.rng import all_rng_states, set_rng_state

CHECKPOINT_DIR = "checkpoints"
# aamperf's names in CHECKPOINT_DIR; any other file there (a backup `step_00000006.pt.bak`, a hand-named
# `step_final.pt`) is the user's, never read, pruned or renamed
CHECKPOINT_NAME = re.compile(r"step_(\d+)(\.pt)?")  # a file step_<N>.pt, a sharded directory step_<N>
PARTIAL_NAME = re.compile(r"\.step_\d+\.pt\.\w+\.tmp|step_\d+\.tmp")  # what killed saves left
DAMAGED = ".damaged"  # a checkpoint that cannot be read, kept under its name + this: no resume reads it


class Damaged(UserError):
    """A checkpoint that cannot be read at all (cut short, garbage, not a checkpoint's format): a resume
    goes on from the one before it, where there is one."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records (plain dataclasses and enums), torch sizes, dtypes and layouts, paths;
    refuses every other global (a payload's `os.system`, `builtins.exec`, ...) before it could be called."""

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.distributed.checkpoint.metadata":
            from torch.distributed.checkpoint import metadata

            found = getattr(metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:  # its own records, not its imports
                return found
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _safe_reader(path: Path):
    """DCP's file-system reader with a metadata unpickler that runs no code from the file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_planner():
    """DCP's default load planner, reading non-tensor items (optimizer hyper-parameters, steps) with
    `weights_only=True` instead of a plain unpickle."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            item = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
            else:
                self.state_dict[read_item.dest_index.fqn] = item

    return SafePlanner()


def is_sharded(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync") and not hasattr(model, "no_sync")  # FSDP2


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".pt"))


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first: files step_<N>.pt and sharded directories step_<N>
    (temporary files of an interrupted save, and files of other names, excluded)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = []
    for path in root.iterdir():
        name = CHECKPOINT_NAME.fullmatch(path.name)
        if name and (path.is_file() if name[2] else path.is_dir()):
            done.append(path)
    return sorted(done, key=step_of)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the way of resumes and saves (`step_<N>.pt.damaged`, then
    `.damaged.1`, ...), kept to be looked at; where it was renamed to."""
    aside = path.with_name(path.name + DAMAGED)
    number = 0
    while aside.exists():
        number += 1
        aside = path.with_name(f"{path.name}{DAMAGED}.{number}")
    os.rename(path, aside)
    return aside


def save(run_dir: Path, step: int, model: nn.Module, state: dict[str, Any], keep_last: int) -> Path:
    """Write the checkpoint of `step` (every rank calls this) and keep the newest `keep_last`.

    `state` holds the optimizer, scheduler and scaler objects and the loop's plain values."""
    root = Path(run_dir) / CHECKPOINT_DIR
    rngs = all_rng_states()
    optimizer = state.pop("optimizer")
    if is_sharded(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        final, tmp = root / f"step_{step:08d}", root / f"step_{step:08d}.tmp"
        if rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        with _cleaned_up(tmp, root, step):
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
            if rank() == 0:
                torch.save({**_plain(state), "rngs": rngs, "step": step}, tmp / "trainer.pt")
                replace_durably(tmp, final)
        dist.barrier()
    else:
        final = root / f"step_{step:08d}.pt"
        if rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            payload = {
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                **_plain(state),
                "rngs": rngs,
                "step": step,
            }
            with _cleaned_up(None, root, step):
                write_atomic(final, lambda f: torch.save(payload, f))
        if world_size() > 1:
            dist.barrier()
    if rank() == 0:
        for old in checkpoints(run_dir)[:-keep_last] + _partial(root):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    return final


def _partial(root: Path) -> list[Path]:
    """What killed saves left (a kill runs no clean-up): `.step_<N>.pt.<random>.tmp`, `step_<N>.tmp/`."""
    return [p for p in root.iterdir() if PARTIAL_NAME.fullmatch(p.name)]


@contextmanager
def _cleaned_up(tmp: Path | None, root: Path, step: int) -> Iterator[None]:
    """A save that fails leaves no partial file (`tmp`, a DCP directory being written; the files of
    aamperf/files.py clean up after themselves); on a full disk it says so in one line that names the
    last good checkpoint."""
    try:
        yield
    except Exception as exc:  # a kill runs no clean-up: the next save removes what it left (`_partial`)
        # asked before the partial directory goes: it is what filled the disk
        full = isinstance(exc, NoSpace) or disk_full(exc, root)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            kept = [p.name for p in checkpoints(root.parent)]
            raise no_space(
                root,
                f"the checkpoint of step {step}",
                f"free space there or set hydra.run.dir elsewhere (the last good checkpoint, "
                f"{kept[-1] if kept else 'none yet'}, is kept; trainer.resume=auto goes on from it)",
            ) from exc
        raise


# What a resume may not change: the model, its data and objective, the draw, the batch (the data
# position in the checkpoint counts its batches), what a fine-tune starts from and trains (the
# optimizer holds the unfrozen parameters only), and the optimizer's update (its state is that update's).
# Everything else applies as given (the optimizer's hyper-parameters too: `use_run_hyperparameters`), and
# summary.json `resume_changes` lists it.
RESUME_FIXED = (
    *("model", "data", "loss", "seed", "trainer.batch_size", "trainer.grad_accum_steps"),
    *("init", "finetune.freeze", "optimizer.algorithm", "optimizer.categorical_lr"),
)
RESUME_IGNORED = ("trainer.resume", "data.cache_dir", "probe", "trainer.progress")
# keys a checkpoint of an earlier version does not hold, and the value its run had
BEFORE_THE_KEY = {
    "finetune.freeze": "none",
    "data.unifrac_metric": "unweighted",
    "loss.mask_strategy": "random",
    "loss.over_weight": 1.0,
    "loss.under_weight": 1.0,
    "model.target_activation": "none",
    "model.count_head": False,
    "model.target_hidden_dims": [],
    "model.target_dropout": 0.0,
    "model.target_residual": False,
    "model.count_embedding_method": "add",
    "data.asv_sampling": "abundance",
    "optimizer.algorithm": "adamw",
    "optimizer.momentum": 0.9,
    "loss.count_weight": 1.0,
    "data.normalize_by": [],
    "data.weight_by": [],
    "loss.category_weights": None,
    "model.categorical_output_scaling": False,
    "optimizer.categorical_lr": None,
    "trainer.val_passes": 1,
}


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, list]:
    """{dotted key: [value at the checkpoint, value now]} for every key whose value differs."""
    changes = config_diff(saved, now, RESUME_IGNORED)
    return {
        k: v
        for k, v in changes.items()
        if not (v[0] is None and k in BEFORE_THE_KEY and BEFORE_THE_KEY[k] == v[1])
    }


def check_resume(path: Path, changes: dict[str, list]) -> None:
    fixed = {k: v for k, v in changes.items() if under(k, RESUME_FIXED)}
    if fixed:
        shown = ", ".join(f"{k}={new} (checkpoint: {old})" for k, (old, new) in list(fixed.items())[:3])
        raise UserError(
            f"cannot resume from {path} with {shown}: a resume keeps the model, data, loss, seed, batch, "
            "init.from_run, finetune.freeze, optimizer.algorithm and optimizer.categorical_lr; set them "
            "back, or start a new run directory"
        )


def use_run_hyperparameters(optimizer: torch.optim.Optimizer, fresh: list[dict]) -> None:
    """After loading a checkpoint's optimizer state: this run's lr, weight decay, betas and kernels, not
    the saved ones (loading param_groups would silently keep those). The schedule is rebuilt from them
    and replayed to the checkpoint's step (`trainer.build_scheduler`)."""
    for group, mine in zip(optimizer.param_groups, fresh, strict=True):
        group.update({k: v for k, v in mine.items() if k not in ("params", "initial_lr")})
        group.pop("initial_lr", None)  # the schedulers set it from this run's lr


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """Objects with a state_dict become their state; the rest is kept as it is."""
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}


def read(path: Path) -> dict[str, Any]:
    """The loop's state saved in `path` (a file's whole payload; a sharded directory's trainer.pt, its
    metadata read too), nothing applied yet; `Damaged` where it cannot be read at all."""
    try:
        if path.is_dir():  # sharded (FSDP2): the model and optimizer are read into their shards by `load`
            _safe_reader(path).read_metadata()
            return torch.load(path / "trainer.pt", weights_only=True)
        return torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, ValueError, OSError, EOFError, pickle.UnpicklingError, AssertionError) as exc:
        raise Damaged(f"cannot resume from {path}: {one_line(exc)[:300]}") from exc


def load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG states from `path`; return the rest of the state.
    `Damaged` where it cannot be read (nothing restored then), a UserError where it is not a checkpoint
    of this model and run. `check(payload)` runs first, on what was read (a refusal restores nothing)."""
    payload = read(path)
    if check is not None:
        check(payload)
    try:
        if path.is_dir():  # sharded (FSDP2)
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.api import CheckpointException
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
            sharded = {"model": model_state, "optimizer": optim_state}
            try:
                dcp.load(sharded, storage_reader=_safe_reader(path), planner=_safe_planner())
            except (CheckpointException, AssertionError) as exc:
                # DCP wraps each rank's failure (the first one is shown); metadata it could not read
                # is an AssertionError
                first = next(iter(exc.failures.values()))[0] if isinstance(exc, CheckpointException) else exc
                raise (ValueError(str(first)) if isinstance(first, AssertionError) else first) from None
            set_state_dict(
                model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"]
            )
        else:
            unwrap(model).load_state_dict(payload.pop("model"))
            optimizer.load_state_dict(payload.pop("optimizer"))
        rngs = payload.pop("rngs")
    except (
        RuntimeError,
        ValueError,
        KeyError,
        OSError,
        EOFError,
        pickle.UnpicklingError,
    ) as exc:
        reason = one_line(exc)[:300]
        raise UserError(
            f"cannot resume from {path}: {reason}; it is not a checkpoint of this model and run "
            "(start a new run directory, or trainer.resume=disabled)"
        ) from exc
    # Another number of ranks than when saved (the model and data position do not depend on it):
    # a new rank takes the generators of rank (rank mod saved ranks); only dropout masks differ.
    set_rng_state(rngs[rank() % len(rngs)])
    return payload
