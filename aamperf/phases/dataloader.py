"""DataLoader settings for the device: workers, pinned memory and async copies only where they help.

dataloader=auto (`num_workers: auto`) starts with batches made in the training process, times making
them and a training step of the run's own model, and moves batch-making to a worker only where it is
at least MIN_BATCH_SHARE of a step: below that, a worker saves less than it costs (its process' memory,
and on a CPU run, time taken from the cores the step's threads use). No step is timed where the step's
FLOPs at the device's peak already put batch-making far below that share (`step_floor_s`).
"""

import torch
from omegaconf import DictConfig, OmegaConf

from aamperf.phases.record import applied, skipped

MIN_BATCH_SHARE = 0.05  # batch-making time / step time from which one worker pays


def in_process(cfg: DictConfig) -> DictConfig:
    cfg.num_workers, cfg.persistent_workers, cfg.prefetch_factor = 0, False, None
    return cfg


def check_dataloader(cfg: DictConfig) -> list[str]:
    workers = cfg.num_workers
    if workers == "auto" or (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0):
        return []
    return [f"dataloader.num_workers={workers} must be an integer >= 0 or auto"]


def resolve_dataloader(cfg: DictConfig, device: torch.device) -> tuple[DictConfig, dict]:
    """The loader config to use on `device`, and what was changed (num_workers=auto: in-process until
    `decide_workers` has measured)."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    notes = []
    if device.type != "cuda" and (cfg.pin_memory or cfg.non_blocking):
        cfg.pin_memory = cfg.non_blocking = False
        notes.append(f"pin_memory and non_blocking off: no host-to-GPU copy on {device.type}")
    if cfg.num_workers == "auto":
        pending = skipped("dataloader=auto: decided after timing a batch and a step", notes=notes)
        return in_process(cfg), pending
    if cfg.num_workers == 0:
        in_process(cfg)
        return cfg, skipped("dataloader=simple (batches made in the training process)", notes=notes)
    return cfg, applied(**OmegaConf.to_container(cfg), notes=notes)


def step_floor_s(flops: float, peak: float | None, batch_s: float) -> float | None:
    """A floor on the step's seconds, its FLOPs at the device's peak FLOP/s (no step runs faster),
    where it alone settles the decision: making a batch is under a quarter of MIN_BATCH_SHARE of it
    (room for a peak measured 4x low). None where a step must be timed."""
    if not peak or flops <= 0:
        return None
    floor = flops / peak
    return floor if batch_s / floor < MIN_BATCH_SHARE / 4 else None


def decide_workers(
    cfg: DictConfig,
    requested: DictConfig,
    batch_s: float,
    step_s: float,
    notes: list[str] = (),
    floor: bool = False,
) -> tuple[DictConfig | None, dict]:
    """dataloader=auto: (the loader config with one worker, or None to keep batches in-process;
    the decision with its measured reason). `cfg` is the resolved (in-process) loader config,
    `requested` the dataloader node as asked for (its persistent_workers and prefetch_factor),
    `notes` those of `resolve_dataloader`; `floor`: `step_s` is `step_floor_s`, not a timed step."""
    share = batch_s / step_s
    workers = 1 if share >= MIN_BATCH_SHARE else 0
    step = (
        f"at most {share:.2%} of a step here, which takes at least {step_s * 1e3:.0f} ms (its FLOPs at "
        "the calibrated peak)"
        if floor
        else f"{share:.1%} of a {step_s * 1e3:.0f} ms step here"
    )
    reason = (
        f"making a batch takes {batch_s * 1e3:.1f} ms, {step} "
        f"({'>=' if workers else '<'} {MIN_BATCH_SHARE:.0%}): "
        + ("one loader worker" if workers else "batches made in the training process")
    )
    step_key = "step_floor_s" if floor else "step_s"
    auto = {"chose": workers, "reason": reason, "batch_s": batch_s, step_key: step_s}
    if not workers:
        record = skipped(f"dataloader=auto: {reason}", **OmegaConf.to_container(cfg), notes=list(notes))
        return None, {**record, "auto": auto}
    with_worker = {
        "num_workers": 1,
        "persistent_workers": requested.persistent_workers,
        "prefetch_factor": requested.prefetch_factor,
    }
    cfg = OmegaConf.merge(cfg, with_worker)
    return cfg, applied(**OmegaConf.to_container(cfg), notes=list(notes), auto=auto)
