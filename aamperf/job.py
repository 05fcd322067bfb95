"""What a run trains with, built from its config in order: device and ranks, the phases' settings and
`auto` decisions, the device's peak, data, model and loss, the phased plan, the batch (found, with
trainer.batch_size=auto), loader workers (dataloader=auto), and the FLOPs of a step."""

import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from aamperf.batch_size import find_batch_size, smallest_batch
from aamperf.data import build_data, rebatch
from aamperf.data.categorical import condition_model
from aamperf.data.loaders import make_loaders
from aamperf.data.samples import count_range
from aamperf.device import resolve_device, sync, to_device
from aamperf.distributed import World, from_main, init_world, main_decides, world_size
from aamperf.errors import UserError
from aamperf.finetune import freeze, load_pretrained
from aamperf.metrics import count_flops, machine, matmul_dtype, peak_flops
from aamperf.metrics.flops import LoadWatch
from aamperf.phases import TRIAL_BATCHES, Plan, apply_phases, check_phases, setup_phases
from aamperf.phases import dataloader as loader_phase
from aamperf.phases.aam_ops import set_full_length
from aamperf.phases.auto import resolve_auto
from aamperf.phases.compile import trial_context
from aamperf.probe import Probe, measured, measuring
from aamperf.probe_measures import timed
from aamperf.rng import forked_rng, seed_everything
from aamperf.summary import Summary
from aamperf.targets import learn_target
from aamperf.trainer.cached import head_flops, refusal, use_cached_embeddings
from aamperf.trainer.checkpoints import steps_left
from aamperf.trainer.gradcache import caches_gradients
from aamperf.trainer.stream import BatchStream


@dataclass
class Job:
    device: torch.device
    world: World
    data: Any
    loss_fn: Any
    plan: Plan
    non_blocking: bool
    model_flops: float  # of one optimizer step: the model's math
    hardware_flops: float  # ... what the phases made the code execute
    peak_flops: float | None


