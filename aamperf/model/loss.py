"""AAM training loss: UniFrac distance + masked-nucleotide + optional target, with a deterministic mask."""

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aamperf.distributed import all_sum, gather, gather_constant, unwrap, world_size
from aamperf.errors import UserError
from aamperf.model.loss_arguments import argument_problems
from aamperf.model.masking import masked_nucleotide_sums, nucleotide_mask
from aamperf.model.slots import SLOT_KEYS, SlotIndex
from aamperf.targets import TargetSpec, category_weights, sample_weights
from aamperf.tokens import MASK


class StepCounts(NamedTuple):
    hidden: Tensor  # bases hidden in the step's batch, on every rank
    samples: int  # the step's samples on this rank
    target_weight: Tensor  # the step's samples' target weights on every rank (1 each but in a weighted CE)
    asvs: Tensor  # the step's real ASV slots on every rank (the count part's)


class AAMLoss(nn.Module):
    """loss(model, batch, step) -> (total, parts). Parts the model does not output are left out:
    `unifrac` needs `sample_embedding`, `nucleotide` needs `nuc_logits` and nucleotide_weight > 0
    (`hides_bases`), `target` needs both a `target` output and `batch["target"]`, `count` a `count`
    output (AAM's count head: the MSE of each real ASV's count, scaled to [0, 1] by `set_counts`, the
    original AAM's count loss). total = weighted sum of the parts present.

    The batch needs `tokens`, `counts`, `unifrac` and `asv_ids` (the mask is drawn per ASV); the
    model is called as model(masked tokens, counts, asv_ids=...), the signature of AAM. A batch of
    cached embeddings (`sample_embedding` instead of tokens: aamperf/trainer/cached.py) is given to
    the model as model(sample_embedding=...), its heads alone."""

    def __init__(
        self,
        unifrac_weight: float = 1.0,
        nucleotide_weight: float = 1.0,
        target_weight: float = 1.0,
        mask_fraction: float = 0.15,
        mask_strategy: str = "random",
        seed: int = 0,
        target_loss: str = "mse",
        quantiles: Sequence[float] = (0.1, 0.5, 0.9),
        class_weights: str | Sequence[float] | None = None,
        category_weights: str | dict[str, float] | None = None,
        huber_delta: float = 1.0,
        over_weight: float = 1.0,
        under_weight: float = 1.0,
        count_weight: float = 1.0,
    ):
        problems = argument_problems({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__()
        self.weights = {
            "unifrac": unifrac_weight, "nucleotide": nucleotide_weight, "target": target_weight,
            "count": count_weight,
        }  # fmt: skip
        self.mask_fraction, self.mask_strategy, self.seed = mask_fraction, mask_strategy, seed
        self.target_loss, self.huber_delta = target_loss, huber_delta
        self.over_weight, self.under_weight = over_weight, under_weight
        self.quantiles = [float(q) for q in quantiles]
        self.quantile_levels = torch.tensor(self.quantiles)  # pinball's, moved to the device once (on_device)
        self.class_weights_option = class_weights
        self.class_weights: Tensor | None = None  # per class, once the classes are known (set_target)
        self.category_weights_option = category_weights
        self.category_weights: dict[str, float] | None = None  # data.weight_by's categories' (set_target)
        self.sample_weights: Tensor | None = None  # [n] each sample of the data's, from its category's
        self.sample_units: Tensor | None = None  # [n, 2] zscore_category's each sample's (set_target)
        self.target = TargetSpec("target")  # zscore with mean 0, std 1 until the data's is set
        self.count_low, self.count_high = 0.0, 1.0  # the counts the count part scales to 0 and 1 (set_counts)

    @property
    def target_mean(self) -> float:
        return self.target.shift

    @property
    def target_std(self) -> float:
        return self.target.scale

    def scale_target(self, mean: float, std: float) -> None:
        """A z-scored regression target of the training samples' mean and standard deviation (`set_target`).
        A constant target (std 0) is only centred."""
        self.set_target(TargetSpec("target", shift=float(mean), scale=float(std) if std > 0 else 1.0))

    def set_target(self, target: TargetSpec) -> None:
        """Learn `target` (aamperf/targets.py): a regression in the units its transform gives (so a target
        in years or in thousands weighs as UniFrac's and the nucleotides' parts do), with `target_loss`;
        a classification with cross-entropy, weighted per class by `class_weights`; either, where
        loss.category_weights is set, each sample's part x its category's weight (`sample_weights`, the
        divisor unchanged: the original AAM's weighted mean over the samples). `target_mae` is the
        mean absolute error in the target's own units."""
        self.target, self.class_weights, self.sample_units = target, None, target.sample_units
        if target.is_classification and self.class_weights_option is not None:
            self.class_weights = class_weights(self.class_weights_option, target.class_counts)
        self.category_weights = self.sample_weights = None
        if self.category_weights_option is not None:  # each sample's target part x its category's weight
            if not target.weight_by:
                raise UserError(
                    f"loss.category_weights={self.category_weights_option} weighs each sample by its "
                    "category of metadata columns: name them, data.weight_by=[<column>,...]"
                )
            self.category_weights = category_weights(self.category_weights_option, target)
            self.sample_weights = sample_weights(self.category_weights, target)

    def set_counts(self, low: float, high: float) -> None:
        """The count part's scale: a count c is learnt as (c - low) / (high - low), the training samples'
        least and greatest counts (the original AAM's min-max of its table's non-zero counts); one count
        everywhere is only shifted."""
        self.count_low, self.count_high = float(low), float(high) if high > low else float(low) + 1.0

    def count_sums(self, predicted: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """(the squared error of the count head's `predicted` [B, S] against the batch's `counts` [B, S, 1]
        scaled by `set_counts`, summed over the real ASVs, their number): the part is the first over the
        second. A padding slot's count is 0, a real ASV's at least 1."""
        counts = counts.squeeze(-1).float()
        real = (counts > 0).float()
        scaled = (counts - self.count_low) / (self.count_high - self.count_low)
        return ((predicted.float() - scaled).square() * real).sum(), real.sum()

    def on_device(self, name: str, like: Tensor) -> Tensor:
        """The tensor attribute `name` (class_weights, quantile_levels, sample_weights, sample_units) on
        `like`'s device and dtype, moved there once (not a host copy every step)."""
        value = getattr(self, name)
        if value.device != like.device or value.dtype != like.dtype:
            value = value.to(like)
            setattr(self, name, value)
        return value

    @property
    def target_outputs(self) -> int:
        """What the model's target head must output: a logit per class, a value per quantile, or one."""
        if self.target.is_classification:
            return len(self.target.classes)
        return len(self.quantiles) if self.target_loss == "quantile" else 1

    def point(self, predicted: Tensor) -> Tensor:
        """[B] a regression's point prediction in the model's units: the middle quantile (0.5 where it is
        among them) of a quantile loss, else the one output."""
        if self.target_loss != "quantile":
            return predicted[:, 0]
        middle = self.quantiles.index(0.5) if 0.5 in self.quantiles else len(self.quantiles) // 2
        return predicted[:, middle]

    def target_sums(
        self, predicted: Tensor, target: Tensor, idx: Tensor | None = None
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(the target loss summed over the batch's samples, weighted, the sum of their weights, metrics
        summed over the samples): the part is the first over the second, the same formula for a batch
        and for a micro-batch's share of its step (`micro_loss`). Weights are 1 but for a weighted
        cross-entropy, where they are the samples' class weights (torch's weighted mean). `idx`: the
        samples' indices in the data (`sample_idx`): zscore_category's units and the category weights
        (loss.category_weights, which multiply each sample's loss) are each sample's."""
        predicted, target = predicted.float(), target.float()
        each_weight = units = None  # the samples' own (loss.category_weights; zscore_category)
        if idx is not None and self.sample_weights is not None:
            each_weight = self.on_device("sample_weights", predicted)[idx]
        if idx is not None and self.sample_units is not None:
            units = self.on_device("sample_units", predicted)[idx]
        if self.target.is_classification:
            labels = target.squeeze(1).long()
            weights = None if self.class_weights is None else self.on_device("class_weights", predicted)
            # reduction="none": each sample's cross-entropy x its class's weight
            weighted = F.cross_entropy(predicted, labels, weight=weights, reduction="none")
            weight = torch.ones_like(weighted) if weights is None else weights[labels]
            summed = weighted.sum() if each_weight is None else (weighted * each_weight).sum()
            return summed, weight.sum(), {}
        standard = self.target.forward(target, units)  # [B, 1], the model's units
        if self.target_loss == "quantile":
            each = pinball(predicted, standard, self.on_device("quantile_levels", predicted))  # [B]
        elif self.target_loss == "huber":
            each = F.huber_loss(predicted, standard, delta=self.huber_delta, reduction="none")
        elif self.target_loss == "mae":
            each = F.l1_loss(predicted, standard, reduction="none")
        elif self.target_loss == "asymmetric":  # an absolute error, weighed by its sign
            error = predicted - standard
            each = self.over_weight * error.clamp(min=0) - self.under_weight * error.clamp(max=0)
        else:
            each = F.mse_loss(predicted, standard, reduction="none")
        each = each.reshape(len(each), -1).sum(dim=1)  # [B]: a sample's loss (a quantile's already its mean)
        summed = (each if each_weight is None else each * each_weight).sum()
        own = self.target.inverse(self.point(predicted.detach()), units)  # the target's own units
        mae = (own - target.squeeze(1)).abs().sum()
        return summed, predicted.new_full((), float(target.size(0))), {"target_mae": mae}  # a fill, no copy

    @property
    def hides_bases(self) -> bool:
        """Does the loss hide bases from the model? Only where it learns them: at nucleotide_weight=0 the
        nucleotide part would train nothing, so the model sees whole sequences and the part is left out
        (nothing hidden, nothing to score); a frozen encoder then gives each sample one embedding, which
        aamperf/trainer/cached.py computes once."""
        return self.weights["nucleotide"] > 0

    def hidden_bases(self, batch: dict, step: int) -> Tensor | None:
        """Which bases of the batch this step hides (`nucleotide_mask`), or None where none are."""
        if not self.hides_bases:
            return None
        return nucleotide_mask(
            batch["tokens"], batch["asv_ids"], step, self.seed, self.mask_fraction, self.mask_strategy
        )

    def outputs(self, model: nn.Module, batch: dict, step: int) -> tuple[dict[str, Tensor], Tensor | None]:
        """(the model's outputs on the batch with this step's bases hidden, which bases are hidden or None).
        A batch of cached sample embeddings (aamperf/trainer/cached.py) goes to the model's heads alone. The
        samples' categories (data.categorical) go as `categorical=` only where the batch has them: a model
        without the keyword serves data without them."""
        conditions = {"categorical": batch["categorical"]} if "categorical" in batch else {}
        if "sample_embedding" in batch:  # and the per-ASV states, where the target head reads them
            cached = {k: batch[k] for k in ("sample_embedding", "asv_states", "asv_real") if k in batch}
            return model(**cached, **conditions), None
        tokens, asv_ids, hidden = batch["tokens"], batch["asv_ids"], self.hidden_bases(batch, step)
        shown = tokens if hidden is None else tokens.masked_fill(hidden, MASK)
        # where the real ASVs lie, found by the collate on the host, to a model that takes them (AAM): its
        # forward then waits for no GPU. Hiding bases leaves every real slot real
        if "real_slots" in batch and getattr(unwrap(model), "takes_slots", False):
            conditions["slots"] = SlotIndex(*(batch[k] for k in SLOT_KEYS))
        return model(shown, batch["counts"], asv_ids=asv_ids, **conditions), hidden

    def forward(self, model: nn.Module, batch: dict, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        total, parts, _ = self.evaluate(model, batch, step)
        return total, parts

    def evaluate(
        self, model: nn.Module, batch: dict, step: int
    ) -> tuple[Tensor, dict[str, Tensor], Tensor | None]:
        """(the loss, its parts, the model's target output [B, target_outputs] detached, or None):
        `forward`'s, with the predictions it was taken on (in the model's units: `target.inverse` and
        `point` put a regression's in the target's own)."""
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
        if "nuc_logits" in out and hidden is not None:
            total_ce, n_hidden = masked_nucleotide_sums(out["nuc_logits"], batch["tokens"], hidden)
            parts["nucleotide"] = world * total_ce / all_sum(n_hidden).clamp(min=1.0)
        metrics: dict[str, Tensor] = {}  # reported beside the parts, not trained on
        predicted = None
        if "target" in out and batch.get("target") is not None:
            # world x (local sum / the global batch's weights): a weighted cross-entropy's mean over
            # the whole batch's weights, not the mean of the ranks' weighted means
            predicted = out["target"]
            total_loss, weight, sums = self.target_sums(predicted, batch["target"], batch["sample_idx"])
            parts["target"] = world * total_loss / all_sum(weight)
            metrics.update({name: value / predicted.size(0) for name, value in sums.items()})
            predicted = predicted.detach()
        if "count" in out:
            squares, n_real = self.count_sums(out["count"], batch["counts"])
            parts["count"] = world * squares / all_sum(n_real).clamp(min=1.0)
        if not parts:
            raise ValueError("model output has no sample_embedding, nuc_logits or target: nothing to train")
        total = sum(self.weights[name] * value for name, value in parts.items())
        # parts are for logging: detached, so they never keep the graph alive
        return total, {name: value.detach() for name, value in {**parts, **metrics}.items()}, predicted

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
        masks = [self.hidden_bases(b, step) for b in batches]
        hidden = sum(m.sum() for m in masks) if self.hides_bases else batches[0]["sample_idx"].new_zeros(())
        samples = sum(b["sample_idx"].size(0) for b in batches)
        target_weight = torch.full((), float(samples), device=batches[0]["sample_idx"].device)  # no host copy
        if self.class_weights is not None and batches[0].get("target") is not None:
            weights = self.on_device("class_weights", batches[0]["target"].float())
            target_weight = sum(weights[b["target"].squeeze(1).long()].sum() for b in batches)
        asvs = sum((b["counts"] > 0).sum() for b in batches).float()
        return StepCounts(all_sum(hidden.float()), samples, all_sum(target_weight), all_sum(asvs))

    def micro_loss(
        self, model: nn.Module, batch: dict, step: int, embedding_grad: Tensor | None, counts: StepCounts
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(what to backpropagate for this micro-batch, its shares of the step's separable parts and metrics).
        The first is its embeddings x their cached gradient `embedding_grad` (the UniFrac part's, taken on
        the whole batch) plus its shares of the other parts: summed over the step's micro-batches, the
        gradient of the whole batch's loss."""
        out, hidden = self.outputs(model, batch, step)
        world = world_size()
        parts: dict[str, Tensor] = {}
        if "nuc_logits" in out and hidden is not None:
            total_ce, _ = masked_nucleotide_sums(out["nuc_logits"], batch["tokens"], hidden)
            parts["nucleotide"] = world * total_ce / counts.hidden.clamp(min=1.0)
        metrics: dict[str, Tensor] = {}
        if "target" in out and batch.get("target") is not None:  # shares of the step's global mean
            total_loss, _, sums = self.target_sums(out["target"], batch["target"], batch["sample_idx"])
            parts["target"] = world * total_loss / counts.target_weight
            metrics.update({name: value / counts.samples for name, value in sums.items()})
        if "count" in out:
            squares, _ = self.count_sums(out["count"], batch["counts"])
            parts["count"] = world * squares / counts.asvs.clamp(min=1.0)
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


def pinball(predicted: Tensor, target: Tensor, quantiles: list[float] | Tensor) -> Tensor:
    """[B] each sample's pinball loss averaged over the quantiles: predicted [B, Q] (a column per
    quantile), target [B, 1]. Under-predicting quantile q costs q per unit, over-predicting 1 - q.
    `quantiles` as a tensor on predicted's device and dtype is used as it is (no copy)."""
    q = torch.as_tensor(quantiles).to(predicted)
    error = target - predicted
    return torch.maximum(q * error, (q - 1) * error).mean(dim=1)


def class_weights(option: str | Sequence[float], counts: list[int]) -> Tensor:
    """Per-class weights of the cross-entropy: `balanced` n / (classes x count), scikit-learn's (a rare
    class weighs as a common one), or the list given, one per class (the sorted classes' order)."""
    if option == "balanced":
        counts_t = torch.tensor(counts, dtype=torch.float64)
        return counts_t.sum() / (len(counts) * counts_t)
    weights = [float(w) for w in option]
    if len(weights) != len(counts):
        raise UserError(
            f"loss.class_weights has {len(weights)} weights for {len(counts)} classes; give one per class "
            "(in the sorted order of the classes), or loss.class_weights=balanced"
        )
    return torch.tensor(weights, dtype=torch.float64)
