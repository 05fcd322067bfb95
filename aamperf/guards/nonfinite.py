"""Non-finite steps (`NonfiniteGuard`): a step whose loss or gradients are not finite is skipped on the
device, counted, and the run stopped (status `aborted`) after `trainer.max_nonfinite` of them in a row.
The flags live on the device and are read once per log line. How a bad step is skipped:
- fp16: torch's GradScaler skips it (its inf check) and backs its scale off;
- a fused optimizer: the flag goes to the kernel as `found_inf` (the GradScaler protocol), which then
  changes neither the parameters nor the optimizer state, without a host sync;
- any other optimizer: the flag is read before `optimizer.step()`. On a CPU that read waits for
  nothing (CPU kernels run in order, on this thread); on a GPU it is one sync per step, so the run
  record says which (`nonfinite_check`) and optimizer=adamw_fused avoids it.
A validation whose loss is not finite stops the run too (`nonfinite_validation`): it is no result.
"""

import math

import torch


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


def nonfinite_validation(step: int, val: dict[str, float | None]) -> str | None:
    """Why the run must stop: the validation of `step` has a loss that is not finite (None: it goes on).
    The weights it ran are finite (a non-finite step changes nothing): its samples or its precision are
    to blame."""
    if math.isfinite(val["val_loss"]):
        return None
    bad = [f"{k}={v:g}" for k, v in val.items() if isinstance(v, float) and not math.isfinite(v)]
    return (
        f"validation of step {step} not finite: {', '.join(bad)}; the model's weights are finite (non-finite "
        "training steps are skipped): check the validation samples' data, or train with precision=fp32"
    )
