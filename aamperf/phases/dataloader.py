"""DataLoader settings for the device: workers, pinned memory and async copies only where they help."""

import torch
from omegaconf import DictConfig, OmegaConf

from aamperf.phases.record import applied, skipped


def resolve_dataloader(cfg: DictConfig, device: torch.device) -> tuple[DictConfig, dict]:
    """The loader config to use on `device`, and what was changed."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    notes = []
    if device.type != "cuda" and (cfg.pin_memory or cfg.non_blocking):
        cfg.pin_memory = cfg.non_blocking = False
        notes.append(f"pin_memory and non_blocking off: no host-to-GPU copy on {device.type}")
    if cfg.num_workers == 0:
        cfg.persistent_workers, cfg.prefetch_factor = False, None
        return cfg, skipped("dataloader=simple (batches made in the training process)", notes=notes)
    return cfg, applied(**OmegaConf.to_container(cfg), notes=notes)
