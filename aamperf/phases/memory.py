"""Activation checkpointing per transformer layer, CUDA allocator settings, and a memory guard."""

import gc
import logging
import math
import os
import time

import psutil
import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from aamperf.model.layers import Block
from aamperf.phases.record import applied, skipped

log = logging.getLogger(__name__)
CHECKPOINTING = ("none", "full", "selective", "auto")  # auto: aamperf/phases/auto.py


def check_memory(cfg: DictConfig) -> list[str]:
    problems = []
    if cfg.checkpointing not in CHECKPOINTING:
        problems.append(f"memory.checkpointing={cfg.checkpointing} is not one of {', '.join(CHECKPOINTING)}")
    if cfg.checkpoint_every < 1:
        problems.append(f"memory.checkpoint_every={cfg.checkpoint_every} must be >= 1")
    if not 0 < cfg.warn_fraction <= 1:
        problems.append(f"memory.warn_fraction={cfg.warn_fraction} must be in (0, 1]")
    if not 0 < cfg.max_fraction <= 1:
        problems.append(f"memory.max_fraction={cfg.max_fraction} must be in (0, 1]")
    return problems


def apply_checkpointing(model: nn.Module, cfg: DictConfig) -> dict:
    """Wrap transformer layers so their activations are recomputed in backward instead of kept.

    full: every layer; selective: layers 0, k, 2k, ... of each stack (k = memory.checkpoint_every).
    The wrapper keeps state_dict keys unchanged (checkpoints stay loadable either way).
    """
    if cfg.checkpointing == "none":
        return skipped("memory.checkpointing=none")
    every = 1 if cfg.checkpointing == "full" else cfg.checkpoint_every
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


class MemoryGuard:
    """Memory in use, as a fraction of system RAM (CPU) or of the device's memory (CUDA), checked at
    every step but read at most every `interval_s` (a read costs ~40 us). Above `warn_fraction`:
    collect garbage and empty the CUDA cache, once per crossing, with a warning (never every step:
    clearing costs time). Above `max_fraction`: a message for the trainer, which checkpoints and stops
    the run before the operating system kills it."""

    def __init__(self, cfg: DictConfig, device: torch.device, interval_s: float = 0.1):
        self.warn_fraction, self.max_fraction, self.device = cfg.warn_fraction, cfg.max_fraction, device
        self.interval_s = interval_s
        self.cleanups = 0
        self._above = False
        self._last_read = -math.inf

    def used_fraction(self) -> float:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return 1 - free / total
        return psutil.virtual_memory().percent / 100

    def check(self) -> str | None:
        """None, or why the run must stop now."""
        now = time.perf_counter()
        if now - self._last_read < self.interval_s:
            return None
        self._last_read = now
        fraction = self.used_fraction()
        if fraction >= self.max_fraction:
            where = "device memory" if self.device.type == "cuda" else "system RAM"
            return (
                f"memory at {100 * fraction:.0f}% of {where}, over memory.max_fraction="
                f"{self.max_fraction:g}; lower trainer.batch_size (or trainer.batch_size=auto), use "
                "memory=checkpointing or precision=bf16, or raise memory.max_fraction"
            )
        above = fraction >= self.warn_fraction
        if above and not self._above:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cleanups += 1
            log.warning(
                "memory at %.0f%% (memory.warn_fraction=%.2f): collected garbage and cleared caches",
                100 * fraction,
                self.warn_fraction,
            )
        self._above = above
        return None
