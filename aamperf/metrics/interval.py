"""What the steps between two log lines did: their time, data wait, samples and tokens, and the sum of
their finite losses, kept on the device (reading it is a host sync, done once per log line)."""

from typing import Any

import torch


class Interval:
    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)  # of the finite steps
        self.reset()

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.time_s = self.wait_s = 0.0
        self.samples = self.tokens = self.steps = 0

    def add(self, time_s: float, wait_s: float, samples: int, tokens: int, loss: torch.Tensor, bad) -> None:
        """One optimizer step; `bad`: its (device) non-finite flag, whose loss is left out of the sum."""
        self.loss_sum += torch.where(bad, 0.0, loss)
        self.time_s += time_s
        self.wait_s += wait_s
        self.samples += samples
        self.tokens += tokens
        self.steps += 1

    def rates(self) -> dict[str, float]:
        """The interval's mean step time and throughput, and the share of it spent waiting for data."""
        return {
            "step_time_s": self.time_s / self.steps,
            "samples_per_s": self.samples / self.time_s,
            "tokens_per_s": self.tokens / self.time_s,
            "data_wait_frac": self.wait_s / self.time_s,
        }

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("loss_sum", "time_s", "wait_s", "samples", "tokens", "steps")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum.copy_(state["loss_sum"])
        for key in ("time_s", "wait_s", "samples", "tokens", "steps"):
            setattr(self, key, state[key])
