"""The training loop: fetch -> forward/backward -> step, with timers and monitors around it."""

import math
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from aamperf import checkpoint
from aamperf.alerts import Alerts
from aamperf.device import sync, to_device
from aamperf.distributed import all_sum, full_value, world_size
from aamperf.errors import RunAborted
from aamperf.guards import NonfiniteGuard
from aamperf.interrupts import Interrupts, RunInterrupted
from aamperf.metrics import RunRecord, StepMeter, SystemMonitor
from aamperf.metrics.profile import StepProfiler
from aamperf.phases import Plan

LossFn = Callable[[torch.nn.Module, dict[str, Any], int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


LR_SCHEDULES = ("warmup_cosine", "warmup_linear", "constant", "onecycle")


def build_scheduler(optimizer: torch.optim.Optimizer, tc: DictConfig, done_steps: int = 0):
    """torch's schedulers for `trainer.lr_schedule`, stepped once per optimizer step over `max_steps`:
    a linear warm-up over `warmup_steps`, then cosine or linear decay to lr x `min_lr_ratio`, or the lr
    kept (constant); or OneCycleLR (its rise over `warmup_steps`, torch's 30% without one). A resumed
    run replays its `done_steps`: the lr values it had, or, where the schedule's settings changed, this
    run's schedule at that step (a scheduler's own state would keep the old settings)."""
    lrs = torch.optim.lr_scheduler
    warmup = min(tc.warmup_steps, tc.max_steps)
    rest = max(1, tc.max_steps - warmup)
    if tc.lr_schedule == "onecycle":
        rise = warmup / tc.max_steps if warmup else 0.3
        max_lr = [group["lr"] for group in optimizer.param_groups]
        scheduler = lrs.OneCycleLR(optimizer, max_lr=max_lr, total_steps=tc.max_steps, pct_start=rise)
    else:
        if tc.lr_schedule == "warmup_cosine":
            decay = lrs.CosineAnnealingLR(optimizer, T_max=rest, eta_min=tc.lr * tc.min_lr_ratio)
        elif tc.lr_schedule == "warmup_linear":
            decay = lrs.LinearLR(optimizer, start_factor=1.0, end_factor=tc.min_lr_ratio, total_iters=rest)
        else:
            decay = lrs.ConstantLR(optimizer, factor=1.0, total_iters=0)
        scheduler = decay
        if warmup:
            warm = lrs.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=warmup)
            scheduler = lrs.SequentialLR(optimizer, [warm, decay], milestones=[warmup])
    with warnings.catch_warnings():  # "step() before optimizer.step()": a replay, no training
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(done_steps):
            scheduler.step()
    return scheduler


class BatchStream:
    """Endless batches; each pass re-shuffles through the sampler's own seeded generator. Its position
    (the generator's state when the pass began, batches taken since) goes into checkpoints."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.loader = loader
        self._iter: Iterator[dict[str, Any]] | None = None
        self._pass_state: torch.Tensor | None = None
        self._taken = 0

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._iter is None:
                self._pass_state = self.loader.sampler.generator.get_state()
                self._iter, self._taken = iter(self.loader), 0
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = None
                continue
            self._taken += 1
            return batch

    def state_dict(self) -> dict[str, Any]:
        return {"pass_state": self._pass_state, "taken": self._taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replay the pass from its start: the same shuffle, the batches already trained on skipped."""
        self._iter = None
        if state["pass_state"] is None:
            return
        self.loader.sampler.generator.set_state(state["pass_state"])
        self._pass_state, self._iter = state["pass_state"], iter(self.loader)
        for _ in range(state["taken"]):
            next(self._iter)
        self._taken = state["taken"]


@torch.no_grad()
def validate(model: torch.nn.Module, loss_fn: LossFn, loader, n_batches: int, device, non_blocking) -> dict:
    """Mean loss and parts over at most `n_batches` batches, so its cost does not grow with the data."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    n = 0
    for batch in loader:
        # step=0: the same nucleotide masks at every validation, so val losses are comparable over time.
        loss, parts = loss_fn(model, to_device(batch, device, non_blocking), 0)
        for name, value in {"loss": loss, **parts}.items():
            sums[name] = sums.get(name, 0) + value.detach().float()
        n += 1
        if n == n_batches:
            break
    model.train()
    world = world_size()  # each rank holds its share of every part: the global value is their mean
    return {
        f"val_{name}": (all_sum(total) / (n * world)).item() for name, total in sums.items()
    }  # host sync: once per validation


@dataclass
class FitResult:
    meter: StepMeter
    train_loss: float | None = None
    val: dict[str, float] = field(default_factory=dict)
    nonfinite_steps: int = 0
    nonfinite_check: str = ""  # how bad steps are skipped (aamperf/guards.py)
    steps: int = 0
    resumed_from: int | None = None  # the checkpoint's step, when the run went on from one
    resume_changes: dict[str, list] | None = None  # {key: [at the checkpoint, now]} that a resume applied
    profile: dict[str, Any] | None = None  # metrics.profile_steps: what torch.profiler saw
    alerts: list[dict[str, Any]] = field(default_factory=list)  # raised while training (aamperf/alerts.py)


def fit(
    plan: Plan,
    loss_fn: LossFn,
    data,
    cfg: DictConfig,
    device: torch.device,
    record: RunRecord,
    monitor: SystemMonitor,
    meter: StepMeter,
    non_blocking: bool = False,
    run_dir: Path | None = None,
    interrupts: Interrupts | None = None,
) -> FitResult:
    """Train for `trainer.max_steps` optimizer steps; log every `metrics.log_every` steps. A stop signal
    (`interrupts`) ends the run after the step it arrived in, with a checkpoint of it."""
    tc = cfg.trainer
    model, optimizer, scaler, autocast = plan.model, plan.optimizer, plan.scaler, plan.autocast
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scheduler = build_scheduler(optimizer, tc)
    max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf  # inf: the norm is measured, nothing clipped
    batches = BatchStream(data.train_loader)
    guard = NonfiniteGuard(optimizer, scaler, device, tc.max_nonfinite)
    result = FitResult(meter=meter, nonfinite_check=guard.check)
    alerts = Alerts(cfg, record)
    result.alerts = alerts.raised  # filled as they are raised: an aborted run's summary has them too
    # Loss sums stay on the device between log lines: reading them is a host sync, done once per line.
    loss_sum = torch.zeros((), device=device)  # of the finite steps
    interval: dict[str, float] = {"time_s": 0.0, "wait_s": 0.0, "samples": 0, "tokens": 0, "steps": 0}
    first_step = 1
    saved = checkpoint.checkpoints(run_dir) if tc.resume == "auto" else []
    config = OmegaConf.to_container(cfg, resolve=True)
    if saved:  # go on from the newest checkpoint, as if the run had never stopped
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state = checkpoint.load(saved[-1], model, optimizer)
        result.resume_changes = checkpoint.config_changes(state.get("config", config), config)
        checkpoint.check_resume(saved[-1], result.resume_changes)
        first_step = state["step"] + 1
        checkpoint.use_run_hyperparameters(optimizer, fresh)
        scheduler = build_scheduler(optimizer, tc, done_steps=state["step"])
        scaler.load_state_dict(state["scaler"])
        batches.load_state_dict(state["stream"])
        meter.load_state_dict(state["meter"])
        loss_sum.copy_(state["loss_sum"])
        guard.load_state_dict(state["nonfinite"])
        interval = state["interval"]
        result.train_loss, result.val = state["result"]["train_loss"], state["result"]["val"]
        record.truncate_after(state["step"])  # lines logged after the checkpoint are logged again
        result.resumed_from = state["step"]
    world = world_size()
    show = tc.progress and plan.is_main  # one bar per job, on rank 0
    bar = tqdm(total=tc.max_steps, desc="train", unit="step", disable=not show, dynamic_ncols=True)
    bar.update(first_step - 1)
    model.train()
    profiler = StepProfiler(cfg.metrics.profile_steps, cfg.metrics.skip_steps, run_dir, plan.rank)

    def save_checkpoint(step: int) -> Path:
        loop = {"loss_sum": loss_sum, "nonfinite": guard.state_dict(), "interval": interval, "config": config}
        loop["result"] = {"train_loss": result.train_loss, "val": result.val}
        objects = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "stream": batches}
        return checkpoint.save(
            run_dir, step, model, {**objects, **loop, "meter": meter.state_dict()}, tc.keep_last
        )

    interrupts = interrupts or Interrupts()
    interrupts.in_loop = True
    for step in range(first_step, tc.max_steps + 1):
        profiler.begin(step)
        start = time.perf_counter()
        wait_s, samples, tokens = 0.0, 0, 0
        step_loss = torch.zeros((), device=device)
        for micro in range(1, tc.grad_accum_steps + 1):
            fetch = time.perf_counter()
            batch = to_device(next(batches), device, non_blocking)
            wait_s += time.perf_counter() - fetch
            # distributed: gradients are reduced across ranks only after the last micro-batch
            with plan.grad_sync(micro == tc.grad_accum_steps):
                with autocast():
                    loss, parts = loss_fn(model, batch, step)
                scaler.scale(loss / tc.grad_accum_steps).backward()
            step_loss += loss.detach() / tc.grad_accum_steps
            samples += batch["n_samples"]  # of the global batch: all ranks' work
            tokens += batch["n_tokens"]
        scaler.unscale_(optimizer)  # clip the true gradients (identity without fp16)
        # FSDP2: a replicated DTensor, made a plain tensor without communication
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
        losses = torch.stack([step_loss.float(), *(v.detach().float() for v in parts.values())])
        bad = guard.step(step, losses, grad_norm)  # a non-finite step changes nothing
        loss_sum += torch.where(bad, 0.0, step_loss)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        step_time_s = time.perf_counter() - start
        profiler.end(step)
        if not profiler.covers(step):
            meter.add(step_time_s, wait_s, samples, tokens)
        interval["time_s"] += step_time_s
        interval["wait_s"] += wait_s
        interval["samples"] += samples
        interval["tokens"] += tokens
        interval["steps"] += 1
        bar.update()

        val_due = step % tc.val_every == 0 or step == tc.max_steps
        log_due = step % cfg.metrics.log_every == 0 or val_due
        # Memory: every step in one process (read at most every 0.1 s); distributed, at log lines,
        # where the ranks agree through the all-reduce below (one rank over the limit stops all).
        memory_stop = plan.memory_guard.check() if world == 1 or log_due else None
        if log_due or memory_stop:
            # host sync (and, distributed, one all-reduce): the global loss is the mean of the ranks' shares
            names = ["loss", *(f"loss_{k}" for k in parts)]
            n_bad, stop = guard.end_interval(step, names)
            over = torch.tensor([float(memory_stop is not None)], device=device)
            shares = all_sum(torch.cat([loss_sum[None], losses[1:], over])).tolist()
            shares[0] /= interval["steps"] - n_bad or math.nan  # NaN: no step of the interval was finite
            if shares.pop() and not memory_stop:
                memory_stop = f"another rank's memory went over memory.max_fraction={cfg.memory.max_fraction}"
            row: dict[str, Any] = {"step": step, **{n: v / world for n, v in zip(names, shares, strict=True)}}
            row.update(
                {
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm.item(),
                    "nonfinite_steps": n_bad,
                    "step_time_s": interval["time_s"] / interval["steps"],
                    "samples_per_s": interval["samples"] / interval["time_s"],
                    "tokens_per_s": interval["tokens"] / interval["time_s"],
                    "data_wait_frac": interval["wait_s"] / interval["time_s"],
                    "rss_bytes": monitor.rss_bytes,
                    "tree_pss_bytes": monitor.tree_pss_bytes,
                    "cpu_percent": monitor.cpu_percent,
                    # from the process's start (meter.start_time), at the end of this step, before
                    # this line's validation: the time a model of this quality took to get
                    "elapsed_s": meter.elapsed_s(),
                }
            )
            stop = stop or memory_stop
            if val_due and not stop:
                with autocast():
                    result.val = validate(
                        model, loss_fn, data.val_loader, tc.val_batches, device, non_blocking
                    )
                row.update(result.val)
            record.log(row)
            warmed = step - interval["steps"] >= cfg.metrics.skip_steps  # the interval holds no warm-up step
            readings = {
                "samples_per_s": row["samples_per_s"] if warmed else None,
                "val_loss": row.get("val_loss"),
                "memory_fraction": plan.memory_guard.last_fraction,
                "gpu_util_percent": monitor.gpu_util_percent,
            }
            alert_stop = alerts.check(step, readings)
            if world > 1 and alerts.stop_on_critical:  # every rank stops, or none (one all-reduce a line)
                anyone = all_sum(torch.tensor([float(alert_stop is not None)], device=device)).item()
                alert_stop = alert_stop or ("another rank raised a critical alert" if anyone else None)
            stop = stop or alert_stop
            bar.set_postfix(loss=f"{row['loss']:.4f}", samples_s=f"{row['samples_per_s']:.1f}")
            result.train_loss = row["loss"]
            loss_sum.zero_()
            interval = dict.fromkeys(interval, 0)
            if stop:  # the state now is the last good one (bad steps changed nothing): keep it, then stop
                bar.close()
                result.steps, result.nonfinite_steps = step, int(guard.total.item())
                path = save_checkpoint(step) if run_dir is not None else None
                raise RunAborted(
                    f"{stop}; checkpoint of step {step}: {path} (trainer.resume=auto goes on)", result
                )
        due = tc.checkpoint_every and step % tc.checkpoint_every == 0
        just_saved = save_checkpoint(step) if due else None
        if interrupts.requested(device):  # a stop signal: this step is whole; keep it, then stop
            bar.close()
            result.steps, result.nonfinite_steps = step, int(guard.total.item())
            keep = run_dir is not None and (interrupts.signum != signal.SIGINT or tc.checkpoint_every)
            path = (just_saved or save_checkpoint(step)) if keep else None
            where = (
                f"checkpoint of step {step}: {path} (trainer.resume=auto goes on)"
                if path
                else "no checkpoint (trainer.checkpoint_every=0; SIGTERM always writes one)"
            )
            stopped = f"{signal.Signals(interrupts.signum).name} received; stopped after step {step}, {where}"
            raise RunInterrupted(stopped, result, interrupts.signum)
    interrupts.in_loop = False
    bar.close()
    result.profile = profiler.result
    result.nonfinite_steps = int(guard.total.item())
    result.steps = tc.max_steps
    return result
