"""The guards that watch a training run and stop it before it loses its state.

Non-finite steps (`NonfiniteGuard`): a step whose loss or gradients are not finite is skipped on the
device, counted, and the run stopped (status `aborted`) after `trainer.max_nonfinite` of them in a row.
The flags live on the device and are read once per log line. How a bad step is skipped:
- fp16: torch's GradScaler skips it (its inf check) and backs its scale off;
- a fused optimizer: the flag goes to the kernel as `found_inf` (the GradScaler protocol), which then
  changes neither the parameters nor the optimizer state, without a host sync;
- any other optimizer: the flag is read before `optimizer.step()`. On a CPU that read waits for
  nothing (CPU kernels run in order, on this thread); on a GPU it is one sync per step, so the run
  record says which (`nonfinite_check`) and optimizer=adamw_fused avoids it.

Memory (`MemoryGuard`): the run's own memory against the limit that applies to it (`memory_limit`).
"""

import gc
import logging
import math
import os
import time
from pathlib import Path

import psutil
import torch
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class NonfiniteGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, device, limit: int):
        self.optimizer, self.scaler, self.limit = optimizer, scaler, limit
        if scaler.is_enabled():
            self.check = "grad_scaler"
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            self.check = "fused_optimizer"
        else:
            self.check = "host_read" if device.type != "cpu" else "cpu_read"
        zero = torch.zeros((), device=device, dtype=torch.long)
        self.total = zero.clone()  # non-finite steps of the run
        self.in_interval = zero.clone()  # ... since the last log line
        self.streak = zero.clone()  # ... in a row, now
        self.streak_start = zero.clone()  # the step the current streak began at
        self.crossed = torch.zeros((), device=device, dtype=torch.bool)  # a streak reached `limit`
        self.crossed_start = zero.clone()  # the step that streak began at
        self.start_parts: torch.Tensor | None = None  # loss and its parts where the current streak began
        self.crossed_parts: torch.Tensor | None = None  # ... where the streak that reached `limit` began

    def step(self, step: int, losses: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The optimizer step, unless the loss (`losses[0]`) or `grad_norm` is not finite; returns the
        (device) flag. `losses`: the step's loss and its parts, kept for the message. `grad_norm` is
        the global norm (all ranks' gradients, after their all-reduce), so under DDP or FSDP every rank
        skips the same steps: a rank's non-finite loss makes its gradients, and so the reduced ones,
        non-finite too."""
        bad = ~(torch.isfinite(losses[0]) & torch.isfinite(grad_norm))
        if self.start_parts is None:
            self.start_parts, self.crossed_parts = torch.zeros_like(losses), torch.zeros_like(losses)
        self.total += bad
        self.in_interval += bad
        self.streak.add_(1).mul_(bad)
        starts = bad & (self.streak == 1)
        self.streak_start.masked_fill_(starts, step)
        torch.where(starts, losses, self.start_parts, out=self.start_parts)
        crossing = (self.streak >= self.limit) & ~self.crossed  # the first streak that is too long
        torch.where(crossing, self.streak_start, self.crossed_start, out=self.crossed_start)
        torch.where(crossing, self.start_parts, self.crossed_parts, out=self.crossed_parts)
        self.crossed |= crossing
        if self.check == "grad_scaler":
            self.scaler.step(self.optimizer)  # skips on inf/NaN gradients; update() backs the scale off
        elif self.check == "fused_optimizer":
            self.optimizer.grad_scale, self.optimizer.found_inf = None, bad.float()
            self.optimizer.step()
            del self.optimizer.grad_scale, self.optimizer.found_inf
        elif not bad.item():
            self.optimizer.step()
        self.scaler.update()
        return bad

    def end_interval(self, step: int, names: list[str]) -> tuple[int, str | None]:
        """At a log line (one host read): the interval's count of bad steps, and why the run must stop
        once `limit` steps in a row were not finite (None until then)."""
        in_interval, crossed, start = torch.stack(
            [self.in_interval, self.crossed.long(), self.crossed_start]
        ).tolist()
        self.in_interval.zero_()
        if crossed:
            values = dict(zip(names, self.crossed_parts.tolist(), strict=True))
            bad = [f"{name}={value:g}" for name, value in values.items() if not math.isfinite(value)]
            what = ", ".join(bad) if bad else f"the gradients ({', '.join(names)} finite)"
            return int(in_interval), (
                f"{self.limit} non-finite steps in a row from step {start} (trainer.max_nonfinite="
                f"{self.limit}), stopped at step {step}; not finite at step {start}: {what}; lower "
                "trainer.lr or trainer.grad_clip, or check the data of those batches"
            )
        return int(in_interval), None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"total": self.total, "streak": self.streak, "streak_start": self.streak_start}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            getattr(self, name).copy_(value)


def memory_limit() -> tuple[int, str]:
    """(bytes this process may use before it is killed, what sets them): its cgroup's limit (v2
    `memory.max`, v1 `memory.limit_in_bytes`) where one is below the machine's RAM, else the RAM."""
    total = psutil.virtual_memory().total
    limits = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "0::/path" (v2) or "4:memory:/path" (v1); in a container the path may be "/"
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = [f"/sys/fs/cgroup{path}/memory.max", "/sys/fs/cgroup/memory.max"]
        elif "memory" in controllers.split(","):
            files = [
                f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            ]
        else:
            continue
        for name in files:
            try:
                text = Path(name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < total:
                limits.append(int(text))
            break  # the first readable file of this hierarchy answers for it
    return (min(limits), "cgroup") if limits else (total, "machine")


CHILDREN_EVERY_S = 5.0  # dataloader workers are persistent: list them again this often


class MemoryGuard:
    """The run's own memory (this process and its workers, RSS) as a fraction of the limit that applies
    to it (its cgroup's, else the machine's RAM; CUDA: the device's memory), checked at every step but
    read at most every `interval_s` (a read costs ~40 us). Above `warn_fraction`: collect garbage and
    empty the CUDA cache, once per crossing, with a warning (never every step: clearing costs time).
    Above `max_fraction`: a message for the trainer, which checkpoints and stops the run before the
    operating system kills it. Other processes' memory never stops the run: a machine over
    `max_fraction` in all is a warning, once per crossing."""

    def __init__(self, cfg: DictConfig, device: torch.device, interval_s: float = 0.1):
        self.warn_fraction, self.max_fraction, self.device = cfg.warn_fraction, cfg.max_fraction, device
        self.interval_s = interval_s
        self.cleanups = 0
        self._above = self._machine_above = False
        self._last_read = -math.inf
        self.last_fraction: float | None = None  # the latest reading (alerts report it)
        self.limit_bytes, self.limit_source = (None, "device") if device.type == "cuda" else memory_limit()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's ranks on this machine
        if self.limit_bytes is not None and local_ranks > 1:  # they share the limit: each its share
            self.limit_bytes //= local_ranks
            self.limit_source += f"/{local_ranks}"
        self._process = psutil.Process()
        self._children: list[psutil.Process] = []
        self._children_at = -math.inf

    def run_bytes(self) -> int:
        """RSS of this process and its children (dataloader workers): shared pages count in each. The
        children are listed at most every CHILDREN_EVERY_S (listing scans /proc: ~1 ms with 70
        processes, more on a busy node); their RSS is read at each check."""
        now = time.perf_counter()
        if now - self._children_at >= CHILDREN_EVERY_S:
            self._children, self._children_at = self._process.children(recursive=True), now
        total = self._process.memory_info().rss
        for child in self._children:
            try:
                total += child.memory_info().rss
            except psutil.Error:  # ended meanwhile
                pass
        return total

    def used_fraction(self) -> float:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return 1 - free / total
        return self.run_bytes() / self.limit_bytes

    def check(self) -> str | None:
        """None, or why the run must stop now."""
        now = time.perf_counter()
        if now - self._last_read < self.interval_s:
            return None
        self._last_read = now
        fraction = self.last_fraction = self.used_fraction()
        if fraction >= self.max_fraction:
            kind, _, shared = self.limit_source.partition("/")
            where = {"device": "device memory", "cgroup": "the cgroup's memory limit"}.get(kind, "system RAM")
            where += f" shared by {shared} local ranks" if shared else ""
            return (
                f"memory at {100 * fraction:.0f}% of {where}, over memory.max_fraction="
                f"{self.max_fraction:g}; lower trainer.batch_size (or trainer.batch_size=auto), use "
                "memory=full or precision=bf16, or raise memory.max_fraction"
            )
        if self.device.type != "cuda":
            vm = psutil.virtual_memory()
            machine = 1 - vm.available / vm.total
            if machine >= self.max_fraction and not self._machine_above:
                log.warning(
                    "the machine's memory is %.0f%% used, by other processes too (this run: %.2f GiB, %.0f%% "
                    "of its limit): not stopped, since what other processes use is not this run's",
                    100 * machine,
                    self.run_bytes() / 2**30,
                    100 * fraction,
                )
            self._machine_above = machine >= self.max_fraction
        above = fraction >= self.warn_fraction
        if above and not self._above:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cleanups += 1
            log.warning(
                "memory at %.0f%% (memory.warn_fraction=%.2f): collected garbage and cleared caches",
                100 * fraction,
                self.warn_fraction,
            )
        self._above = above
        return None
