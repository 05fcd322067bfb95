"""Stage 2's fast path (`finetune.cache_embeddings`): the heads trained on sample embeddings computed once.

With the encoder frozen (`finetune.freeze=encoder`: no weight of it changes, and it runs in eval mode, dropout
off) a sample's embedding depends on the encoder's input alone: its table, rarefied once with data.seed and
cut to its max_asvs most abundant ASVs in a fixed order (aamperf/data/samples.py), and the bases the loss
hides, which change every step unless it hides none (loss.nucleotide_weight=0: AAMLoss.hides_bases). Then
every training and validation sample is embedded once, before the first step, and each step trains the heads
on the cached embeddings: the same loss (AAMLoss's parts on the model's `sample_embedding` and target
outputs, `AAM.heads`), the same batches in the same order (the run's own sampler, batched as its loader
batches: the schedule, checkpoints and resume see the stream they always saw), validation on the same
samples; a step costs the heads' forward and backward instead of the encoder's too. The UniFrac part on
frozen embeddings trains nothing (a constant), reported as before. The transformer target head
(model.target_head=transformer) reads each sample's per-ASV states: those are cached too, its real ASVs' only
(`StateCache`), where they fit in half the device's free memory.
"""

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Subset

from aamperf.data.branches import batch_matrix, batch_unifrac
from aamperf.data.collate import Collate
from aamperf.device import new_cuda_graph_step, sync, to_device
from aamperf.errors import UserError
from aamperf.model.aam import AAM
from aamperf.phases import Plan

# Batch UniFrac (data.unifrac_mode=batch) of the cached samples is computed once, as one matrix, where it
# takes at most this much memory: each step then slices it, as a precomputed matrix is sliced, instead of
# multiplying the batch's branch sets (which, beside the heads' step, is most of it: 79 ms of a batch of 8
# of the default data on a loaded 2-core CPU). Past it, each batch's is computed as the run computes it.
UNIFRAC_MATRIX_BYTES = 64 * 2**20
# The per-ASV states a transformer target head reads are cached where they take at most this share of the
# device's free memory (the GPU's, or the host's available RAM): the rest is the run's own.
STATES_SHARE = 0.5


@dataclass
class StateCache:
    """A frozen encoder's outputs for every sample, computed once: `embeddings` [n_samples, D] (zeros for a
    sample not embedded), and where the target head reads them the real ASVs' states `states` [T, D], sample
    i's in rows offsets[i]:offsets[i + 1] (`offsets` [n_samples + 1] long, on the host)."""

    embeddings: torch.Tensor
    states: torch.Tensor | None = None
    offsets: torch.Tensor | None = None

    @property
    def bytes(self) -> int:
        tensors = [t for t in (self.embeddings, self.states) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def padded_states(self, idx: torch.Tensor, collate: Collate) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `idx`'s states [B, S, D] (S: the slots `collate` gives their batch, the frozen path's
        width: its dropout draws the same shapes; 0 past a sample's real ASVs) and which are real [B, S]."""
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        lengths = ends - starts
        padded = self.states.new_zeros(len(idx), collate.width(lengths), self.states.size(1))
        # each real ASV's (sample, slot) and row of `states`, on the host: one gather, one scatter on device
        sample = torch.repeat_interleave(torch.arange(len(idx)), lengths)
        first = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)  # its sample's first, in order
        slot = torch.arange(int(lengths.sum())) - first
        rows = torch.repeat_interleave(starts, lengths) + slot
        device = padded.device
        padded[sample.to(device), slot.to(device)] = self.states[rows.to(device)]
        real = torch.arange(padded.size(1))[None, :] < lengths[:, None]
        return padded, real.to(device)


