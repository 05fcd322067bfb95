"""The training loop: fetch -> forward/backward -> step, with timers, guards and checkpoints around it."""

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from aamperf.data.loaders import PassSampler
from aamperf.device import new_cuda_graph_step, sync, to_device
from aamperf.distributed import all_sum, full_value, gather_constant, world_size
from aamperf.errors import RunAborted
from aamperf.guards import Guards
from aamperf.interrupts import Interrupts, RunInterrupted
from aamperf.metrics import RunRecord, StepMeter, SystemMonitor
from aamperf.metrics.interval import Interval
from aamperf.metrics.profile import step_profilers
from aamperf.metrics.target import validation_figures
from aamperf.phases import Plan
from aamperf.trainer.best import Best, watched
from aamperf.trainer.checkpoints import Checkpoints
from aamperf.trainer.gradcache import accumulation
from aamperf.trainer.schedule import OnPlateau, build_scheduler
from aamperf.trainer.stream import BatchStream

LossFn = Callable[[torch.nn.Module, dict[str, Any], int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


LOOP_PARTS = ("steps", "validation", "checkpoints", "loop")


@dataclass
class FitResult:
    meter: StepMeter
    train_loss: float | None = None
    val: dict[str, float] = field(default_factory=dict)
    # what the last validation's target figures were computed from (`validate`'s `detail`)
    val_detail: dict[str, Any] = field(default_factory=dict)
    nonfinite_steps: int = 0
    nonfinite_check: str = ""  # how bad steps are skipped (aamperf/guards/nonfinite.py)
    steps: int = 0
    resumed_from: int | None = None  # the checkpoint's step, when the run went on from one
    resume_changes: dict[str, list] | None = None  # {key: [at the checkpoint, now]} that a resume applied
    profile: dict[str, Any] | None = None  # metrics.profile_steps: what torch.profiler saw
    alerts: list[dict[str, Any]] = field(default_factory=list)  # raised while training (aamperf/alerts.py)
    best: Best | None = None  # the best validation, early stopping (trainer.patience, trainer.keep_best)
    # seconds of this process's loop: its steps, validations, checkpoints, and the rest of it ("loop")
    times_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOOP_PARTS, 0.0))

    def state_dict(self) -> dict[str, Any]:
        return {"train_loss": self.train_loss, "val": self.val}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_loss, self.val = state["train_loss"], state["val"]


@dataclass
class Step:
    """What one optimizer step did (its losses, norm and flag stay on the device)."""

    time_s: float
    wait_s: float
    samples: int
    tokens: int
    losses: torch.Tensor  # the step's loss, then its parts
    names: list[str]  # of `losses`: loss, loss_<part>, ...
    grad_norm: torch.Tensor
    bad: torch.Tensor  # not finite: skipped
    lr: float  # the learning rate the step used (the scheduler then sets the next step's)


def overlaps(tc: DictConfig, device: torch.device) -> bool:
    """trainer.overlap_steps where it applies: one process on a GPU (distributed, each step waits anyway:
    the ranks' stop-signal all-reduce is read on the host)."""
    return tc.overlap_steps and device.type == "cuda" and world_size() == 1