def build_job(cfg: DictConfig, summary: Summary, run_dir: Path | None = None) -> Job:
    """Build the run; `summary` gets what each part decided as it is decided (a failed start keeps it).
    `run_dir`: where trainer.resume=auto finds the checkpoint the run goes on from."""
    entered = time.perf_counter()
    device = resolve_device(cfg.device)
    summary.update(device=str(device), machine=machine(device))
    if device.type == "cuda":  # what the GPU held before this job (an earlier job, a notebook): not its peak
        torch.cuda.reset_peak_memory_stats(device)
    check_phases(cfg, device)
    world = init_world(cfg, device)
    summary.update(world_size=world.world_size, rank=world.rank)
    setup = setup_phases(cfg, device)
    summary["phases"] = setup.records
    seed_everything(cfg.seed)
    auto_batch = cfg.trainer.batch_size == "auto"  # found below; the smallest batch until then
    tc = cfg.trainer
    micro_batch = smallest_batch(world.world_size) if auto_batch else tc.batch_size // tc.grad_accum_steps
    # before the data and its loader workers exist: nothing of this run competes with the measurements
    measuring = Stopwatch()  # the time spent deciding `auto` options: summary.json auto_s
    with measuring:
        decisions = resolve_auto(cfg, device, micro_batch)
    peak, summary["peak_flops_calibration"] = measure_peak(cfg, device, micro_batch)
    reading = Stopwatch()  # reading or simulating the data, its loaders
    with reading:
        data = build_data(
            cfg.data,
            batch_size=micro_batch,  # one micro-batch, all ranks
            seed=cfg.seed,
            loader=setup.loader,
            pad_to=setup.pad_to,
            rank=world.rank,
            world_size=world.world_size,
            val_batch_size=tc.val_batch_size,
        )
    model, loss_fn = build_model(cfg, device, world, data, summary)
    host_batches, batch_s = timed_batches(data.train_loader, cfg.metrics.flop_batches)
    first = to_device(host_batches[0], device)
    # A model without an analytic count is counted by torch now, eager and before any phase
    # (FlopCounterMode cannot see inside compiled kernels); AAM is counted after its phases.
    counted = None if hasattr(model, "flops_per_step") else counted_flops(model, loss_fn, first)
    trial = [first] + [to_device(b, device) for b in host_batches[1:TRIAL_BATCHES]]
    warmup, steps = warmup_step(loss_fn, trial), steps_left(tc, run_dir)
    precision = decisions.get("precision", {})  # precision=auto's, which a GPU's step trial may turn to fp32
    # compile=auto's hint whether a run is short enough to time a step against the compiler's import: the
    # step's FLOPs at the peak, counted before the phases (fewer after some: a hint, never a decision)
    least_step_s = None
    if cfg.compile.mode == "auto" and peak:
        hint = counted if counted is not None else min(analytic_flops(model, host_batches))
        least_step_s = hint / peak if hint > 0 else None
    heads_only = refusal(cfg, model, loss_fn, data, device, world.world_size) is None  # cached embeddings
    plan = apply_phases(
        model, cfg, device, warmup, setup.records, world, micro_batch, steps, precision or None, least_step_s,
        heads_only,
    )  # fmt: skip
    if "step_trial" in precision and precision["chose"] == "fp32":  # the peak of the dtype it runs
        peak, summary["peak_flops_calibration"] = measure_peak(cfg, device, micro_batch)
    for group, decision in decisions.items():  # each `auto` beside what its phase then did
        plan.records[group]["auto"] = decision
    measuring.seconds += plan.records["compile"].get("decide_s", 0.0)
    measuring.seconds += precision.get("decide_s", 0.0)
    if auto_batch:
        with measuring:
            found = find_batch_size(plan, loss_fn, data, cfg, device, world.world_size)
        summary["batch_finder"] = found
        tc.batch_size, tc.grad_accum_steps = found["batch_size"], found["grad_accum_steps"]
        with reading:
            rebatch(data, found["micro_batch"], cfg.seed, setup.loader)
        host_batches, batch_s = timed_batches(data.train_loader, cfg.metrics.flop_batches)
        if counted is not None:  # a model torch counts: counted again at the batch it will train on
            counted = counted_flops(model, loss_fn, to_device(host_batches[0], device))
    # gradient caching (a pairwise loss over micro-batches) forwards each micro-batch twice: hardware FLOPs
    forwards = 4 if caches_gradients(loss_fn, tc.grad_accum_steps) else 3
    if counted is not None:  # a plug-in model is counted by torch: its model FLOPs are what it executes
        again = counted_forward(model, loss_fn, to_device(host_batches[0], device)) if forwards == 4 else 0.0
        flops = (counted, counted + again)
    else:
        flops = analytic_flops(model, host_batches, forwards)
    if cfg.dataloader.num_workers == "auto":
        step_s = None if auto_batch else plan.records["compile"].get("auto", {}).get("eager_step_s")
        with measuring:
            loader_workers(
                cfg, setup, plan, data, loss_fn, host_batches[0], batch_s, step_s, flops[1], peak, device,
                world, steps,
            )  # fmt: skip
    # stage 2 with a frozen encoder: every sample embedded once, the steps train the heads on them
    if use_cached_embeddings(cfg, plan, model, data, loss_fn, device, world.world_size, summary):
        flops = head_flops(model, host_batches, forwards)
    model_flops, hardware_flops = (f * tc.grad_accum_steps for f in flops)
    summary.update(
        auto_s=round(measuring.seconds, 3),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware_flops,
        flops_per_step=model_flops,  # the record's older key: the model FLOPs
        peak_flops=peak,
        n_params=sum(p.numel() for p in model.parameters()),
        n_train=data.n_train,
        n_val=data.n_val,
        val_batch_size=data.val_loader.batch_size,  # the UniFrac part of a val loss: the pairs in a batch
        unifrac_mode=data.unifrac_mode,
        unifrac_cached=data.unifrac_cached,
        samples_cached=data.samples_cached,
        **data.counts,  # what reading the data left out or changed (samples too shallow, sequences cut, ...)
    )
    built_s = time.perf_counter() - entered
    setup_s = built_s - measuring.seconds - reading.seconds
    summary.parts_s.update(setup=setup_s, auto=measuring.seconds, data=reading.seconds)
    non_blocking = setup.loader.non_blocking
    return Job(device, world, data, loss_fn, plan, non_blocking, model_flops, hardware_flops, peak)