def why_not(cfg: DictConfig, model: torch.nn.Module, loss_fn: Any, world_size: int) -> str | None:
    """Why cached embeddings would not give the losses of the frozen encoder run at every step, as the
    override that changes it; None where they would. `model`: the run's, before any phase wrapped it."""
    freeze = str(cfg.finetune.freeze)
    if freeze != "encoder":
        trains = "the whole encoder trains" if freeze == "none" else "the sample encoder trains"
        return (
            f"finetune.freeze={freeze}: {trains}, so embeddings change every step (finetune.freeze=encoder)"
        )
    if cfg.data.get("asv_sampling") == "random":
        return "data.asv_sampling=random: a sample's ASVs, and so its embedding, change every pass"
    if not isinstance(model, AAM):
        return f"model {cfg.model.get('_target_')} is not AAM: only AAM runs its heads on given embeddings"
    if model.count_head is not None:
        return "model.count_head=true: the count head reads each ASV's state and count, which are not cached"
    if not hasattr(loss_fn, "hides_bases"):
        return f"loss {cfg.loss.get('_target_')} is not AAMLoss: it may not take a batch of embeddings"
    if loss_fn.hides_bases:
        return (
            f"loss.nucleotide_weight={cfg.loss.nucleotide_weight}: the nucleotide part reads the encoder's "
            "per-base outputs on bases hidden anew each step (loss.nucleotide_weight=0)"
        )
    if world_size > 1:
        return (
            f"distributed.strategy={cfg.distributed.strategy}: the cache is one process's (distributed=none)"
        )
    return None


def states_too_big(model: AAM, data, device: torch.device) -> str | None:
    """Why the per-ASV states of every sample (the transformer target head's input) are not cached: more
    than STATES_SHARE of the device's free memory, as the override that changes it; None where they fit or
    the head reads none."""
    if model.target_encoder is None:
        return None
    asvs = np.minimum(np.diff(np.asarray(data.dataset.rows.ptr)), data.dataset.max_asvs)
    need = int(asvs.sum()) * model.embedding_dim * 4  # fp32: the most a state takes
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = psutil.virtual_memory().available
    if need <= STATES_SHARE * free:
        return None
    return (
        f"the per-ASV states of {len(asvs)} samples ({int(asvs.sum())} ASVs) take {need / 2**30:.1f} GiB, "
        f"over {STATES_SHARE:.0%} of the {device.type}'s free {free / 2**30:.1f} GiB "
        "(model.target_head=linear caches one embedding per sample)"
    )


def refusal(
    cfg: DictConfig, model: torch.nn.Module, loss_fn: Any, data, device: torch.device, world_size: int
) -> str | None:
    """Why this run's steps will not train on cached embeddings (the override that changes it), or None
    where they will: `use_cached_embeddings`'s decision, known before the phases (compile=auto skips its
    trial of the whole model's steps)."""
    if cfg.finetune.cache_embeddings is False:
        return "finetune.cache_embeddings=false"
    return why_not(cfg, model, loss_fn, world_size) or states_too_big(model, data, device)


