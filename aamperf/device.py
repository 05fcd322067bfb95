"""The run's device: which one (`device=`), moving batches onto it, waiting for its queued work."""

import os
from typing import Any

import torch

from aamperf.data.branches import batch_unifrac
from aamperf.errors import UserError


def resolve_device(name: str) -> torch.device:
    """`device` -> a torch device; under torchrun each process takes the GPU of its local rank, which
    becomes its current one (NCCL's communicators, barrier() and every CUDA call without a device act
    on the current GPU, cuda:0 unless set)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name} but no CUDA device is available here; use device=cpu or device=auto")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index >= count:
            raise UserError(
                f"device={device} but this machine shows {count} CUDA device(s), cuda:0 to cuda:{count - 1} "
                "(under torchrun: one per local rank, --nproc_per_node at most that many)"
            )
        torch.cuda.set_device(device)
    return device


def to_device(batch: dict[str, Any], device: torch.device, non_blocking: bool = False) -> dict[str, Any]:
    """The batch's tensors on `device`; a batch that carries branch sets gets its UniFrac computed there."""
    moved = {
        k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()
    }
    if "branches" in moved:  # batch UniFrac (aamperf/data/branches.py): a few matrix products
        moved["unifrac"] = batch_unifrac(
            moved.pop("branches"), moved.pop("branch_lengths"), moved.pop("branch_rows")
        )
    return moved


def new_cuda_graph_step(device: torch.device) -> None:
    """Tell CUDA graph trees (compile=reduce_overhead) that a new forward begins, so replaying a graph
    may reuse the memory of the last step's outputs (no-op on CPU, and where nothing replays graphs)."""
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock step time is the step's real time (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
