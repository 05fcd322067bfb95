"""One run from a composed config: build data, model and loss, fit, and write the run record."""

import datetime
import itertools
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from aamperf.batch_size import find_batch_size, smallest_batch
from aamperf.checks import check_config
from aamperf.data import build_data, rebatch
from aamperf.device import resolve_device, to_device
from aamperf.distributed import adopt_slurm_env, close_world, init_world, peer_lost
from aamperf.errors import RunAborted, UserError
from aamperf.interrupts import Interrupts, RunInterrupted
from aamperf.loggers import open_sinks
from aamperf.metrics import (
    NullRecord,
    RunRecord,
    StepMeter,
    SystemMonitor,
    count_flops,
    job_origin,
    matmul_dtype,
    null_reason,
    peak_flops,
    release_freed_memory,
    start_job_peak_rss,
    utilization,
)
from aamperf.phases import TRIAL_BATCHES, apply_phases, check_phases, setup_phases
from aamperf.phases.auto import resolve_auto
from aamperf.phases.compile import compiled_graphs
from aamperf.phases.dataloader import decide_workers, step_floor_s
from aamperf.probe import timed
from aamperf.rng import seed_everything
from aamperf.trainer import fit

log = logging.getLogger(__name__)


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


def counted_flops(model: torch.nn.Module, loss_fn, batch: dict[str, Any]) -> float:
    """FLOPs of one forward + backward of a model without an analytic count, as torch dispatches them."""
    flops = count_flops(lambda: loss_fn(model, batch, 0)[0].backward())
    model.zero_grad(set_to_none=True)
    return flops


