"""The process's random generators: seeded at start, captured and restored (checkpoints, the batch-size
finder's trial steps) as plain Python values."""

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from aamperf.distributed import world_size


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def forked_rng(device: torch.device):
    """Within: random draws (a trial's dropout) leave the run's streams as they were, the CPU's and on
    CUDA `device`'s (torch's fork_rng forks no GPU's stream when given devices=[])."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


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
