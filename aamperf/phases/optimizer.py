"""The optimizer, built after every model transform: AdamW (or the original AAM's other choices, Adam and
SGD with momentum: `optimizer.algorithm`), per-parameter loop, multi-tensor (foreach) or fused."""

import torch
from omegaconf import DictConfig

from aamperf.phases.record import applied, skipped

ALGORITHMS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
# AAM's modules of the categorical conditioning (aamperf/model/aam.py): optimizer.categorical_lr's
CATEGORICAL = frozenset({
    "categorical_embeddings", "categorical_projection", "categorical_gate", "categorical_transform",
    "categorical_update", "categorical_norm", "output_scales", "output_biases",
})  # fmt: skip


def build_optimizer(
    named: list[tuple[str, torch.nn.Parameter]], trainer: DictConfig, cfg: DictConfig
) -> tuple[torch.optim.Optimizer, dict]:
    """`optimizer.algorithm` over the parameters `named` (name, parameter) at trainer.lr and
    trainer.weight_decay (Adam's and SGD's an L2 penalty on the gradient, AdamW's decoupled), in
    `optimizer.impl`; SGD with `optimizer.momentum`. With `optimizer.categorical_lr`, the categorical
    conditioning's parameters (`CATEGORICAL`, by name under any wrapper's prefix) in a second group at it."""
    algorithm = str(cfg.get("algorithm", "adamw"))
    kwargs = {"foreach": cfg.impl == "foreach", "fused": cfg.impl == "fused" or None}
    if algorithm == "sgd":
        kwargs["momentum"] = cfg.momentum
    groups, extra = parameter_groups(named, cfg.get("categorical_lr"))
    optimizer = ALGORITHMS[algorithm](groups, lr=trainer.lr, weight_decay=trainer.weight_decay, **kwargs)
    if cfg.impl == "for_loop":
        return optimizer, skipped(f"optimizer.impl=for_loop ({algorithm} one parameter at a time)", **extra)
    return optimizer, applied(impl=cfg.impl, algorithm=algorithm, **extra)


def parameter_groups(
    named: list[tuple[str, torch.nn.Parameter]], categorical_lr: float | None
) -> tuple[list[dict], dict]:
    """(the optimizer's parameter groups: one, or with `categorical_lr` the rest and the categorical
    conditioning's at it; what the phase record says of them)."""
    if categorical_lr is None:
        return [{"params": [p for _, p in named]}], {}
    categorical = [p for name, p in named if CATEGORICAL & set(name.split("."))]
    rest = [p for name, p in named if not CATEGORICAL & set(name.split("."))]
    groups = [{"params": rest}] if rest else []
    groups.append({"params": categorical, "lr": float(categorical_lr)})
    return groups, {
        "categorical_lr": float(categorical_lr),
        "categorical_params": sum(p.numel() for p in categorical),
    }