class Stopwatch:
    """Seconds spent inside its `with` blocks, added up; 0.0 where nothing ran in one."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self.started


def build(cfg: DictConfig, name: str, **kwargs: Any) -> Any:
    """instantiate() with a user-facing error: a wrong kwarg of `model`/`loss` names the override."""
    try:
        return instantiate(cfg[name], **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        raise UserError(
            f"{name}: cannot build {cfg[name].get('_target_')}: {cause}; fix the {name}.* overrides "
            f"or conf/{name}/"
        ) from exc


def build_model(cfg: DictConfig, device: torch.device, world: World, data, summary: dict[str, Any]):
    """The model on its device (the same initial weights on every rank) and the loss, told the target's
    scale where the data has one."""
    loss_fn = build(cfg, "loss")
    learn_target(cfg, loss_fn, data.target, summary)  # before the model: its target head follows the target
    condition_model(cfg, data.categorical, summary)  # its categorical tables follow data.categorical
    if cfg.model.get("count_head") and hasattr(loss_fn, "set_counts"):  # the scale of the counts it learns
        low, high = count_range(data.dataset.reads, list(data.train_loader.dataset.indices))
        loss_fn.set_counts(low, high)
        summary["count_head"] = {"count_low": low, "count_high": high}
    model = build(cfg, "model")
    if not isinstance(model, torch.nn.Module):
        raise UserError(
            f"model: {cfg.model.get('_target_')} returned a {type(model).__name__}, not a "
            "torch.nn.Module; fix model._target_"
        )
    model = model.to(device)
    # stage 2: a pretrained run's weights (init.from_run), parts kept as they are (finetune.freeze); before
    # any phase wraps the model; a resumed run's checkpoint is loaded over them later (fit)
    load_pretrained(model, cfg, summary)
    freeze(model, cfg, summary)
    set_full_length(model, data.collate.tokens)  # the aam_ops phase may drop the ASV encoder's masks
    if world.world_size > 1:  # the same initial weights everywhere; from here each rank its own draws
        seed_everything(cfg.seed + world.rank)
    if "target" in summary:
        summary["target"]["samples_without_target"] = data.samples_without_target  # left out of the run
    return model, loss_fn


def loader_workers(
    cfg, setup, plan, data, loss_fn, batch, batch_s, step_s, hardware_flops, peak, device, world, steps
) -> None:
    """dataloader=auto, now that a step can be timed: a worker where making a batch would hold the step
    up. The step's seconds: `step_s` (compile=auto timed it on this batch where it did not compile),
    else a floor from its FLOPs where that settles it (the first rank's, from the peak it calibrated),
    else one step timed by every rank together (a step's collectives pair up across the ranks), once per
    device and configuration (`loader_step_s`).
    Where making a batch is a share of that, both pipelines are timed (`timed_pipelines`). Every rank
    loads as the first rank decided."""
    floor = False
    if step_s is None:
        step_s = loader_phase.step_floor_s(hardware_flops, peak, batch_s)
        floor = step_s is not None
    step_s, floor = from_main((step_s, floor))
    source = None
    if step_s is None:
        step = warmup_step(loss_fn, [to_device(batch, device)])
        step_s, source = loader_step_s(cfg, plan, step, device, data.train_loader.batch_size)
    batch_s, step_s = from_main((batch_s, step_s))  # every rank times the same trial, or none
    per_round = loader_phase.trial_steps(batch_s, step_s, steps, cfg.dataloader.prefetch_factor or 0)
    trial = None if per_round is None else timed_pipelines(cfg, setup, plan, data, loss_fn, device, per_round)
    notes = plan.records["dataloader"]["notes"]
    asked = cfg.dataloader
    decision = loader_phase.decide_workers(
        setup.loader, asked, batch_s, step_s, notes, floor, trial, steps, step_source=source
    )
    loader, plan.records["dataloader"] = from_main(decision)
    if loader is not None:
        setup.loader = loader
        rebatch(data, data.train_loader.batch_size, cfg.seed, loader)


def loader_step_s(cfg, plan, step, device: torch.device, batch_size: int) -> tuple[float, str]:
    """dataloader=auto's step seconds where nothing else gave them, and where they came from: the first
    rank's cached figure (the loader trial's context: this model, its phases, data and loader, the ranks),
    or a warm step timed now by every rank and kept where the first rank's machine was quiet while it ran
    ("measured"; "measured_under_load": busy, not kept) (the default run's timing cost each run 0.7-0.9 s
    of its 32 s of training, 2-core AVX2 EPYC)."""
    probe = Probe(device, cfg.probe.cache, cfg.probe.refresh)
    context = {"context": loader_context(cfg, batch_size)}
    cached = from_main(probe.cached("loader_step", context))
    if cached is not None:
        return cached["step_s"], "cache"
    started, watch = measuring("loader_step", probe.cache_file), LoadWatch()
    step_s = warm_step_s(step, plan, device)
    load = watch.stop()
    measured("loader_step", started)
    if LoadWatch.verdict(load, use_loadavg=False) is not None:
        return step_s, "measured_under_load"  # this run's figure, not kept for the next
    if plan.is_main:
        probe.keep("loader_step", context, {"step_s": step_s, **load})
    return step_s, "measured"


def timed_pipelines(cfg, setup, plan, data, loss_fn, device, per_round: int) -> dict[str, Any]:
    """`time_pipelines` on the run's model and batches (loaders of their own: the run's batch order stays
    as it was), every rank together; the first rank's figures, cached per device and configuration."""
    probe = Probe(device, cfg.probe.cache, cfg.probe.refresh)
    context = {"context": loader_context(cfg, data.train_loader.batch_size)}
    cached = from_main(probe.cached("loader_trial", context))
    if cached is not None:
        return {**cached, "source": "cache"}

    def make_stream(workers: int) -> BatchStream:
        loader = loader_phase.with_one_worker(setup.loader, cfg.dataloader) if workers else setup.loader
        indices = [list(split.dataset.indices) for split in (data.train_loader, data.val_loader)]
        train, _ = make_loaders(
            data.dataset, data.collate, *indices, batch_size=data.train_loader.batch_size, seed=cfg.seed,
            loader=loader,
        )  # fmt: skip
        return BatchStream(train)

    def step(batch: dict[str, Any]) -> None:
        warmup_step(loss_fn, [to_device(batch, device, setup.loader.non_blocking)])(
            plan.model, plan.autocast, plan.scaler
        )
        sync(device)

    lead_in = cfg.dataloader.prefetch_factor or 0
    started = measuring("loader_trial", probe.cache_file)
    with forked_rng(device):  # dropout draws: the run's random streams stay as they were
        figures = loader_phase.time_pipelines(make_stream, step, per_round, lead_in)
    measured("loader_trial", started)
    if plan.is_main:  # the first rank's figures are the decision's
        probe.keep("loader_trial", context, figures)
    return {**figures, "source": "measured"}