def use_cached_embeddings(
    cfg: DictConfig, plan: Plan, model: torch.nn.Module, data, loss_fn: Any, device: torch.device,
    world_size: int, summary: dict[str, Any],
) -> bool:  # fmt: skip
    """finetune.cache_embeddings: where it applies, embed every sample once and put loaders of the cached
    embeddings in `data` (its train and val loaders); a fine-tune records what was done or why not in
    summary["finetune"]["cached_embeddings"]. `true` where it cannot apply: a one-line UserError."""
    asked = cfg.finetune.cache_embeddings
    if not (asked == "auto" or isinstance(asked, bool)):
        raise UserError(f"finetune.cache_embeddings={asked} must be auto, true or false")
    reason = refusal(cfg, model, loss_fn, data, device, world_size)
    if asked is True and reason:
        raise UserError(
            f"finetune.cache_embeddings=true cannot apply: {reason}; or finetune.cache_embeddings=auto"
        )
    if reason:
        if "finetune" in summary:  # a fine-tune (init.from_run): said why its steps run the encoder
            summary["finetune"]["cached_embeddings"] = {"applied": False, "reason": reason}
        return False
    started = time.perf_counter()
    train_idx, val_idx = (list(loader.dataset.indices) for loader in (data.train_loader, data.val_loader))
    model.keep_states = True  # the transformer head's input, beside the embeddings (only while embedding)
    try:
        cache = embed_samples(plan, loss_fn, data, sorted(train_idx + val_idx), device)
    finally:
        model.keep_states = False
    unifrac = data.collate.unifrac  # precomputed: the run's matrix
    if unifrac is None and len(data.dataset) ** 2 * 4 <= UNIFRAC_MATRIX_BYTES:
        unifrac = unifrac_matrix(data)
    sync(device)
    summary.setdefault("finetune", {})["cached_embeddings"] = {
        "applied": True,
        "samples_embedded": len(train_idx) + len(val_idx),
        "embed_s": round(time.perf_counter() - started, 3),  # the embeddings, and batch UniFrac's matrix
        "bytes": cache.bytes,
        "cached": "sample embeddings" if cache.states is None else "sample embeddings and per-ASV states",
        "unifrac": "matrix" if unifrac is not None else "per batch",
        # dataloader.* is not used: a batch is a few lookups into the cache, made in the main process
        "loader": "main process, batches of cached embeddings",
    }
    data.train_loader, data.val_loader = cached_loaders(data, cache, unifrac)
    return True


def unifrac_matrix(data) -> torch.Tensor:
    """[n_samples, n_samples] float32: batch UniFrac of every sample against every other, from the branch
    sets as `to_device` computes a batch's (on the host: once)."""
    everyone = list(range(len(data.dataset)))
    matrix, lengths = batch_matrix([data.dataset.branches[i] for i in everyone], data.collate.branch_lengths)
    return batch_unifrac(matrix, lengths, torch.arange(len(everyone)))


@torch.no_grad()
def embed_samples(plan: Plan, loss_fn: Any, data, indices: list[int], device: torch.device) -> StateCache:
    """Every sample's embedding as a step computes it (the loss's model input, the run's autocast, eval mode),
    in rows `indices` (zeros elsewhere), on `device`, batched as the run batches; and the real ASVs' states
    where the model outputs them (`asv_states`: the transformer target head's input)."""
    # a generator of its own: iterating a loader draws a seed from the one it has, else from the global one,
    # and the trained heads' dropout would then draw other masks than the frozen path's
    loader = DataLoader(
        Subset(data.dataset, indices), batch_size=data.train_loader.batch_size, collate_fn=data.collate,
        generator=torch.Generator(),
    )  # fmt: skip
    model, embeddings, states = plan.model, None, {}
    model.eval()
    for batch in loader:
        new_cuda_graph_step(device)
        batch = to_device(batch, device)
        with plan.autocast():
            out = loss_fn.outputs(model, batch, 0)[0]
        embedding = out["sample_embedding"]
        if embeddings is None:
            embeddings = embedding.new_zeros(len(data.dataset), embedding.size(1))
        # copies: a CUDA graph's outputs are overwritten by its next replay
        embeddings[batch["sample_idx"]] = embedding
        if "asv_states" in out:
            rows = zip(batch["sample_idx"].tolist(), out["asv_states"], out["asv_real"], strict=True)
            states.update((i, state[real].clone()) for i, state, real in rows)
    model.train()
    if not states:
        return StateCache(embeddings)
    lengths = torch.tensor([len(states[i]) if i in states else 0 for i in range(len(data.dataset))])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return StateCache(embeddings, torch.cat([states[i] for i in sorted(states)]), offsets)


