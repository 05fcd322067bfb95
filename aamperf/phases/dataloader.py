"""DataLoader settings for the device: workers, pinned memory and async copies only where they help.

dataloader=auto (`num_workers: auto`) starts with batches made in the training process and times making
them and a training step of the run's own model. Below MIN_BATCH_SHARE of a step, a worker could save
less than it costs (its process' memory, and on a CPU run, time taken from the cores the step's threads
use): batches stay in-process, and no step is timed where the step's FLOPs at the device's peak already
settle that (`step_floor_s`). From that share on, the two pipelines are timed against each other on the
run's model and batches (`time_pipelines`: a batch crossing a process boundary, and a worker beside the
step's threads, can cost more than making the batch did; a 2 ms step trained 2.3x slower with one) and a
worker is kept only where it was quicker in every round and saves more over the run's steps than it
took to start (`worker_pays`). The figures are cached per device and configuration.
"""

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from aamperf.phases.record import applied, skipped

MIN_BATCH_SHARE = 0.05  # batch-making time / step time from which one worker may pay: timed from there
TRIAL_ROUNDS = 3  # alternating rounds of each pipeline; a worker must be quicker in every one
TRIAL_ROUND_S = 0.2  # about this many seconds of steps per pipeline and round ...
TRIAL_STEPS = (4, 20)  # ... but at least / at most this many steps
MIN_WORKER_GAIN = 0.03  # a worker's step must be this much quicker (it costs a process's memory)


def in_process(cfg: DictConfig) -> DictConfig:
    cfg.num_workers, cfg.persistent_workers, cfg.prefetch_factor = 0, False, None
    return cfg


def check_dataloader(cfg: DictConfig) -> list[str]:
    problems = []
    workers = cfg.num_workers
    counted = isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0
    if not (workers == "auto" or counted):
        problems.append(f"dataloader.num_workers={workers} must be an integer >= 0 or auto")
    if cfg.prefetch_factor is not None and cfg.prefetch_factor < 1:
        problems.append(
            f"dataloader.prefetch_factor={cfg.prefetch_factor} must be >= 1 (batches each worker makes "
            "ahead), or null"
        )
    return problems


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


def trial_steps(batch_s: float, step_s: float, steps: int, prefetch: int) -> int | None:
    """Steps per round of `time_pipelines`, or None where the pipelines are not timed: making a batch is
    under MIN_BATCH_SHARE of a step, or a worker could not save over the run's `steps` (at most all of the
    batch-making) what timing it would cost (`prefetch`: a worker round's untimed lead-in)."""
    if batch_s / step_s < MIN_BATCH_SHARE:
        return None
    affordable = batch_s * steps > trial_cost_s(batch_s, step_s, prefetch)
    return steps_per_round(batch_s, step_s) if affordable else None


def steps_per_round(batch_s: float, step_s: float) -> int:
    return int(min(max(round(TRIAL_ROUND_S / (batch_s + step_s)), TRIAL_STEPS[0]), TRIAL_STEPS[1]))


def trial_cost_s(batch_s: float, step_s: float, prefetch: int) -> float:
    """About the seconds `time_pipelines` would take."""
    return TRIAL_ROUNDS * (2 * steps_per_round(batch_s, step_s) + prefetch) * (batch_s + step_s)


def time_pipelines(
    make_stream: Callable[[int], Iterator[dict]], step: Callable[[dict], None], per_round: int, lead_in: int
) -> dict[str, Any]:
    """Seconds per step of the training pipeline (the next batch, then `step` on it: to the device,
    forward + backward) with batches made in the process (`make_stream(0)`) and by one worker
    (`make_stream(1)`): TRIAL_ROUNDS alternating rounds of `per_round` steps each, their medians. A worker
    round starts with `lead_in` untimed steps: the batches its worker made while the other pipeline was
    timed. The worker's start (its first batch against an in-process first one) is its own figure."""
    streams, first = {}, {}
    rounds: dict[str, list[float]] = {"in_process": [], "worker": []}
    try:
        for name, workers in (("in_process", 0), ("worker", 1)):
            start = time.perf_counter()
            streams[name] = make_stream(workers)
            step(next(streams[name]))
            first[name] = time.perf_counter() - start
        for _ in range(TRIAL_ROUNDS):
            for name, times in rounds.items():
                for _ in range(lead_in if name == "worker" else 0):
                    step(next(streams[name]))
                start = time.perf_counter()
                for _ in range(per_round):
                    step(next(streams[name]))
                times.append((time.perf_counter() - start) / per_round)
    finally:
        streams.clear()  # the worker stops with its loader, now (a failed step's traceback keeps this frame)
    return {
        "in_process_step_s": statistics.median(rounds["in_process"]),
        "worker_step_s": statistics.median(rounds["worker"]),
        "worker_start_s": max(0.0, first["worker"] - first["in_process"]),
        "rounds": rounds,
        "steps_per_round": per_round,
    }