def loader_context(cfg: DictConfig, batch_size: int) -> str:
    """What a loader trial's figures depend on besides the device: the compile trial's context (the model
    and the phases that change its step), the data, the loader asked for, the ranks."""
    nodes = {group: OmegaConf.to_container(cfg[group], resolve=True) for group in ["data", "dataloader"]}
    nodes.update(step=trial_context(cfg, batch_size), world_size=world_size())
    return hashlib.sha1(json.dumps(nodes, sort_keys=True, default=str).encode()).hexdigest()[:16]


def counted_flops(model: torch.nn.Module, loss_fn, batch: dict[str, Any]) -> float:
    """FLOPs of one forward + backward of a model without an analytic count, as torch dispatches them
    (its dropout drawn aside: the run's random streams stay as they were)."""
    with forked_rng(batch["tokens"].device):
        flops = count_flops(lambda: loss_fn(model, batch, 0)[0].backward())
    model.zero_grad(set_to_none=True)
    return flops


def counted_forward(model: torch.nn.Module, loss_fn, batch: dict[str, Any]) -> float:
    """FLOPs of the forward gradient caching adds (embeddings without a graph), as torch dispatches them."""
    with torch.no_grad(), forked_rng(batch["tokens"].device):
        return count_flops(lambda: loss_fn.embed(model, batch, 0))


