"""torch.compile of the model (or of each transformer block), with a recorded fallback to eager."""

import time
from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch import nn

from aamperf.model.layers import Block
from aamperf.phases.record import applied, fallback, skipped

MODES = ("disabled", "default", "reduce-overhead", "max-autotune")


def check_compile(cfg: DictConfig) -> list[str]:
    if cfg.mode not in MODES:
        return [f"compile.mode={cfg.mode} is not one of {', '.join(MODES)}"]
    return []


def apply_compile(model: nn.Module, cfg: DictConfig, warmup: Callable[[], None]) -> dict:
    """Compile in place (state_dict keys unchanged), then run `warmup` (one forward + backward) so that
    compilation happens here, timed apart from the training steps. Any failure -> eager, recorded."""
    if cfg.mode == "disabled":
        return skipped("compile=disabled")
    # Per block: AAM's ASV gathering (nonzero / unique) would break one whole-model graph into pieces;
    # the blocks hold almost all the FLOPs and have no data-dependent ops.
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    targets = blocks if cfg.per_block and blocks else [model]
    mode = None if cfg.mode == "default" else cfg.mode
    start = time.perf_counter()
    try:
        for module in targets:
            module.compile(mode=mode, backend=cfg.backend, dynamic=cfg.dynamic, fullgraph=cfg.fullgraph)
        warmup()
    except Exception as exc:  # a backend that is missing or fails on this model: train eagerly instead
        for module in targets:
            module._compiled_call_impl = None  # the slot nn.Module.compile() fills: emptied, eager again
        torch._dynamo.reset()
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return fallback(f"torch.compile failed, running eager: {reason}", mode=cfg.mode, backend=cfg.backend)
    return applied(
        mode=cfg.mode,
        backend=cfg.backend,
        per_block=bool(cfg.per_block and blocks),
        modules=len(targets),
        compile_time_s=time.perf_counter() - start,
    )