class CachedCollate:
    """Sample indices -> the batch `Collate` makes of those samples, with their cached `sample_embedding`
    [B, D] in place of their tokens: sample_idx, unifrac (or the branch sets it is computed from on the
    device), target, categorical (data.categorical's, which the target head reads), n_samples and n_tokens
    (the samples' real bases, as the step meter counts them whichever path trains on them). Nothing is
    tokenized or padded."""

    def __init__(self, cache: StateCache, data, unifrac: torch.Tensor | None):
        self.cache, self.dataset, self.collate = cache, data.dataset, data.collate
        self.unifrac = unifrac  # [n_samples, n_samples], or None: each batch's from its branch sets

    def __call__(self, items: list[int]) -> dict[str, Any]:
        idx = torch.tensor(items)
        batch = {
            "sample_idx": idx,
            "sample_embedding": self.cache.embeddings[idx.to(self.cache.embeddings.device)],
            "n_samples": len(items),
            "n_tokens": int(self.dataset.n_tokens[items].sum()),
        }
        if self.cache.states is not None:  # the transformer target head's input
            batch["asv_states"], batch["asv_real"] = self.cache.padded_states(idx, self.collate)
        if self.unifrac is not None:
            batch["unifrac"] = self.unifrac[idx][:, idx]
        else:  # batch UniFrac: computed by to_device from the branch sets, as Collate's batches are
            branches = [self.dataset.branches[i] for i in items]
            matrix, lengths = batch_matrix(branches, self.collate.branch_lengths)
            batch.update(branches=matrix, branch_lengths=lengths, branch_rows=torch.arange(len(items)))
        if self.dataset.target is not None:
            batch["target"] = self.dataset.target[idx].float().unsqueeze(1)
        categorical = getattr(self.dataset, "categorical", None)  # data.categorical's, for the target head
        if categorical is not None:
            batch["categorical"] = categorical[idx]
        return batch


def cached_loaders(data, cache: StateCache, unifrac: torch.Tensor | None) -> tuple[DataLoader, DataLoader]:
    """The run's train and val loaders over the cached embeddings: the same samples in the same batches,
    the train loader drawing from the run's own sampler (its generator: the batch order, and where a
    checkpoint left it). In the main process: a batch is a few index lookups."""
    collate = CachedCollate(cache, data, unifrac)
    train, val = data.train_loader, data.val_loader

    def loader(indices: list[int], batch_size: int, **order: Any) -> DataLoader:
        # the items are the samples' indices (range: i -> i), batched by `order` as the run's loader does
        samples = Subset(range(len(data.dataset)), indices)
        return DataLoader(samples, batch_size=batch_size, collate_fn=collate, drop_last=True, **order)

    return (
        # the run's generators too: a loader without one draws each pass's seed from the global generator
        loader(
            list(train.dataset.indices), train.batch_size, sampler=train.sampler, generator=train.generator
        ),
        loader(list(val.dataset.indices), val.batch_size, shuffle=False, generator=val.generator),
    )


def head_flops(model: AAM, host_batches: list[dict[str, Any]], forwards: int = 3) -> tuple[float, float]:
    """(model, hardware) FLOPs of a step on cached embeddings, the mean over `host_batches` (the run's
    batches of tokens, whose real ASVs the transformer head reads): the target head's matmuls
    (`AAM.target_head_flops`), forward and backward counted as 3 forwards as `AAM.flops_per_step` counts
    them (it leaves UniFrac's B^2 D out too); the hardware `forwards` of them (4 by gradient caching) over
    the positions the head runs on (padded, unless packed). A head's layers checkpointed by memory=... run
    part of their forward again in backward (torch's checkpoint stops recomputing once backward has what it
    saves): not counted here."""
    model_flops, hardware_flops = [], []
    for b in host_batches:
        real = AAM.real_asvs_per_sample(b["tokens"])
        # what the head runs on: the real ASVs packed, or the batch's width (`StateCache.padded_states`)
        run = real if model.pack_samples else [b["tokens"].size(1)] * len(real)
        model_flops.append(3.0 * model.target_head_flops(real))
        hardware_flops.append(float(forwards) * model.target_head_flops(run))
    return sum(model_flops) / len(model_flops), sum(hardware_flops) / len(hardware_flops)
