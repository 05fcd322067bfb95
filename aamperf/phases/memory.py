"""Activation checkpointing per transformer layer and CUDA allocator settings (the memory guard that
watches a run is in aamperf/guards/memory.py)."""

import logging
import os

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from aamperf.model.layers import Block
from aamperf.phases.record import applied, skipped

log = logging.getLogger(__name__)


def check_memory(cfg: DictConfig) -> list[str]:
    problems = []
    if cfg.recompute_every < 1:
        problems.append(f"memory.recompute_every={cfg.recompute_every} must be >= 1")
    if not 0 < cfg.warn_fraction <= 1:
        problems.append(f"memory.warn_fraction={cfg.warn_fraction} must be in (0, 1]")
    if not 0 < cfg.max_fraction <= 1:
        problems.append(f"memory.max_fraction={cfg.max_fraction} must be in (0, 1]")
    return problems


def apply_checkpointing(model: nn.Module, cfg: DictConfig) -> dict:
    """Wrap transformer layers so their activations are recomputed in backward instead of kept.

    full: every layer; selective: layers 0, k, 2k, ... of each stack (k = memory.recompute_every).
    The wrapper keeps state_dict keys unchanged (checkpoints stay loadable either way).
    """
    if cfg.checkpointing == "none":
        return skipped("memory.checkpointing=none")
    every = 1 if cfg.checkpointing == "full" else cfg.recompute_every
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, nn.ModuleList) and any(isinstance(m, Block) for m in parent):
            for i, block in enumerate(parent):
                if isinstance(block, Block) and i % every == 0:
                    parent[i] = checkpoint_wrapper(block)  # non-reentrant torch.utils.checkpoint
                    wrapped += 1
    if not wrapped:
        return skipped("the model has no transformer Block to checkpoint")
    return applied(mode=cfg.checkpointing, every=every, layers=wrapped)


def apply_cuda_memory(cfg: DictConfig, device: torch.device) -> dict:
    """Allocator settings that only exist on a GPU."""
    if device.type != "cuda":
        return skipped(f"no GPU ({device.type}): CUDA memory fraction and expandable segments do not apply")
    done = {}
    if cfg.expandable_segments:
        # Read by the CUDA caching allocator when it starts: effective only before the first allocation.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        done["expandable_segments"] = not torch.cuda.is_initialized()
    if cfg.cuda_memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(cfg.cuda_memory_fraction, device)
        done["memory_fraction"] = cfg.cuda_memory_fraction
    return applied(**done) if done else skipped("no CUDA memory setting chosen")
