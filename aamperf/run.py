"""One run from a composed config: build what it trains with (aamperf/job.py), fit, and write its record."""

import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from aamperf.checks import check_config
from aamperf.data.dataset import write_split
from aamperf.distributed import adopt_slurm_env, close_world, peer_lost
from aamperf.errors import RunAborted, UserError
from aamperf.interrupts import Interrupts, RunInterrupted, StopSignal
from aamperf.job import build_job
from aamperf.loggers import open_sinks
from aamperf.metrics import (
    NullRecord,
    RunRecord,
    StepMeter,
    SystemMonitor,
    job_origin,
    release_freed_memory,
    start_job_peak_rss,
)
from aamperf.metrics.rf_baseline import add_rf_baseline, rf_baseline_line
from aamperf.metrics.target import write_val_predictions
from aamperf.phases.compile import compiled_graphs
from aamperf.summary import Summary, resolved_config
from aamperf.trainer import fit
from aamperf.weights import full_weights, save_model


def per_rank(summary: dict[str, Any], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """These summary figures of every rank, in rank order (a collective: every rank calls it)."""
    mine = {"rank": summary["rank"], **{k: summary.get(k) for k in keys}}
    everyone: list[dict[str, Any]] = [{} for _ in range(summary["world_size"])]
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def target_record(run_dir: Path, detail: dict, sample_ids: list[str], main: bool) -> dict[str, Any]:
    """What the last validation's target figures are of, for summary.json: its predictions file (the first
    rank writes it) and a classification's confusion matrix, with its class names."""
    if not detail:
        return {}
    written = write_val_predictions(run_dir, detail, sample_ids) if main else None
    record: dict[str, Any] = {"val_predictions_file": written}
    if "classes" in detail:  # rows: the observed class, columns: the predicted one
        record["val_confusion_matrix"] = {"classes": detail["classes"], "matrix": detail["confusion_matrix"]}
    return record


def train(
    cfg: DictConfig, run_dir: Path, interrupts: Interrupts | None = None, sweep_job: bool = False
) -> dict[str, Any]:
    """Run one training job into `run_dir`; the summary is written there on success and on failure.
    `interrupts`: the stop signals caught while it runs (aamperf/interrupts.py); `sweep_job`: a job of
    a multirun (its clock starts with it, `job_origin`)."""
    origin, origin_kind = job_origin(sweep_job)  # every elapsed time of the job counts from here
    entered = time.perf_counter()  # the time before: start-up (interpreter, imports, Hydra, the checks)
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
    summary = Summary(cfg, meter, origin_kind, [sink.info for sink in record.sinks])
    summary.parts_s["start"] = entered - origin
    job = monitor = None
    try:
        check_config(cfg)
        job = build_job(cfg, summary, run_dir)
        if main:  # the split, as the original AAM writes it (data.val_samples=<run dir>/val_samples.txt)
            write_split(run_dir, job.data)
        graphs = compiled_graphs()
        with SystemMonitor(job.device, cfg.metrics.monitor_interval_s) as monitor:
            result = fit(
                job.plan, job.loss_fn, job.data, cfg, job.device, record, monitor, meter,
                job.non_blocking, run_dir, interrupts,
            )  # fmt: skip
        summary.loop_ended_at = time.perf_counter()
        summary["recompiles"] = compiled_graphs() - graphs  # graphs compiled for new shapes while training
        best = result.best
        if best.keep and best.step is not None:  # the run's result is its best validation: model and figures
            weights, result.val, result.val_detail = best.weights, best.val, best.detail
            best.used = True
        else:
            weights = full_weights(job.plan.model)
        config, target, categorical = resolved_config(cfg), summary.get("target"), summary.get("categorical")
        kept = save_model(run_dir, weights, config, target, categorical)
        summary["model_file"] = kept and kept.name  # python -m aamperf.predict run=<run dir> uses it
        summary.update(target_record(run_dir, result.val_detail, job.data.sample_ids, main))
        summary.trained(result, job.plan, monitor)
        if job.world.world_size > 1:  # each rank's own figures, and the job's total host memory
            keys = ("peak_rss_bytes", "peak_tree_pss_bytes", "step_time_s", "peak_device_bytes")
            summary["per_rank"] = per_rank(summary, keys)
            for key in ("peak_rss_bytes", "peak_tree_pss_bytes"):
                summary[f"{key}_all_ranks"] = sum(r[key] or 0 for r in summary["per_rank"])
        summary.completed(job, job.model_flops, job.hardware_flops)
        if main:  # after every timed figure; the first rank's detail holds every rank's samples
            add_rf_baseline(summary, cfg, job.data, result.val_detail)
    except (RunAborted, StopSignal) as caught:  # a guard, or a stop signal (interrupted)
        exc = caught.interrupted if isinstance(caught, StopSignal) else caught
        summary.trained(exc.result, job and job.plan, monitor)
        summary.ended("interrupted" if isinstance(exc, RunInterrupted) else "aborted", str(exc))
        if exc is not caught:
            raise exc from None
        raise
    except BaseException as exc:
        summary.trained(None)
        lost = peer_lost(exc, cfg.distributed.timeout_s)
        if lost:  # a stopped or dead rank: this one ends too, in one line (torchrun stops the others)
            summary.ended("aborted", lost)
            raise RunAborted(lost) from exc
        summary.ended("failed", str(exc) if isinstance(exc, UserError) else repr(exc))
        if isinstance(exc, UserError):  # a refused start: an earlier run's summary.json in run_dir stays
            record.keep_earlier_summary()
        raise
    finally:
        try:
            summary.write(record, cfg, run_dir)
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
    load = (summary.get("loop_load") or {}).get("under_load")
    if load:
        print(f"  timed under load: {load}; its speed figures include that contention")
    if summary.get("duration_parts_s"):
        print(duration_line(summary))
    if (summary.get("best") or {}).get("step") is not None:
        print(best_line(summary["best"]))
    found = summary.get("batch_finder")
    if found:
        print(
            f"  trainer.batch_size=auto: {found['batch_size']} per step, micro-batches of "
            f"{found['micro_batch']} x {found['grad_accum_steps']} (largest that fits: "
            f"{found['largest_fitting']}, limited by {found['limited_by']})"
        )
    target = target_line(summary)
    forest = rf_baseline_line(summary)
    if forest:  # the reference the model's target figures are read against, just above them
        print(forest)
    if target:  # last: the figures a fine-tuning run is for
        print(target)


def duration_line(summary: dict) -> str:
    """Where the run's time went: its duration_parts_s of 1% or more, in their order."""
    total, parts = summary["duration_s"], summary["duration_parts_s"]
    since = "the process's start" if summary.get("clock_origin") == "process_start" else "the job's start"
    shown = ", ".join(f"{name} {s:.2f}" for name, s in parts.items() if s >= 0.01 * total)
    return f"  {total:.1f} s from {since}: {shown} (seconds; summary.json duration_parts_s)"


def best_line(best: dict) -> str:
    """Which validation was the best (trainer.monitor), whether it ended the run, what model.pt holds."""
    line = f"  best validation: {best['monitor']} {best['value']:.4g} at step {best['step']}"
    if best["stopped_early_at"] is not None:
        line += (
            f"; stopped early after step {best['stopped_early_at']}, {best['patience']} validations "
            f"without improving (trainer.patience={best['patience']})"
        )
    if best["kept"]:
        line += "; model.pt and the val figures are that validation's (trainer.keep_best)"
    return line


def target_line(summary: dict) -> str | None:
    """The last validation's target figures, and which samples they are of; None without a target."""
    val = summary.get("val") or {}

    def fmt(key: str, name: str, digits: str = ".4g") -> str:
        return "" if val.get(key) is None else f", {name} {val[key]:{digits}}"

    if "val_accuracy" in val:
        figures = f"val accuracy {val['val_accuracy']:.3f}" + fmt("val_macro_f1", "macro-F1", ".3f")
        figures += fmt("val_roc_auc", "ROC AUC", ".3f")
    elif "val_target_mae" in val:
        figures = f"val MAE {val['val_target_mae']:.4g}" + fmt("val_target_rmse", "RMSE") + " (its own units)"
        figures += fmt("val_target_r2", "R^2", ".3f")
        if val.get("val_target_category_mean_r2") is not None:  # zscore_category: what the means explain
            figures += f" (each category's training mean alone: R^2 {val['val_target_category_mean_r2']:.3f})"
        if "val_target_interval_coverage" in val:
            nominal = val["val_target_interval_nominal"]
            figures += f", {nominal:.0%} interval covers {val['val_target_interval_coverage']:.0%}"
    else:
        return None
    trainer = (summary.get("config") or {}).get("trainer", {})
    passes = trainer.get("val_passes", 1)
    over = (
        f", over {val['val_samples']} of the {summary.get('n_val')} validation samples "
        f"(trainer.val_batches={trainer.get('val_batches')})"
        if "val_samples" in val
        else ""
    )
    if over and passes > 1:
        over += f", each its mean over {passes} passes"
    return f"  target {(summary.get('target') or {}).get('column', '')}: {figures}{over}"
