"""Training checkpoints (`trainer.checkpoint_every`, `trainer.resume=auto`): all a run needs to go on
exactly where it stopped, written atomically, read back without running code from the file.

One process and DDP: rank 0 writes one file, `<run dir>/checkpoints/step_<N>.pt` (model, optimizer,
scheduler, GradScaler, every rank's RNG states, the data position, the loop's counters). FSDP2: a
sharded checkpoint directory `step_<N>/` through torch.distributed.checkpoint, which can be read by
another number of ranks. A half-written checkpoint never replaces a good one: files are renamed
into place after an fsync, directories after DCP has finished.
"""

import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from aamperf.distributed import world_size
from aamperf.errors import UserError

CHECKPOINT_DIR = "checkpoints"


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP keeps the model in .module


def is_sharded(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync") and not hasattr(model, "no_sync")  # FSDP2


def rng_state() -> dict[str, Any]:
    """This process's random generators as plain Python values: loadable with weights_only, and safe
    to send through all_gather_object (which fails on tensors inside objects in torch 2.13)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def all_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (a collective under torch.distributed)."""
    if world_size() == 1:
        return [rng_state()]
    states: list[Any] = [None] * world_size()
    dist.all_gather_object(states, rng_state())
    return states


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").removesuffix(".pt"))


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary files of an interrupted save excluded)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith("step_") and not p.name.endswith(".tmp")]
    return sorted(done, key=step_of)


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)  # the rename itself, durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        if dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
        if dist.get_rank() == 0:
            torch.save({**_plain(state), "rngs": rngs, "step": step}, tmp / "trainer.pt")
            os.replace(tmp, final)
        dist.barrier()
    else:
        final = root / f"step_{step:08d}.pt"
        if world_size() == 1 or dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            payload = {
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                **_plain(state),
                "rngs": rngs,
                "step": step,
            }
            tmp = final.with_name(final.name + ".tmp")
            torch.save(payload, tmp)
            _fsync_replace(tmp, final)
        if world_size() > 1:
            dist.barrier()
    if world_size() == 1 or dist.get_rank() == 0:
        for old in checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    return final


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """Objects with a state_dict become their state; the rest is kept as it is."""
    return {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG states from `path`; return the rest of the state."""
    try:
        if path.is_dir():  # sharded (FSDP2)
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(model, optimizer)
            sharded = {"model": model_state, "optimizer": optim_state}
            dcp.load(sharded, checkpoint_id=path)
            set_state_dict(
                model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"]
            )
            payload = torch.load(path / "trainer.pt", weights_only=True)
        else:
            payload = torch.load(path, weights_only=True, map_location="cpu")
            unwrap(model).load_state_dict(payload.pop("model"))
            optimizer.load_state_dict(payload.pop("optimizer"))
    except (RuntimeError, ValueError, KeyError, OSError, EOFError, pickle.UnpicklingError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise UserError(
            f"cannot resume from {path}: {reason}; it is not a checkpoint of this model and run "
            "(start a new run directory, or trainer.resume=disabled)"
        ) from exc
    rngs = payload.pop("rngs")
    rank = dist.get_rank() if world_size() > 1 else 0
    # Another number of ranks than when saved (the model and data position do not depend on it):
    # a new rank takes the generators of rank (rank mod saved ranks); only dropout masks differ.
    set_rng_state(rngs[rank % len(rngs)])
    return payload
