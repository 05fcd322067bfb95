"""The optimizer, built after every model transform: AdamW (or the original AAM's other choices, Adam and
SGD with momentum: `optimizer.algorithm`), per-parameter loop, multi-tensor (foreach) or fused."""

import torch
from omegaconf import DictConfig

from aamperf.phases.record import applied, skipped

ALGORITHMS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def build_optimizer(
    params: list[torch.nn.Parameter], trainer: DictConfig, cfg: DictConfig
) -> tuple[torch.optim.Optimizer, dict]:
    """`optimizer.algorithm` over `params` at trainer.lr and trainer.weight_decay (Adam's and SGD's an L2
    penalty on the gradient, AdamW's decoupled), in `optimizer.impl`; SGD with `optimizer.momentum`."""
    algorithm = str(cfg.get("algorithm", "adamw"))
    kwargs = {"foreach": cfg.impl == "foreach", "fused": cfg.impl == "fused" or None}
    if algorithm == "sgd":
        kwargs["momentum"] = cfg.momentum
    optimizer = ALGORITHMS[algorithm](params, lr=trainer.lr, weight_decay=trainer.weight_decay, **kwargs)
    if cfg.impl == "for_loop":
        return optimizer, skipped(f"optimizer.impl=for_loop ({algorithm} one parameter at a time)")
    return optimizer, applied(impl=cfg.impl, algorithm=algorithm)
