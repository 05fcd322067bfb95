"""AdamW, built after every model transform: per-parameter loop, multi-tensor (foreach) or fused."""

import torch
from omegaconf import DictConfig

from aamperf.phases.record import applied, skipped


def build_optimizer(
    params: list[torch.nn.Parameter], trainer: DictConfig, cfg: DictConfig
) -> tuple[torch.optim.Optimizer, dict]:
    kwargs = {"foreach": cfg.impl == "foreach", "fused": cfg.impl == "fused" or None}
    optimizer = torch.optim.AdamW(params, lr=trainer.lr, weight_decay=trainer.weight_decay, **kwargs)
    if cfg.impl == "for_loop":
        return optimizer, skipped("optimizer=adamw_for_loop (one parameter at a time)")
    return optimizer, applied(impl=cfg.impl)
