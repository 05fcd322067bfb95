"""Plug-ins for the tests: a model that is not AAM (any nn.Module plugs in through model._target_),
and losses that go wrong on purpose (NaN, a memory leak, memory that grows with the batch, a slow step)."""

import time

import torch
from torch import nn

from aamperf.distributed import gather, gather_constant
from aamperf.model import AAMLoss


class MeanPoolModel(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(7, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.dropout(self.embed(tokens).mean(dim=(1, 2))))  # [B, dim]


class EmbeddingModel(MeanPoolModel):
    """A model that is not AAM trained by AAM's own loss: its output is the sample embedding AAMLoss reads."""

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, asv_ids=None) -> dict[str, torch.Tensor]:
        return {"sample_embedding": super().forward(tokens)}


def pair_loss(model: nn.Module, batch: dict, step: int) -> tuple[torch.Tensor, dict]:
    """UniFrac distances from the embeddings' distances. Under torch.distributed a rank holds its slice
    of the global batch and its rows of the global distances ([b, world * b]): the whole batch is
    gathered, so every rank computes the global batch's loss (`gather` carries the gradient back)."""
    emb = gather(model(batch["tokens"]))
    pred = torch.tanh(torch.cdist(emb, emb) / 10)
    loss = ((pred - gather_constant(batch["unifrac"])) ** 2).mean()
    return loss, {"unifrac": loss}


class _NaNGradient(torch.autograd.Function):
    """Adds 0 to the loss; puts NaN into the gradient of `x`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full(ctx.shape, float("nan"), dtype=grad.dtype, device=grad.device)


class PoisonedLoss(AAMLoss):
    """AAM's loss with NaN put in at `steps` (step >= from_step too, when from_step is set): into the
    batch (its UniFrac distances) or into one parameter's gradient (the loss itself stays finite);
    under torch.distributed on rank `rank` only, when it is set."""

    def __init__(
        self, steps=(), into: str = "batch", from_step: int | None = None, rank: int | None = None, **kwargs
    ):
        super().__init__(**kwargs)
        self.steps, self.into, self.from_step, self.rank = set(steps), into, from_step, rank

    def forward(self, model: nn.Module, batch: dict, step: int):
        poisoned = step in self.steps or (self.from_step is not None and step >= self.from_step)
        if self.rank is not None and torch.distributed.is_initialized():
            poisoned = poisoned and torch.distributed.get_rank() == self.rank
        if poisoned and self.into == "batch":
            batch = {**batch, "unifrac": torch.full_like(batch["unifrac"], float("nan"))}
        loss, parts = super().forward(model, batch, step)
        if poisoned and self.into == "grad":
            loss = loss + _NaNGradient.apply(next(model.parameters()))
        return loss, parts


_leaked: list[torch.Tensor] = []


class LeakyLoss(AAMLoss):
    """AAM's loss that keeps `mb_per_step` MiB alive at every step on the model's device, as a memory
    leak would."""

    def __init__(self, mb_per_step: int = 256, **kwargs):
        super().__init__(**kwargs)
        self.numel = mb_per_step * 2**20 // 4

    def forward(self, model: nn.Module, batch: dict, step: int):
        device = next(model.parameters()).device  # on a GPU, the GPU's memory leaks
        _leaked.append(torch.ones(self.numel, device=device))  # written, so the pages are really in use
        return super().forward(model, batch, step)


class HungryLoss(AAMLoss):
    """AAM's loss holding `mb_per_sample` MiB per sample of the batch until backward, on the model's
    device: a step whose memory grows with the batch far faster than AAM's own (out-of-memory tests)."""

    def __init__(self, mb_per_sample: int = 256, **kwargs):
        super().__init__(**kwargs)
        self.numel = mb_per_sample * 2**20 // 4

    def forward(self, model: nn.Module, batch: dict, step: int):
        loss, parts = super().forward(model, batch, step)
        weight = next(model.parameters())
        held = torch.ones(len(batch["unifrac"]) * self.numel, device=weight.device)  # [b, B]: b samples here
        return loss + 0 * (held * weight.flatten()[0]).sum(), parts  # `held` is saved for backward


class SlowLoss(AAMLoss):
    """AAM's loss that takes `seconds` longer from step `from_step` on: a step longer than a launcher
    waits for."""

    def __init__(self, seconds: float = 5.0, from_step: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.seconds, self.from_step = seconds, from_step

    def forward(self, model: nn.Module, batch: dict, step: int):
        if step >= self.from_step:
            time.sleep(self.seconds)
        return super().forward(model, batch, step)


class BrokenLoss(AAMLoss):
    """AAM's loss that raises at step `at`: a run that fails in the middle, as a bug would."""

    def __init__(self, at: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.at = at

    def forward(self, model: nn.Module, batch: dict, step: int):
        if step == self.at:
            raise RuntimeError(f"BrokenLoss: step {step}")
        return super().forward(model, batch, step)
