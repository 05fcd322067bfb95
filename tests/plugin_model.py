"""A model that is not AAM, to show any nn.Module plugs in through model._target_."""

import torch
from torch import nn


class MeanPoolModel(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.embed = nn.Embedding(7, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens).mean(dim=(1, 2)))  # [B, dim]


def pair_loss(model: nn.Module, batch: dict, step: int) -> tuple[torch.Tensor, dict]:
    emb = model(batch["tokens"])
    pred = torch.tanh(torch.cdist(emb, emb) / 10)
    loss = ((pred - batch["unifrac"]) ** 2).mean()
    return loss, {"unifrac": loss}