class TrainStep:
    """One optimizer step: its whole batch forward and backward (`grad_accum_steps` micro-batches of it,
    aamperf/trainer/gradcache.py), the true gradients clipped, the step taken unless it is not finite
    (`guards`), the schedule advanced."""

    def __init__(
        self,
        plan: Plan,
        loss_fn: LossFn,
        batches: BatchStream,
        tc: DictConfig,
        guards: Guards,
        scheduler,
        device,
        non_blocking: bool,
    ):
        self.plan, self.batches = plan, batches
        batches.regroup(tc.grad_accum_steps)  # a step's whole batch at once: pairs across its micro-batches
        self.forward_backward = accumulation(loss_fn, tc.grad_accum_steps, device)
        self.guards, self.scheduler, self.device, self.non_blocking = guards, scheduler, device, non_blocking
        self.params = [p for group in plan.optimizer.param_groups for p in group["params"]]
        self.max_norm = tc.grad_clip if tc.grad_clip > 0 else math.inf  # inf: measured, nothing clipped
        self.overlap = overlaps(tc, device)
        self.in_flight: torch.cuda.Event | None = None  # the end of the step before, queued on the GPU

    def wait(self, drain: bool) -> None:
        """Wait for the GPU before a step's clock stops: for the step's own work (`drain`, or with
        trainer.overlap_steps off), else only for the step before it, so this one's stays queued and the
        GPU runs it while the host launches the next (the launches' time hidden, no GPU idle between
        steps). Each step's time then ends with its predecessor's work and the times still sum to the wall
        time between drains; the loop drains before anything that would wait for the GPU outside a step.
        A CPU's work is done when its ops return."""
        if not self.overlap or drain:
            sync(self.device)
            self.in_flight = None
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the run's GPU, whichever is current
        if self.in_flight is not None:
            self.in_flight.synchronize()
        self.in_flight = done

    def __call__(self, step: int, drain: bool = True) -> Step:
        plan, start = self.plan, time.perf_counter()
        batch = to_device(next(self.batches), self.device, self.non_blocking)
        wait_s = time.perf_counter() - start
        step_loss, parts = self.forward_backward(plan, batch, step)
        plan.scaler.unscale_(plan.optimizer)  # clip the true gradients (identity without fp16)
        # FSDP2: a replicated DTensor, made a plain tensor without communication
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm))
        losses = torch.stack([step_loss.float(), *(v.detach().float() for v in parts.values())])
        lr = plan.optimizer.param_groups[0]["lr"]
        bad = self.guards.step(step, losses, grad_norm)  # a non-finite step changes nothing
        self.scheduler.step()
        plan.optimizer.zero_grad(set_to_none=True)
        self.wait(drain)
        names = ["loss", *(f"loss_{k}" for k in parts)]
        # n_samples, n_tokens: of the global batch, all ranks' work
        samples, tokens = batch["n_samples"], batch["n_tokens"]
        return Step(time.perf_counter() - start, wait_s, samples, tokens, losses, names, grad_norm, bad, lr)