def analytic_flops(model: torch.nn.Module, host_batches: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean (model, hardware) FLOPs of a forward + backward over `host_batches`: the model's math on
    the real ASVs, and what the phases made the code execute (`AAM.batch_flops`)."""
    per_batch = [model.batch_flops(b["tokens"], b.get("asv_ids")) for b in host_batches]
    return tuple(sum(f[i] for f in per_batch) / len(per_batch) for i in range(2))


def calibration_shapes(model_cfg: DictConfig, micro_batch: int, max_asvs: int) -> list[tuple[int, int, int]]:
    """The model's own big matmul for the CPU peak calibration: AAM's ASV-encoder FFN up-projection,
    [rows * seq_len, D] x [D, ffn_mult * D] (none for a model without these keys: the square only)."""
    if not {"embedding_dim", "ffn_mult", "seq_len"} <= set(model_cfg.keys()):
        return []
    dim = model_cfg.embedding_dim
    return [(micro_batch * max_asvs * model_cfg.seq_len, dim, model_cfg.ffn_mult * dim)]


def measure_peak(cfg: DictConfig, device: torch.device, world, micro_batch: int) -> tuple[float | None, dict]:
    """The device's peak FLOP/s for the dtype the matmuls run in, measured (CPU) by the first rank
    alone while the others wait: ranks calibrating together would each see the others' load."""
    peak, record = None, {"status": "not_measured", "reason": "only the first rank measures the peak"}
    if world.is_main:
        dtype = matmul_dtype(device, cfg.precision.dtype, cfg.precision.matmul_precision)
        shapes = calibration_shapes(cfg.model, micro_batch, cfg.data.max_asvs)
        peak, record = peak_flops(device, dtype, cfg.metrics.peak_flops_cache, shapes)
    if world.world_size > 1:
        torch.distributed.barrier()
    return peak, record


def warmup_step(loss_fn, batches: list[dict[str, Any]]):
    """One forward + backward on batch i of `batches` (compilation happens here, and compile=auto's
    trial), leaving no gradients behind."""

    def run(model: torch.nn.Module, autocast, scaler, i: int = 0) -> None:
        with autocast():
            loss, _ = loss_fn(model, batches[i % len(batches)], 0)
        scaler.scale(loss).backward()
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
    with torch.random.fork_rng(devices=[]):
        return timed(lambda: step(plan.model, plan.autocast, plan.scaler), device, trials=1)[0]


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """The config with interpolations resolved, or as written when one cannot be (a failed run)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # e.g. ${model.max_asvs} with a model that has none: the error is recorded already
        return OmegaConf.to_container(cfg, resolve=False)


def per_rank(summary: dict[str, Any], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """These summary figures of every rank, in rank order (a collective: every rank calls it)."""
    mine = {"rank": summary["rank"], **{k: summary.get(k) for k in keys}}
    everyone: list[dict[str, Any]] = [{} for _ in range(summary["world_size"])]
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def train(cfg: DictConfig, run_dir: Path, interrupts: Interrupts | None = None) -> dict[str, Any]:
    """Run one training job into `run_dir`; the summary is written there on success and on failure.
    `interrupts`: the stop signals caught while it runs (aamperf/interrupts.py)."""
    origin, origin_kind = job_origin()  # every elapsed time of the job counts from here
    if origin_kind == "job_start":  # an earlier job ran in this process: its peak is not this job's
        start_job_peak_rss()
    release_freed_memory()  # what earlier jobs of a multirun freed: not this job's memory
    if cfg.distributed.strategy != "none":
        adopt_slurm_env()  # a SLURM task: torchrun's variables from SLURM's
    main = cfg.distributed.strategy == "none" or int(os.environ.get("RANK", 0)) == 0
    # Only the first rank writes the run record and the logger runs; the others record nothing.
    record = (
        RunRecord(run_dir, sinks=open_sinks(cfg, run_dir, resolved_config(cfg))) if main else NullRecord()
    )
    meter = StepMeter(skip_steps=cfg.metrics.skip_steps, start_time=origin)
    summary: dict[str, Any] = {
        "status": "running",
        "optim": cfg.optim,
        "precision": cfg.precision.dtype,
        "device": None,
        "world_size": 1,
        "seed": cfg.seed,
        "started_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "clock_origin": origin_kind,
        "phases": {},
        "logger": [sink.info for sink in record.sinks],
        "error": None,
    }
    try:
        check_config(cfg)
        device = resolve_device(cfg.device)
        summary["device"] = str(device)
        check_phases(cfg, device)
        world = init_world(cfg, device)
        summary.update(world_size=world.world_size, rank=world.rank)
        setup = setup_phases(cfg, device)
        summary["phases"] = setup.records
        seed_everything(cfg.seed)
        auto_batch = cfg.trainer.batch_size == "auto"  # found below; the smallest batch until then
        micro_batch = (
            smallest_batch(world.world_size)
            if auto_batch
            else cfg.trainer.batch_size // cfg.trainer.grad_accum_steps
        )
        # before the data and its loader workers exist: nothing of this run competes with the measurements
        decisions = resolve_auto(cfg, device, micro_batch, world)
        peak, peak_record = measure_peak(cfg, device, world, micro_batch)
        data = build_data(
            cfg.data,
            batch_size=micro_batch,  # one micro-batch, all ranks
            seed=cfg.seed,
            loader=setup.loader,
            pad_to=setup.pad_to,
            rank=world.rank,
            world_size=world.world_size,
        )
        model = build(cfg, "model")
        if not isinstance(model, torch.nn.Module):
            raise UserError(
                f"model: {cfg.model.get('_target_')} returned a {type(model).__name__}, not a "
                "torch.nn.Module; fix model._target_"
            )
        model = model.to(device)
        if world.world_size > 1:  # the same initial weights everywhere; from here each rank its own draws
            seed_everything(cfg.seed + world.rank)
        loss_fn = build(cfg, "loss")
        if data.has_target and hasattr(loss_fn, "scale_target"):  # a target in its own units: standardized
            loss_fn.scale_target(data.target_mean, data.target_std)
            summary["target"] = {
                "column": cfg.data.target,
                "mean": data.target_mean,
                "std": data.target_std,
                "samples_without_target": data.samples_without_target,  # left out of the run
            }
        host_batches, batch_s = timed_batches(data.train_loader, cfg.metrics.flop_batches)
        first = to_device(host_batches[0], device, False)
        # A model without an analytic count is counted by torch now, eager and before any phase
        # (FlopCounterMode cannot see inside compiled kernels); AAM is counted after its phases.
        counted = None if hasattr(model, "flops_per_step") else counted_flops(model, loss_fn, first)
        trial = [first] + [to_device(b, device, False) for b in host_batches[1:TRIAL_BATCHES]]
        warmup = warmup_step(loss_fn, trial)
        plan = apply_phases(model, cfg, device, warmup, setup.records, world, micro_batch)
        for group, decision in decisions.items():  # each `auto` beside what its phase then did
            plan.records[group]["auto"] = decision
        if auto_batch:
            found = find_batch_size(plan, loss_fn, data, cfg, device, world.world_size)
            summary["batch_finder"] = found
            cfg.trainer.batch_size, cfg.trainer.grad_accum_steps = (
                found["batch_size"],
                found["grad_accum_steps"],
            )
            rebatch(data, found["micro_batch"], cfg.seed, setup.loader)
            host_batches, batch_s = timed_batches(data.train_loader, cfg.metrics.flop_batches)
            if counted is not None:  # a model torch counts: counted again at the batch it will train on
                counted = counted_flops(model, loss_fn, to_device(host_batches[0], device, False))
        # a plug-in model is counted once by torch: its model FLOPs are what it executes
        model_flops, hardware_flops = (
            (counted, counted) if counted is not None else analytic_flops(model, host_batches)
        )
        if cfg.dataloader.num_workers == "auto":  # batches timed in-process above; now a step
            # the step's seconds: those compile=auto timed on this batch where it did not compile, else
            # a floor from its FLOPs where that settles it, else one timed now
            step_s = None if auto_batch else plan.records["compile"].get("auto", {}).get("eager_step_s")
            floor = False
            if step_s is None:
                step_s = step_floor_s(hardware_flops, peak, batch_s)
                floor = step_s is not None
            if step_s is None:
                one = warmup_step(loss_fn, [to_device(host_batches[0], device, False)])
                step_s = warm_step_s(one, plan, device)
            notes = plan.records["dataloader"]["notes"]
            loader, plan.records["dataloader"] = decide_workers(
                setup.loader, cfg.dataloader, batch_s, step_s, notes, floor=floor
            )
            if loader is not None:
                setup.loader = loader
                rebatch(data, data.train_loader.batch_size, cfg.seed, loader)
        model_flops *= cfg.trainer.grad_accum_steps
        hardware_flops *= cfg.trainer.grad_accum_steps
        summary.update(
            model_flops_per_step=model_flops,
            hardware_flops_per_step=hardware_flops,
            flops_per_step=model_flops,  # the record's older key: the model FLOPs
            peak_flops=peak,
            peak_flops_calibration=peak_record,
            n_params=sum(p.numel() for p in model.parameters()),
            n_train=data.n_train,
            n_val=data.n_val,
            unifrac_cached=data.unifrac_cached,
        )
        graphs = compiled_graphs()
        with SystemMonitor(device, cfg.metrics.monitor_interval_s) as monitor:
            result = fit(
                plan,
                loss_fn,
                data,
                cfg,
                device,
                record,
                monitor,
                meter,
                setup.loader.non_blocking,
                run_dir,
                interrupts,
            )
        timing = meter.summary()
        step_time = timing["step_time_s"]  # the mean over the timed steps, as samples_per_s
        # Compilation done in the compile phase's warm-up counts too, not only the warm-up steps' excess.
        if timing["compile_time_s"] is not None:
            timing["compile_time_s"] += plan.records["compile"].get("compile_time_s", 0.0)
        summary.update(
            timing,
            **monitor.summary(),
            memory_cleanups=plan.memory_guard.cleanups,
            memory_limit_bytes=plan.memory_guard.limit_bytes,
            memory_limit_source=plan.memory_guard.limit_source,
        )
        summary["recompiles"] = compiled_graphs() - graphs  # graphs compiled for new shapes while training
        if world.world_size > 1:  # each rank's own figures, and the job's total memory
            summary["per_rank"] = per_rank(summary, ("peak_rss_bytes", "step_time_s", "peak_device_bytes"))
            summary["peak_rss_bytes_all_ranks"] = sum(r["peak_rss_bytes"] for r in summary["per_rank"])
        if "val_target" in result.val and data.val_target_var and hasattr(loss_fn, "target_std"):
            # the target part is the MSE in standard units; x std^2: in the target's own units
            mse = result.val["val_target"] * loss_fn.target_std**2
            result.val["val_target_r2"] = 1.0 - mse / data.val_target_var
        summary.update(
            status="completed",
            steps=result.steps,
            train_loss=result.train_loss,
            val_loss=result.val.get("val_loss"),
            val=result.val,
            nonfinite_steps=result.nonfinite_steps,
            nonfinite_check=result.nonfinite_check,
            resumed_from_step=result.resumed_from,
            resume_changes=result.resume_changes,
            profile=result.profile,
            alerts=result.alerts,
        )
        # Achieved FLOP/s over the timed steps against the peak of the matmuls' dtype; above 1: null + why.
        summary.update(
            null_reason(
                utilization(model_flops, step_time, peak),
                utilization(hardware_flops, step_time, peak),
                peak,
                peak_record,
            )
        )
    except RunAborted as exc:  # a guard, or a stop signal (interrupted)
        status = "interrupted" if isinstance(exc, RunInterrupted) else "aborted"
        summary.update(meter.summary(), status=status, error=str(exc))
        if exc.result is not None:  # stopped in the training loop
            summary.update(
                memory_cleanups=plan.memory_guard.cleanups,
                steps=exc.result.steps,
                nonfinite_steps=exc.result.nonfinite_steps,
                nonfinite_check=exc.result.nonfinite_check,
                train_loss=exc.result.train_loss,
                resumed_from_step=exc.result.resumed_from,
                alerts=exc.result.alerts,
            )
        raise
    except BaseException as exc:
        lost = peer_lost(exc, cfg.distributed.timeout_s)
        if lost:  # a stopped or dead rank: this one ends too, in one line (torchrun stops the others)
            summary.update(meter.summary(), status="aborted", error=lost)
            raise RunAborted(lost) from exc
        summary.update(status="failed", error=str(exc) if isinstance(exc, UserError) else repr(exc))
        summary.update(meter.summary())
        if isinstance(exc, UserError):  # a refused start: an earlier run's summary.json in run_dir stays
            record.keep_earlier_summary()
        raise
    finally:
        summary["duration_s"] = meter.elapsed_s()
        summary["config"] = resolved_config(cfg)
        summary["pid"] = os.getpid()
        try:
            record.write_summary(summary)
        except UserError as exc:  # a full disk: say it, unless another error is on its way out already
            if summary["status"] == "completed":
                raise
            log.warning("summary.json not written: no space left in %s (%r)", run_dir, exc.__cause__)
        finally:
            record.close(failed=summary["status"] != "completed")
        close_world(completed=summary["status"] == "completed")
    return summary


def print_result(summary: dict, run_dir: Path) -> None:
    """The lines a finished run ends with: where it is, and its headline figures."""

    def fmt(key: str, unit: str = "", scale: float = 1.0) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value / scale:.4g}{unit}"

    print(f"run directory: {run_dir}")
    speed = f"{fmt('samples_per_s', ' samples/s')} | step {fmt('step_time_s', ' s')} | MFU {fmt('mfu')}"
    if summary.get("timed_steps") == 0:  # every step was a warm-up step: nothing steady to time
        skip = (summary.get("config") or {}).get("metrics", {}).get("skip_steps")
        speed = (
            f"samples/s, step time and MFU n/a: the {summary.get('steps')} steps run were all warm-up "
            f"(metrics.skip_steps={skip}); raise trainer.max_steps to time some"
        )
    print(
        f"  {speed} | peak RSS {fmt('peak_rss_bytes', ' GiB', 2**30)} | "
        f"train loss {fmt('train_loss')} | val loss {fmt('val_loss')}"
    )
    val = summary.get("val") or {}
    if "val_target_mae" in val:
        r2 = val.get("val_target_r2")
        print(
            f"  target {summary.get('target', {}).get('column', '')}: val MAE {val['val_target_mae']:.4g} "
            f"(its own units)" + ("" if r2 is None else f", R^2 {r2:.3f}")
        )
    found = summary.get("batch_finder")
    if found:
        print(
            f"  trainer.batch_size=auto: {found['batch_size']} per step, micro-batches of "
            f"{found['micro_batch']} x {found['grad_accum_steps']} (largest that fits: "
            f"{found['largest_fitting']}, limited by {found['limited_by']})"
        )