def worker_pays(figures: dict[str, Any], steps: int) -> tuple[bool, str]:
    """Does one loader worker pay over `steps`, given `time_pipelines`' figures? Only where its step was
    MIN_WORKER_GAIN quicker in every round and that saves more than the worker took to start."""
    in_rounds, worker_rounds = figures["rounds"]["in_process"], figures["rounds"]["worker"]
    quicker = all(w < i * (1 - MIN_WORKER_GAIN) for i, w in zip(in_rounds, worker_rounds, strict=True))
    in_s, worker_s = figures["in_process_step_s"], figures["worker_step_s"]
    start_s = figures["worker_start_s"]
    saved_s = (in_s - worker_s) * steps - start_s
    verdict = quicker and saved_s > 0
    why = (
        f"a step with one loader worker took {worker_s / in_s:.2f}x one with batches made in the process "
        f"({worker_s * 1e3:.3g} vs {in_s * 1e3:.3g} ms, median of {len(in_rounds)} alternating rounds of "
        f"{figures['steps_per_round']} steps), "
        + (
            f"{MIN_WORKER_GAIN:.0%} quicker in every round, saving {saved_s:.1f} s over {steps} steps after "
            f"its {start_s:.2f} s start"
            if verdict
            else f"not {MIN_WORKER_GAIN:.0%} quicker in every round"
            if not quicker
            else f"saving {saved_s + start_s:.2f} s over {steps} steps, not over its {start_s:.2f} s start"
        )
    )
    return verdict, why


def with_one_worker(cfg: DictConfig, requested: DictConfig) -> DictConfig:
    """The resolved loader config `cfg` with one worker, persistent and prefetching as `requested` asks."""
    with_worker = {
        "num_workers": 1,
        "persistent_workers": requested.persistent_workers,
        "prefetch_factor": requested.prefetch_factor,
    }
    return OmegaConf.merge(cfg, with_worker)


def decide_workers(
    cfg: DictConfig,
    requested: DictConfig,
    batch_s: float,
    step_s: float,
    notes: list[str] = (),
    floor: bool = False,
    trial: dict[str, Any] | None = None,
    steps: int = 0,
    step_source: str | None = None,
) -> tuple[DictConfig | None, dict]:
    """dataloader=auto: (the loader config with one worker, or None to keep batches in-process;
    the decision with its measured reason). `cfg` is the resolved (in-process) loader config,
    `requested` the dataloader node as asked for (its persistent_workers and prefetch_factor),
    `notes` those of `resolve_dataloader`; `floor`: `step_s` is `step_floor_s`, not a timed step;
    `trial`: `time_pipelines`' figures, where `trial_steps` asked for them; `steps`: the run's;
    `step_source`: "measured", "measured_under_load" or "cache" where the loader timed the step itself
    (`job.loader_step_s`)."""
    share = batch_s / step_s
    step = (
        f"at most {share:.2%} of a step here, which takes at least {step_s * 1e3:.0f} ms (its FLOPs at "
        "the calibrated peak)"
        if floor
        else f"{share:.1%} of a {step_s * 1e3:.0f} ms step here"
        + {"cache": " (timed by an earlier run)", "measured_under_load": " (timed under load: not kept)"}.get(
            step_source or "", ""
        )
    )
    made = f"making a batch takes {batch_s * 1e3:.1f} ms, {step}"
    if share < MIN_BATCH_SHARE:
        why, workers = f"(< {MIN_BATCH_SHARE:.0%})", 0
    elif trial is None:
        cost_s = trial_cost_s(batch_s, step_s, requested.prefetch_factor or 0)
        why, workers = (
            (
                f"(>= {MIN_BATCH_SHARE:.0%}), but a worker could save at most {batch_s * steps:.1f} s over "
                f"{steps} steps, no more than timing one would cost ({cost_s:.1f} s)"
            ),
            0,
        )
    else:
        pays, verdict = worker_pays(trial, steps)
        why, workers = f"(>= {MIN_BATCH_SHARE:.0%}), so both pipelines were timed: {verdict}", int(pays)
    reason = f"{made} {why}: " + ("one loader worker" if workers else "batches made in the training process")
    step_key = "step_floor_s" if floor else "step_s"
    auto = {"chose": workers, "reason": reason, "batch_s": batch_s, step_key: step_s}
    auto.update({"step_source": step_source} if step_source is not None else {})
    auto.update({"trial": trial} if trial is not None else {})
    if not workers:
        record = skipped(f"dataloader=auto: {reason}", **OmegaConf.to_container(cfg), notes=list(notes))
        return None, {**record, "auto": auto}
    cfg = with_one_worker(cfg, requested)
    return cfg, applied(**OmegaConf.to_container(cfg), notes=list(notes), auto=auto)