@torch.no_grad()
def validate(
    model: torch.nn.Module,
    loss_fn: LossFn,
    loader,
    n_batches: int,
    device,
    non_blocking,
    detail: dict[str, Any] | None = None,
    passes: int = 1,
) -> dict[str, float | None]:
    """Every figure of one validation, all of the same samples: those of its first `n_batches` batches
    (at most: its cost does not grow with the data), `val_samples` of them, read `passes` times
    (trainer.val_passes: pass k reads draw k of their ASVs under data.asv_sampling=random, and the loss
    hides the bases of step k). The mean loss and parts over every pass's batches (of one size: the means
    of the samples), and, where the model predicts a target the loss knows (its `target`), its figures in
    the target's own units (aamperf/metrics/target.py) of every rank's samples, each sample's outputs
    averaged over the passes. `detail`, where given, gets what those were computed from: the samples,
    observed and predicted values, a classification's confusion matrix."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    n = samples = 0
    outputs: list[torch.Tensor] = []  # the model's target output of the batch, as the loss saw it
    # each pass's (sample_idx, target, output) of its batches
    predictions: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    hook = model.register_forward_hook(lambda _, __, out: outputs.append(target_output(out)))
    order = getattr(loader, "sampler", None)
    try:
        for draw in range(passes):
            if isinstance(order, PassSampler):  # this pass's draw of each sample's ASVs
                order.draw = draw
            predictions.append([])
            for k, batch in enumerate(loader, 1):
                # step=draw: the same nucleotide masks at every validation, so val losses compare over time
                new_cuda_graph_step(device)
                batch = to_device(batch, device, non_blocking)
                loss, parts = loss_fn(model, batch, draw)
                for name, value in {"loss": loss, **parts}.items():
                    sums[name] = sums.get(name, 0) + value.detach().float()
                if outputs and outputs[-1] is not None and batch.get("target") is not None:
                    predictions[-1].append((batch["sample_idx"], batch["target"].squeeze(1), outputs[-1]))
                outputs.clear()
                samples += batch["n_samples"] if draw == 0 else 0  # of the global batch
                n += 1
                if k == n_batches:
                    break
    finally:
        hook.remove()
        if isinstance(order, PassSampler):
            order.draw = 0
    model.train()
    world = world_size()  # each rank holds its share of every part: the global value is their mean
    val: dict[str, float | None] = {
        f"val_{name}": (all_sum(total) / (n * world)).item() for name, total in sums.items()
    }  # host sync: once per validation
    val["val_samples"] = samples
    if predictions[0] and getattr(loss_fn, "target", None) is not None:  # every rank's, in rank order
        idx, observed, _ = (torch.cat(column) for column in zip(*predictions[0], strict=True))
        # [n, passes, outputs]: the samples come in the same order in every pass
        each = torch.stack([torch.cat([row[2] for row in rows]) for rows in predictions], dim=1)
        idx, observed, each = (gather_constant(t).cpu() for t in (idx, observed, each))
        figures, found = validation_figures(loss_fn, observed.double().numpy(), each.double().numpy(), idx)
        val.update(figures)
        if detail is not None:
            detail.clear()
            detail.update(found, sample_idx=idx.tolist())
    return val


def target_output(out: Any) -> torch.Tensor | None:
    """A model's target output (float32, a copy: a CUDA graph's output is overwritten by its next replay),
    or None where it has none."""
    if isinstance(out, dict) and torch.is_tensor(out.get("target")):
        return out["target"].detach().float().clone()
    return None


def interrupted(
    interrupts: Interrupts, step: int, checkpoints: Checkpoints, result: FitResult
) -> RunInterrupted:
    """A stop signal arrived during `step`, which is whole: keep it (SIGINT only where checkpoints are
    kept anyway), and say where it is."""
    keep = interrupts.signum != signal.SIGINT or interrupts.sigint_keeps
    path = checkpoints.save(step) if keep else None
    where = (
        f"checkpoint of step {step}: {path} (trainer.resume=auto goes on)"
        if path
        else "no checkpoint (trainer.checkpoint_every=0; SIGTERM always writes one)"
    )
    name = signal.Signals(interrupts.signum).name
    return RunInterrupted(f"{name} received; stopped after step {step}, {where}", result, interrupts.signum)


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
    """Train for `trainer.max_steps` optimizer steps; log every `metrics.log_every` steps; fewer where
    `trainer.patience` validations in a row did not improve (`Best`). A guard's stop, or a stop signal
    (`interrupts`), ends the run after the step it came in, with a checkpoint of it."""
    started = time.perf_counter()
    tc, batches = cfg.trainer, BatchStream(data.train_loader)
    guards, interval = Guards(cfg, plan, device, record), Interval(device)
    best = Best(tc, plan.model)
    result = FitResult(meter, nonfinite_check=guards.nonfinite.check, alerts=guards.alerts.raised, best=best)
    times = result.times_s
    checkpoints = Checkpoints(
        run_dir, cfg, plan.model, plan.optimizer, record, scaler=plan.scaler, stream=batches, meter=meter,
        nonfinite=guards.nonfinite, interval=interval, result=result, best=best,
    )  # fmt: skip
    done = checkpoints.resume()
    best.resumed_at(done)  # a checkpoint of an early stop: nothing left to train
    result.resumed_from, result.resume_changes = checkpoints.resumed_from, checkpoints.changes
    scheduler = checkpoints.kept["scheduler"] = build_scheduler(plan.optimizer, tc, done_steps=done)
    if isinstance(scheduler, OnPlateau):  # its reductions are not a replay of the steps: the checkpoint's
        scheduler.resume(checkpoints.saved.get("scheduler"))
    train_step = TrainStep(plan, loss_fn, batches, tc, guards, scheduler, device, non_blocking)
    bar = tqdm(
        total=tc.max_steps,
        initial=done,
        desc="train",
        unit="step",
        disable=not (tc.progress and plan.is_main),
        dynamic_ncols=True,
    )
    checkpointing = plan.records.get("checkpointing", {})  # memory=budget recomputes inside compiled graphs
    recomputes = checkpointing.get("status") == "applied" and checkpointing.get("mode") != "budget"
    profiler = step_profilers(cfg, device, run_dir, plan.rank, recomputes)  # profile_steps, memory_snapshot
    plan.model.train()
    interrupts = interrupts or Interrupts()
    interrupts.stop_if_received()  # a signal in the set-up that the code it came in caught
    interrupts.in_loop, result.steps = True, done
    interrupts.sigint_keeps = bool(tc.checkpoint_every)  # SIGTERM always writes one (a preemption)
    try:
        for step in range(done + 1, tc.max_steps + 1 if best.stopped_at is None else done + 1):
            val_due = step % tc.val_every == 0 or step == tc.max_steps
            log_due = step % cfg.metrics.log_every == 0 or val_due
            # the GPU's work done before a log line (host reads), a checkpoint or a profiled step
            drain = log_due or checkpoints.due(step) or profiler.covers(step) or profiler.covers(step + 1)
            profiler.begin(step)
            out = train_step(step, drain)
            profiler.end(step)
            times["steps"] += out.time_s
            if not profiler.covers(step):
                meter.add(out.time_s, out.wait_s, out.samples, out.tokens)
            interval.add(out.time_s, out.wait_s, out.samples, out.tokens, out.losses[0], out.bad)
            bar.update()
            result.steps = step
            if guards.memory_over(log_due) or log_due:
                losses, stop = guards.end_interval(step, interval, out.losses, out.names)
                row = {
                    "step": step,
                    **losses,
                    "lr": out.lr,
                    "grad_norm": out.grad_norm.item(),
                }
                if plan.scaler.is_enabled():  # fp16: the loss scale, halved at each skipped step
                    row["grad_scale"] = plan.scaler.get_scale()
                # elapsed_s: from the process's start, before this line's validation: the time a model of
                # this quality took to get
                row.update(interval.rates(), **monitor.readings(), elapsed_s=meter.elapsed_s())
                if val_due and not stop:
                    validating = time.perf_counter()
                    with plan.autocast():
                        result.val = validate(
                            plan.model, loss_fn, data.val_loader, tc.val_batches, device, non_blocking,
                            result.val_detail, tc.val_passes,
                        )  # fmt: skip
                    row.update(result.val)
                    stop = guards.check_validation(step, result.val)  # a NaN validation is no result
                    if not stop:  # the best so far kept (keep_best: its weights gathered); patience counted
                        best.update(step, result.val, result.val_detail)
                        if isinstance(scheduler, OnPlateau):  # the next step's lr, on a plateau
                            scheduler.validated(watched(result.val, tc.monitor))
                    times["validation"] += time.perf_counter() - validating
                record.log(row)
                warmed = step - interval.steps >= cfg.metrics.skip_steps  # the interval held no warm-up step
                stop = stop or guards.check_alerts(step, row, warmed, monitor.gpu_util_percent)
                bar.set_postfix(loss=f"{row['loss']:.4f}", samples_s=f"{row['samples_per_s']:.1f}")
                result.train_loss = row["loss"]
                interval.reset()
                if stop:  # the state now is the last good one (bad steps changed nothing): keep it, stop
                    where = (
                        f"checkpoint of step {step}: {checkpoints.save(step)} (trainer.resume=auto goes on)"
                    )
                    raise RunAborted(f"{stop}; {where}", result)
            if checkpoints.due(step):
                checkpoints.save(step)
            if interrupts.requested(device):  # a stop signal: this step is whole; keep it, then stop
                raise interrupted(interrupts, step, checkpoints, result)
            if best.stopped_at == step:  # trainer.patience validations without improving: the run is done
                break
    finally:  # however the loop ended
        interrupts.in_loop, interrupts.loop_ended = False, True
        bar.close()
        profiler.close()
        result.nonfinite_steps = int(guards.nonfinite.total.item())
        times["checkpoints"] = checkpoints.save_s
        times["loop"] = time.perf_counter() - started - sum(times[k] for k in LOOP_PARTS if k != "loop")
    result.profile = profiler.result
    return result
