"""AAM training loss: UniFrac distance + masked-nucleotide + optional target, with a deterministic mask."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aamperf.model.aam import MASK, A, T

_M32 = 0xFFFFFFFF


def _hash32(x):
    """A 32-bit integer mix (two xor-shift-multiply rounds). Works on Python ints and int64 tensors;
    operands stay below 2**59, so int64 never overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def nucleotide_mask(tokens: Tensor, sample_idx: Tensor, step: int, seed: int, fraction: float) -> Tensor:
    """Bool [B, S, L]: which real bases (A/C/G/T) to hide at this step.

    Each position draws from a counter-based hash of (seed, step, global sample id, ASV index,
    base index), computed on the tokens' device: the mask of a sample is the same however the
    batch is composed, padded or split across processes, and drawing it needs no host sync.
    """
    batch, n_asvs, length = tokens.shape
    step_key = _hash32(_hash32(seed & _M32) ^ (step & _M32))  # a Python int
    sample_key = _hash32((sample_idx.to(torch.int64) & _M32) ^ step_key).view(batch, 1, 1)
    position = torch.arange(n_asvs * length, device=tokens.device, dtype=torch.int64).view(n_asvs, length)
    draw = _hash32(sample_key ^ _hash32(position)) >> 8  # 24 uniform bits
    hidden = draw < int(fraction * (1 << 24))
    return hidden & (tokens >= A) & (tokens <= T)


class AAMLoss(nn.Module):
    """loss(model, batch, step) -> (total, parts). Parts the model does not output are left out:
    `unifrac` needs `sample_embedding`, `nucleotide` needs `nuc_logits`, `target` needs both a
    `target` output and `batch["target"]`. total = weighted sum of the parts present."""

    def __init__(
        self,
        unifrac_weight: float = 1.0,
        nucleotide_weight: float = 1.0,
        target_weight: float = 1.0,
        mask_fraction: float = 0.15,
        seed: int = 0,
    ):
        super().__init__()
        self.weights = {"unifrac": unifrac_weight, "nucleotide": nucleotide_weight, "target": target_weight}
        self.mask_fraction, self.seed = mask_fraction, seed

    def forward(self, model: nn.Module, batch: dict, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        tokens = batch["tokens"]
        hidden = nucleotide_mask(tokens, batch["sample_idx"], step, self.seed, self.mask_fraction)
        out = model(tokens.masked_fill(hidden, MASK), batch["counts"])

        parts: dict[str, Tensor] = {}
        if "sample_embedding" in out:
            parts["unifrac"] = unifrac_loss(out["sample_embedding"], batch["unifrac"])
        if "nuc_logits" in out:
            parts["nucleotide"] = masked_nucleotide_loss(out["nuc_logits"], tokens, hidden)
        if "target" in out and batch.get("target") is not None:
            parts["target"] = F.mse_loss(out["target"].float(), batch["target"].float())
        if not parts:
            raise ValueError("model output has no sample_embedding, nuc_logits or target: nothing to train")
        total = sum(self.weights[name] * value for name, value in parts.items())
        # parts are for logging: detached, so they never keep the graph alive
        return total, {name: value.detach() for name, value in parts.items()}


def unifrac_loss(embedding: Tensor, unifrac: Tensor) -> Tensor:
    """MSE between tanh(||e_i - e_j|| / 10) and the UniFrac distance, over all pairs i < j."""
    batch = embedding.size(0)
    if batch < 2:
        raise ValueError(f"the UniFrac loss needs pairs, got a batch of {batch}: set trainer.batch_size >= 2")
    i, j = torch.triu_indices(batch, batch, offset=1, device=embedding.device)
    # only i < j pairs: the norm's gradient at a zero distance (the diagonal) would be undefined
    distance = (embedding[i].float() - embedding[j].float()).norm(dim=-1)
    return F.mse_loss(torch.tanh(distance / 10.0), unifrac[i, j].float())


def masked_nucleotide_loss(logits: Tensor, tokens: Tensor, hidden: Tensor) -> Tensor:
    """Cross-entropy of the original base at the hidden positions (mean over them; 0 if none).

    Computed on every position and weighted by the mask, not gathered with a boolean index,
    which would need a host sync to size its output."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten(), reduction="none")
    weight = hidden.flatten().to(ce.dtype)
    return (ce * weight).sum() / weight.sum().clamp(min=1.0)
