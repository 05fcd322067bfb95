"""AAM training loss: UniFrac distance + masked-nucleotide + optional target, with a deterministic mask."""

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aamperf.distributed import all_sum, gather, gather_constant, world_size
from aamperf.tokens import MASK, real_bases

_M32 = 0xFFFFFFFF


def _hash32(x):
    """A 32-bit integer mix (two xor-shift-multiply rounds). Works on Python ints and int64 tensors;
    operands stay below 2**59, so int64 never overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def nucleotide_mask(tokens: Tensor, asv_ids: Tensor, step: int, seed: int, fraction: float) -> Tensor:
    """Bool [B, S, L]: which real bases (A/C/G/T) to hide at this step.

    Each position draws from a counter-based hash of (seed, step, global ASV id, base index),
    computed on the tokens' device: at a given step an ASV is masked the same way in every sample
    and every batch that holds it (so the aam_ops dedup phase can encode it once), the mask does not
    depend on how the batch is composed, padded or split across processes, and drawing it needs no
    host sync. `asv_ids` [B, S]: the batch's global ASV index of each slot (-1 on padding).
    """
    length = tokens.size(-1)
    step_key = _hash32(_hash32(seed & _M32) ^ (step & _M32))  # a Python int
    asv_key = _hash32(_hash32(asv_ids.to(torch.int64) & _M32) ^ step_key).unsqueeze(-1)  # [B, S, 1]
    position = torch.arange(length, device=tokens.device, dtype=torch.int64)
    draw = _hash32(asv_key ^ _hash32(position)) >> 8  # 24 uniform bits
    hidden = draw < int(fraction * (1 << 24))
    return hidden & real_bases(tokens)


WEIGHTS = ("unifrac_weight", "nucleotide_weight", "target_weight")


def argument_problems(args: dict[str, Any], prefix: str = "") -> list[str]:
    """Every problem of AAMLoss's arguments `args` (each one given or its default), as `<prefix><name>=
    <value> must ...`: checked by AAMLoss as it is built, and by aamperf/checks.py before a run builds
    anything. A negative weight would reward the error it weighs; a fraction of 0 hides no base (the
    nucleotide part has nothing to predict), of 1 or more every one."""
    problems = [
        f"{prefix}{name}={args[name]} must be a number >= 0"
        for name in WEIGHTS
        if not is_number(args[name]) or args[name] < 0
    ]
    fraction = args["mask_fraction"]
    if not is_number(fraction) or not 0 < fraction < 1:
        problems.append(
            f"{prefix}mask_fraction={fraction} must be a number between 0 and 1 (the share of real bases "
            "hidden and predicted)"
        )
    return problems


class StepCounts(NamedTuple):
    hidden: Tensor  # bases hidden in the step's batch, on every rank
    samples: int  # the step's samples on this rank


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class AAMLoss(nn.Module):
    """loss(model, batch, step) -> (total, parts). Parts the model does not output are left out:
    `unifrac` needs `sample_embedding`, `nucleotide` needs `nuc_logits`, `target` needs both a
    `target` output and `batch["target"]`. total = weighted sum of the parts present.

    The batch needs `tokens`, `counts`, `unifrac` and `asv_ids` (the mask is drawn per ASV); the
    model is called as model(masked tokens, counts, asv_ids=...), the signature of AAM."""

    def __init__(
        self,
        unifrac_weight: float = 1.0,
        nucleotide_weight: float = 1.0,
        target_weight: float = 1.0,
        mask_fraction: float = 0.15,
        seed: int = 0,
    ):
        problems = argument_problems({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__()
        self.weights = {"unifrac": unifrac_weight, "nucleotide": nucleotide_weight, "target": target_weight}
        self.mask_fraction, self.seed = mask_fraction, seed
        self.target_mean, self.target_std = 0.0, 1.0

    def scale_target(self, mean: float, std: float) -> None:
        """Standardize the target with the training samples' mean and standard deviation: the target
        part is the MSE in standard units, so a target in years or in thousands weighs as UniFrac's and
        the nucleotides' parts do; the model predicts standard units (prediction x std + mean is the
        target); `target_mae` is the mean absolute error in the target's own units. A constant target
        (std 0) is only centred."""
        self.target_mean, self.target_std = float(mean), float(std) if std > 0 else 1.0

    def outputs(self, model: nn.Module, batch: dict, step: int) -> tuple[dict[str, Tensor], Tensor]:
        """(the model's outputs on the batch with this step's bases hidden, which bases are hidden)."""
        tokens, asv_ids = batch["tokens"], batch["asv_ids"]
        hidden = nucleotide_mask(tokens, asv_ids, step, self.seed, self.mask_fraction)
        return model(tokens.masked_fill(hidden, MASK), batch["counts"], asv_ids=asv_ids), hidden

    def forward(self, model: nn.Module, batch: dict, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        tokens = batch["tokens"]
        out, hidden = self.outputs(model, batch, step)

        # Under torch.distributed each rank holds a slice of the global batch. Every part is the
        # global batch's, scaled so that DDP's mean of the ranks' gradients is its gradient: UniFrac
        # on the gathered embeddings (every pair of the global batch, the same value on every rank),
        # the others as world x (this rank's sum / the global count).
        world = world_size()
        parts: dict[str, Tensor] = {}
        if "sample_embedding" in out:
            parts["unifrac"] = unifrac_loss(
                gather(out["sample_embedding"]), gather_constant(batch["unifrac"])
            )
        if "nuc_logits" in out:
            total_ce, n_hidden = masked_nucleotide_sums(out["nuc_logits"], tokens, hidden)
            parts["nucleotide"] = world * total_ce / all_sum(n_hidden).clamp(min=1.0)
        metrics: dict[str, Tensor] = {}  # reported beside the parts, not trained on
        if "target" in out and batch.get("target") is not None:
            # equal slices: world x (local sum / global count) is the local mean
            predicted, target = out["target"].float(), batch["target"].float()
            standard = (target - self.target_mean) / self.target_std
            parts["target"] = F.mse_loss(predicted, standard)
            metrics["target_mae"] = (predicted.detach() - standard).abs().mean() * self.target_std
        if not parts:
            raise ValueError("model output has no sample_embedding, nuc_logits or target: nothing to train")
        total = sum(self.weights[name] * value for name, value in parts.items())
        # parts are for logging: detached, so they never keep the graph alive
        return total, {name: value.detach() for name, value in {**parts, **metrics}.items()}

    # Gradient caching (aamperf/trainer/gradcache.py): a step's batch in micro-batches, its loss the whole
    # batch's. The UniFrac part needs every pair of the step's samples: it is taken once, on the embeddings
    # of every micro-batch (`embed`, `pairwise`); the other parts are sums over samples, each micro-batch's
    # share of them taken beside the cached gradient of its embeddings (`micro_loss`), over the step's counts.

    def embed(self, model: nn.Module, batch: dict, step: int) -> Tensor | None:
        """The batch's sample embeddings [b, D], or None where the model outputs none."""
        return self.outputs(model, batch, step)[0].get("sample_embedding")

    def pairwise(self, embedding: Tensor, unifrac: Tensor) -> Tensor:
        """The UniFrac part of the batch whose embeddings on this rank are `embedding` [b, D] and UniFrac
        rows `unifrac` [b, B]: every pair of the global batch (the same value on every rank)."""
        return unifrac_loss(gather(embedding), gather_constant(unifrac))

    def step_counts(self, batches: list[dict], step: int) -> StepCounts:
        """What the step's separable parts divide by: its hidden bases on every rank, its samples here."""
        seed, fraction = self.seed, self.mask_fraction
        hidden = sum(nucleotide_mask(b["tokens"], b["asv_ids"], step, seed, fraction).sum() for b in batches)
        return StepCounts(all_sum(hidden.float()), sum(b["tokens"].size(0) for b in batches))

    def micro_loss(
        self, model: nn.Module, batch: dict, step: int, embedding_grad: Tensor | None, counts: StepCounts
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(what to backpropagate for this micro-batch, its shares of the step's separable parts and metrics).
        The first is its embeddings x their cached gradient `embedding_grad` (the UniFrac part's, taken on
        the whole batch) plus its shares of the other parts: summed over the step's micro-batches, the
        gradient of the whole batch's loss."""
        out, hidden = self.outputs(model, batch, step)
        world, share = world_size(), batch["tokens"].size(0) / counts.samples
        parts: dict[str, Tensor] = {}
        if "nuc_logits" in out:
            total_ce, _ = masked_nucleotide_sums(out["nuc_logits"], batch["tokens"], hidden)
            parts["nucleotide"] = world * total_ce / counts.hidden.clamp(min=1.0)
        metrics: dict[str, Tensor] = {}
        if "target" in out and batch.get("target") is not None:  # means over the step's samples on this rank
            predicted, target = out["target"].float(), batch["target"].float()
            standard = (target - self.target_mean) / self.target_std
            parts["target"] = F.mse_loss(predicted, standard) * share
            metrics["target_mae"] = (predicted.detach() - standard).abs().mean() * self.target_std * share
        backward = sum(self.weights[name] * value for name, value in parts.items())
        if embedding_grad is not None:  # d(weighted UniFrac part)/d(embedding) = weight x the cached gradient
            embedding = out["sample_embedding"].float()
            backward = backward + self.weights["unifrac"] * (embedding * embedding_grad.float()).sum()
        if not torch.is_tensor(backward):
            raise ValueError("model output has no sample_embedding, nuc_logits or target: nothing to train")
        return backward, {name: value.detach() for name, value in {**parts, **metrics}.items()}

    def combine(self, parts: dict[str, Tensor]) -> Tensor:
        """The loss of these parts (metrics among them left out): their weighted sum."""
        return sum(self.weights[name] * value for name, value in parts.items() if name in self.weights)


def unifrac_of(distance: Tensor) -> Tensor:
    """The UniFrac distance the model predicts for samples whose embeddings are `distance` apart."""
    return torch.tanh(distance / 10.0)


def predicted_unifrac(embedding: Tensor) -> Tensor:
    """[n, n] predicted UniFrac between every pair of these sample embeddings [n, D] (0 on the diagonal)."""
    return unifrac_of(torch.cdist(embedding.float(), embedding.float())).fill_diagonal_(0.0)


def unifrac_loss(embedding: Tensor, unifrac: Tensor) -> Tensor:
    """MSE between the predicted UniFrac (`unifrac_of`) and the true one, over all pairs i < j."""
    batch = embedding.size(0)
    if batch < 2:
        raise ValueError(f"the UniFrac loss needs pairs, got a batch of {batch}: set trainer.batch_size >= 2")
    i, j = torch.triu_indices(batch, batch, offset=1, device=embedding.device)
    # only i < j pairs: the norm's gradient at a zero distance (the diagonal) would be undefined
    distance = (embedding[i].float() - embedding[j].float()).norm(dim=-1)
    return F.mse_loss(unifrac_of(distance), unifrac[i, j].float())


def masked_nucleotide_sums(logits: Tensor, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of the cross-entropy of the original base at the hidden positions, their number).

    Computed on every position and weighted by the mask, not gathered with a boolean index,
    which would need a host sync to size its output."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten(), reduction="none")
    weight = hidden.flatten().to(ce.dtype)
    return (ce * weight).sum(), weight.sum()