def analytic_flops(
    model: torch.nn.Module, host_batches: list[dict[str, Any]], forwards: int = 3
) -> tuple[float, float]:
    """Mean (model, hardware) FLOPs of a forward + backward over `host_batches`: the model's math on
    the real ASVs, and what the phases made the code execute (`AAM.batch_flops`; `forwards`: 4 where
    gradient caching forwards each micro-batch twice)."""
    per_batch = [model.batch_flops(b["tokens"], b.get("asv_ids"), forwards) for b in host_batches]
    return tuple(sum(f[i] for f in per_batch) / len(per_batch) for i in range(2))


def calibration_shapes(model_cfg: DictConfig, micro_batch: int, max_asvs: int) -> list[tuple[int, int, int]]:
    """The model's own big matmul for the CPU peak calibration: AAM's ASV-encoder FFN up-projection,
    [rows * seq_len, D] x [D, ffn_mult * D] (none for a model without these keys: the square only)."""
    if not {"embedding_dim", "ffn_mult", "seq_len"} <= set(model_cfg.keys()):
        return []
    dim = model_cfg.embedding_dim
    return [(micro_batch * max_asvs * model_cfg.seq_len, dim, model_cfg.ffn_mult * dim)]


def measure_peak(cfg: DictConfig, device: torch.device, micro_batch: int) -> tuple[float | None, dict]:
    """The device's peak FLOP/s for the dtype the matmuls run in: metrics.peak_flops where given, else
    the table (GPU) or a calibration (CPU) by the first rank alone while the others wait, and every rank
    takes it: ranks calibrating together would each see the others' load."""
    dtype = matmul_dtype(device, cfg.precision.dtype, cfg.precision.matmul_precision)
    if cfg.metrics.peak_flops is not None:
        given = f"metrics.peak_flops={cfg.metrics.peak_flops}"
        return cfg.metrics.peak_flops, {"status": "given", "dtype": dtype, "reason": given}
    shapes = calibration_shapes(cfg.model, micro_batch, cfg.data.max_asvs)
    return main_decides(lambda: peak_flops(device, dtype, cfg.metrics.peak_flops_cache, shapes))


def warmup_step(loss_fn, batches: list[dict[str, Any]]):
    """One forward + backward on batch i of `batches` (compilation happens here, and compile=auto's
    trial), leaving no gradients behind."""

    def run(model: torch.nn.Module, autocast, scaler, i: int = 0) -> None:
        try:
            with autocast():
                loss, _ = loss_fn(model, batches[i % len(batches)], 0)
            scaler.scale(loss).backward()
        finally:  # also where a trial's step ran out of memory half way through backward
            model.zero_grad(set_to_none=True)

    return run


def timed_batches(loader, n: int) -> tuple[list[dict[str, Any]], float]:
    """The loader's first `n` batches, and the seconds each took to make (to arrive, with workers)."""
    start = time.perf_counter()
    batches = list(itertools.islice(loader, n))
    return batches, (time.perf_counter() - start) / len(batches)


def warm_step_s(step, plan, device: torch.device) -> float:
    """Seconds of one forward + backward of the phased model, after one untimed (dropout draws
    forked: the run's random stream stays as it was)."""
    with forked_rng(device):
        return timed(lambda: step(plan.model, plan.autocast, plan.scaler), device, trials=1)[0]
