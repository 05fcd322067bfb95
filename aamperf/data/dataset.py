"""Samples as unpadded ASV lists, the collate that pads them and slices UniFrac, the split and the loaders."""

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import biom
import numpy as np
import scipy.sparse as sp
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, RandomSampler, Sampler, Subset

from aamperf.data.branches import batch_matrix
from aamperf.data.categorical import check_columns, learn_categories, read_values
from aamperf.data.metadata import read_target_column
from aamperf.data.samples import SampleDataset, Samples
from aamperf.data.store import sample_store
from aamperf.data.tables import read_unifrac, read_val_samples, resolve_files, shown_ids, table_ids
from aamperf.data.unifrac import cached_unifrac, select_unifrac
from aamperf.errors import UserError
from aamperf.files import write_atomic
from aamperf.model.aam import SLOT_KEYS, bucket_size, bucketed, slot_index
from aamperf.targets import (
    TargetSpec,
    fit_classes,
    fit_groups,
    fit_regression,
    fit_weight_keys,
    group_keys,
)
from aamperf.tokens import TOKENS_PER_ASV

log = logging.getLogger(__name__)


@dataclass
class Collate:
    """Items -> batch: pads ASVs to `pad_to` (None: the longest sample of the batch), slices UniFrac.

    Batch: tokens int64 [B, S, 151], counts float32 [B, S, 1], unifrac float32 [B, B],
    sample_idx int64 [B], asv_ids int64 [B, S] (each slot's row of the token table, -1 on padding),
    real_slots, unique_first, unique_inverse int64 and n_real_slots (where the real ASVs lie:
    `aamperf.model.aam.slot_index`; with `bucket_cap`, padded to bucket sizes, `bucketed`, and n_real_slots
    the count of real slots, else None),
    target float32 [B, 1] (when the data has one), categorical int64 [B, columns] (data.categorical: each
    sample's category per column, 0 unseen or missing), n_samples and n_tokens int.
    Under torch.distributed B is this rank's slice b of the global batch, and unifrac is [b, B]:
    its rows against every sample of the global batch; n_samples and n_tokens count the global batch.
    Padding rows are all zero (START included), so `tokens[..., 0] == 0` marks padding.
    Batch UniFrac (`branch_lengths` set): no `unifrac` yet, but the global batch's branch sets
    `branches` uint8 [B, U], their `branch_lengths` float64 [U] and this rank's `branch_rows` [b], from
    which `to_device` computes `unifrac` [b, B] on the run's device (aamperf/data/branches.py).
    """

    tokens: torch.Tensor  # [n_asvs, 151] uint8, every distinct ASV tokenized once
    unifrac: torch.Tensor | None  # [n_samples, n_samples] float32, the whole data set (None: prediction)
    pad_to: int | None
    rank: int = 0  # under torch.distributed: the items are the global batch, this rank takes its slice
    world_size: int = 1
    bucket_cap: int | None = None  # with pad_to=None: the longest sample rounded up to `bucket_size`, <= this
    branch_lengths: np.ndarray | None = None  # batch UniFrac: the lengths the items' `branches` index

    def __call__(self, items: list[dict]) -> dict:
        # Counted over the global batch: what one optimizer (micro-)step processes on all ranks.
        n_samples, n_tokens = len(items), sum(item["n_tokens"] for item in items)
        batch_idx = torch.tensor([item["sample_idx"] for item in items])
        rows = torch.arange(len(items))
        if self.branch_lengths is not None:  # of the global batch: every rank's rows meet every column
            branches, branch_lengths = batch_matrix([item["branches"] for item in items], self.branch_lengths)
        if self.world_size > 1:
            share = len(items) // self.world_size
            items = items[self.rank * share : (self.rank + 1) * share]
            rows = rows[self.rank * share : (self.rank + 1) * share]
        lengths = torch.tensor([len(item["asv_idx"]) for item in items])
        width = self.width(lengths)
        batch_pos = torch.repeat_interleave(torch.arange(len(items)), lengths)
        asv_pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        asv_idx = torch.cat([item["asv_idx"] for item in items])
        tokens = torch.zeros(len(items), width, TOKENS_PER_ASV, dtype=torch.long)
        tokens[batch_pos, asv_pos] = self.tokens[asv_idx].long()
        asv_ids = torch.full((len(items), width), -1, dtype=torch.long)
        asv_ids[batch_pos, asv_pos] = asv_idx
        counts = torch.zeros(len(items), width, 1)
        counts[batch_pos, asv_pos, 0] = torch.cat([item["counts"] for item in items])
        sample_idx = torch.tensor([item["sample_idx"] for item in items])
        batch = {
            "tokens": tokens,
            "counts": counts,
            "sample_idx": sample_idx,
            "asv_ids": asv_ids,
            # where the real ASVs lie and which are the same, found here so that the model need not read
            # them back from the GPU (aamperf.model.aam.SlotIndex); the slots ascend as the items' ASVs do
            **self.slot_index(batch_pos * width + asv_pos, asv_idx, len(items) * width),
            # counted here, on the host, so the trainer's samples/s and tokens/s need no device sync
            "n_samples": n_samples,
            "n_tokens": n_tokens,
        }
        if self.unifrac is not None:  # this rank's rows, every sample's column
            batch["unifrac"] = self.unifrac[sample_idx][:, batch_idx]
        if self.branch_lengths is not None:
            batch.update(branches=branches, branch_lengths=branch_lengths, branch_rows=rows)
        if "target" in items[0]:
            batch["target"] = torch.stack([item["target"] for item in items]).float().unsqueeze(1)
        if "categorical" in items[0]:  # this rank's rows, as the target's
            batch["categorical"] = torch.stack([item["categorical"] for item in items])
        return batch

    def slot_index(self, slots: torch.Tensor, asv_idx: torch.Tensor, n_slots: int) -> dict[str, Any]:
        """The batch's SlotIndex (`aamperf.model.aam.slot_index`); with buckets (`bucket_cap`), padded to
        bucket sizes too (`bucketed`), as the batch's width is: a few shapes on the device."""
        index = slot_index(slots, asv_idx)
        return index if self.bucket_cap is None else bucketed(index, n_slots)

    def width(self, lengths: torch.Tensor) -> int:
        """The ASV slots of a batch whose samples have `lengths` ASVs each: `pad_to`, or the longest (rounded
        up to `bucket_size` under `bucket_cap`)."""
        width = int(lengths.max()) if self.pad_to is None else self.pad_to
        if self.pad_to is None and self.bucket_cap is not None:
            width = min(bucket_size(width), self.bucket_cap)
        assert int(lengths.max()) <= width, "a sample has more ASVs than pad_to"
        return width


def split_indices(n_samples: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded random split of sample indices into (train, val), each sorted."""
    perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(n_samples * val_fraction)
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def split_listed(samples: Samples, val_ids: list[str], cfg: DictConfig) -> tuple[list[int], list[int]]:
    """(train, val) sample indices, each sorted: the samples data.val_samples lists validate, every other
    sample of the data trains. UserError naming the listed ids that are not among the data's samples."""
    position = {sid: i for i, sid in enumerate(samples.ids)}
    unknown = [sid for sid in val_ids if sid not in position]
    if unknown:
        shallow, why = len(set(unknown) & set(samples.too_shallow)), ""
        if shallow:
            why = f"; {shallow} of them were left out by rarefaction (data.rarefy_depth={cfg.rarefy_depth})"
        if samples.without_target and shallow < len(unknown):
            why += f"; {samples.without_target} samples without a data.target value were left out"
        raise UserError(
            f"data.val_samples: {len(unknown)} of the {len(val_ids)} ids in {cfg.val_samples} are not among "
            f"the {len(samples.ids)} samples of the data ({shown_ids(unknown)}){why}; list only samples of "
            "the data"
        )
    val_idx = sorted(position[sid] for sid in val_ids)
    listed = set(val_idx)
    return [i for i in range(len(samples.ids)) if i not in listed], val_idx


def make_loaders(
    dataset: SampleDataset,
    collate: Collate,
    train_idx: list[int],
    val_idx: list[int],
    *,
    batch_size: int,
    seed: int,
    loader: DictConfig,
    val_samples: str | None = None,
    val_batch_size: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Train loader (seeded shuffle) and val loader; both drop the last partial batch (UniFrac: pairs).
    `val_samples`: the data.val_samples file the split came from (None: data.val_fraction's), for the errors.
    `val_batch_size`: the val loader's batch (trainer.val_batch_size; None: `batch_size`).

    The shuffle has a generator of its own (`loader.sampler.generator`, one permutation per pass),
    apart from the DataLoader's, from which torch draws worker seeds at each new iterator: so the
    batch order of a seed is the same with or without workers, persistent or not."""
    fewer_val, more_val = " or data.val_fraction", "raise data.val_fraction"
    if val_samples is not None:  # the user's split: its file is the fix
        fewer_val = f", list fewer samples in data.val_samples={val_samples}"
        more_val = f"list more samples in data.val_samples={val_samples}"
    if len(train_idx) < batch_size:
        raise UserError(
            f"only {len(train_idx)} training samples, fewer than trainer.batch_size={batch_size}; "
            f"lower trainer.batch_size{fewer_val}, or give more samples"
        )
    if len(val_idx) < 2:
        raise UserError(f"only {len(val_idx)} validation samples (UniFrac needs >= 2 per batch); {more_val}")
    kwargs = {
        "collate_fn": collate,
        "drop_last": True,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
    }
    if loader.num_workers > 0:  # DataLoader refuses these without workers
        kwargs["persistent_workers"] = loader.persistent_workers
        if loader.prefetch_factor is not None:
            kwargs["prefetch_factor"] = loader.prefetch_factor
    train_set = Subset(dataset, train_idx)
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(seed))
    if getattr(dataset, "draws_anew", False):  # data.asv_sampling=random: each pass its own draw
        train_set, sampler = Draws(dataset, train_idx), DrawSampler(sampler)
    train = DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),  # worker seeds only
        **kwargs,
    )
    # a val set smaller than one batch is still used, as one batch of all of it (split evenly over ranks)
    world = collate.world_size
    val_batch = min(val_batch_size or batch_size, len(val_idx)) // world * world
    if val_batch < max(2, world):
        raise UserError(
            f"only {len(val_idx)} validation samples for {world} ranks (UniFrac needs >= 2 per batch); "
            + more_val
        )
    val = DataLoader(Subset(dataset, val_idx), batch_size=val_batch, shuffle=False, **kwargs)
    return train, val


class Draws(Subset):
    """The training samples where each pass draws their ASVs anew (data.asv_sampling=random): indexed by
    (draw, position) as `DrawSampler` yields them (any worker reads the same item for a key); by position
    alone, draw 0."""

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        draw, k = key if isinstance(key, tuple) else (0, key)
        return self.dataset.item(self.indices[k], draw)

    def __getitems__(self, keys: list) -> list[dict]:
        return [self[key] for key in keys]


class DrawSampler(Sampler):
    """A RandomSampler's positions, each with the pass's draw: a number taken from the sampler's own
    generator as the pass begins, so a resumed run (the generator's state at the pass's start: BatchStream)
    draws the same ASVs again."""

    def __init__(self, sampler: RandomSampler):
        self.sampler, self.generator = sampler, sampler.generator

    def __iter__(self) -> Iterator[tuple[int, int]]:
        draw = int(torch.randint(1 << 62, (), generator=self.generator))
        return ((draw, k) for k in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def step_loader(loader: DataLoader, micro_batches: int) -> DataLoader:
    """`loader` drawing the batches of whole optimizer steps: `micro_batches` x its batch, from the same
    sampler (the same order), so that a step's batch holds every pair of its samples (UniFrac across
    micro-batches, `split_batch` cuts them)."""
    kwargs = {}
    if loader.num_workers > 0:  # DataLoader refuses these without workers
        kwargs = {"persistent_workers": loader.persistent_workers, "prefetch_factor": loader.prefetch_factor}
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size * micro_batches,
        sampler=loader.sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        **kwargs,
    )


def split_batch(batch: dict, parts: int, world: int = 1) -> list[dict]:
    """A step's batch (this rank's rows of the global batch, as `Collate` makes it) -> `parts` micro-batches
    of its rows in order, each a batch as `Collate` makes one: its `unifrac` rows against the micro-batch's
    own samples on every rank, `n_samples` its global count (`n_tokens` is the step's: not split)."""
    rows = batch["tokens"].size(0)
    size = rows // parts
    assert size * parts == rows, f"a batch of {rows} rows does not split into {parts} micro-batches"
    micro = []
    for m in range(parts):
        mine = slice(m * size, (m + 1) * size)
        # the slot index is the step batch's (slots of its B x S): a micro-batch's model finds its own
        part = {
            k: v[mine] for k, v in batch.items() if torch.is_tensor(v) and k not in ("unifrac", *SLOT_KEYS)
        }
        if "unifrac" in batch:  # the global batch's columns are the ranks' rows in rank order
            starts = torch.arange(world, device=batch["unifrac"].device) * rows
            columns = (starts[:, None] + torch.arange(size, device=starts.device)).flatten()
            part["unifrac"] = batch["unifrac"][mine][:, columns + m * size]
        part["n_samples"] = batch["n_samples"] // parts
        micro.append(part)
    return micro


@dataclass
class Data:
    """What `build_data` hands the trainer."""

    train_loader: DataLoader
    val_loader: DataLoader
    n_train: int
    n_val: int
    n_asvs: int  # distinct ASVs kept (after rarefaction and the max_asvs cut)
    max_asvs: int  # most ASVs of a sample; the `S` of every batch unless padded to the longest sample
    has_target: bool
    target_mean: float | None  # of the training samples' raw target (a regression's; None for classes)
    target_std: float | None
    target: TargetSpec | None  # what the loss learns: kind, transform or classes (of the training samples)
    # data.categorical's record (aamperf/data/categorical.py: columns, the training samples' vocabularies,
    # missing and unseen counts), or None without conditioning
    categorical: dict | None
    samples_without_target: int  # of data.table, left out: no value of data.target in data.metadata
    unifrac_mode: str  # batch (from branch sets, per batch) or precomputed (the n x n matrix)
    unifrac_cached: bool  # precomputed from data.tree: the matrix came from `<cache_dir>/unifrac/`
    samples_cached: bool  # the rarefied samples came from their store (`<cache_dir>/samples/`)
    # what reading the data left out or changed, each warned in train.log (summary.json's keys):
    # samples_too_shallow (fewer reads than data.rarefy_depth: left out), sequences_cut (ASVs longer than
    # the model's 150 bases, cut), longest_sequence_bp, tree_lengths_missing (branches read as 0)
    counts: dict[str, int]
    files: dict[str, str | None]  # table / tree / unifrac / metadata / sequences actually read
    sample_ids: list[str]  # index = the batch's `sample_idx`
    dataset: SampleDataset
    collate: Collate
    val_samples: str | None = None  # data.val_samples: the file that lists the validation samples, or None
    val_batch_size: int | None = None  # trainer.val_batch_size: the val loader's batch (None: the training's)


def rebatch(data: Data, batch_size: int, seed: int, loader: DictConfig) -> None:
    """New loaders over the same split for another (global micro-)batch size: the batch-size finder's."""
    data.train_loader, data.val_loader = make_loaders(
        data.dataset,
        data.collate,
        list(data.train_loader.dataset.indices),
        list(data.val_loader.dataset.indices),
        batch_size=batch_size,
        seed=seed,
        loader=loader,
        val_samples=data.val_samples,
        val_batch_size=data.val_batch_size,
    )


def write_split(run_dir: Path, data: Data) -> None:
    """train_samples.txt and val_samples.txt in `run_dir`: the split's sample ids, one per line, as the
    original AAM writes its val_samples.txt (data.val_samples=<run dir>/val_samples.txt reads it back)."""
    for name, split in (("train", data.train_loader), ("val", data.val_loader)):
        ids = [data.sample_ids[i] for i in split.dataset.indices]
        write_atomic(run_dir / f"{name}_samples.txt", "".join(f"{sid}\n" for sid in ids))


def build_data(
    cfg: DictConfig,
    *,
    batch_size: int,
    seed: int,
    loader: DictConfig,
    pad_to: int | None | Literal["max", "bucket"] = "max",
    rank: int = 0,
    world_size: int = 1,
    val_batch_size: int | None = None,
) -> Data:
    """data config -> loaders: read (or simulate), rarefy, UniFrac (cached), tokenize, split.

    `cfg` is the `data` node, `loader` the `dataloader` node. `data.seed` drives rarefaction and the
    split (the same data for every run of a sweep), unless data.val_samples lists the validation samples;
    `seed`, the run's, drives the batch order.
    `batch_size` is the global batch of one forward pass; `rank` of `world_size` encodes its slice;
    `val_batch_size` the validation's (None: `batch_size`).
    `pad_to`: the `S` of a batch: "max" pads every batch to data.max_asvs (fixed shapes, as the original
    AAM), None each batch to its longest sample (`aamperf.phases.aam_ops.collate_pad_to`), "bucket" to
    its longest sample rounded up to `bucket_size` (at most data.max_asvs), an int to that many ASVs
    (>= data.max_asvs).
    """
    if batch_size < 2:
        raise UserError("trainer.batch_size must be >= 2 (UniFrac compares pairs of samples)")
    bucket_cap = cfg.max_asvs if pad_to == "bucket" else None
    if pad_to == "max":
        pad_to = cfg.max_asvs
    elif pad_to == "bucket":
        pad_to = None
    elif pad_to is not None and not (isinstance(pad_to, int) and pad_to >= cfg.max_asvs):
        raise ValueError(
            f"pad_to must be 'max', 'bucket', None or an int >= data.max_asvs={cfg.max_asvs} (got {pad_to!r})"
        )
    files = resolve_files(cfg)
    columns = list(cfg.get("categorical") or [])  # data.categorical
    check_columns(columns, files["metadata"], cfg.target)  # before the samples are read
    normalize_by = list(cfg.get("normalize_by") or [])  # zscore_category's (data.target_transform)
    check_columns(normalize_by, files["metadata"], cfg.target, "data.normalize_by")
    weight_by = list(cfg.get("weight_by") or [])  # loss.category_weights'
    check_columns(weight_by, files["metadata"], cfg.target, "data.weight_by")
    mode = unifrac_mode(cfg, files)
    samples, samples_cached = sample_store(cfg, files, with_branches=mode == "batch")
    sample_ids, dataset, target = samples.ids, samples.dataset, samples.dataset.target
    unifrac, cached = None, False
    if files["unifrac"] is not None:
        unifrac = select_unifrac(*read_unifrac(files["unifrac"]), sample_ids)
    elif mode == "precomputed":
        cache_dir = Path(cfg.cache_dir).expanduser()
        unifrac, cached, samples.missing_lengths = cached_unifrac(
            rarefied_table(samples), files["tree"], cache_dir, str(cfg.unifrac_metric)
        )
    unifrac = None if unifrac is None else torch.from_numpy(unifrac).float()

    val_samples = cfg.get("val_samples")
    if val_samples is None:
        train_idx, val_idx = split_indices(len(sample_ids), cfg.val_fraction, cfg.seed)
    else:  # the same file, the same split on every rank
        train_idx, val_idx = split_listed(samples, read_val_samples(val_samples), cfg)
        log.info(
            "validation: the %d samples of data.val_samples=%s (data.val_fraction not used); training: the "
            "other %d", len(val_idx), val_samples, len(train_idx),
        )  # fmt: skip
    collate = Collate(samples.tokens, unifrac, pad_to, rank, world_size, bucket_cap, samples.branch_lengths)
    train_loader, val_loader = make_loaders(
        dataset, collate, train_idx, val_idx, batch_size=batch_size, seed=seed, loader=loader,
        val_samples=val_samples, val_batch_size=val_batch_size,
    )  # fmt: skip
    spec = None if target is None else fit_target(cfg, files["metadata"], dataset, train_idx, val_idx)
    if spec is not None and spec.transform == "zscore_category":  # each category's units, and each sample's
        values = read_values(files["metadata"], normalize_by, sample_ids)
        fit_groups(spec, normalize_by, dataset.target, group_keys(values), torch.as_tensor(train_idx))
    if spec is not None and weight_by:  # each sample's category, and the training samples of each
        values = read_values(files["metadata"], weight_by, sample_ids)
        fit_weight_keys(spec, weight_by, values, torch.as_tensor(train_idx))
    target = dataset.target  # a classification's: class indices among the training samples' classes
    categorical = None
    if columns:  # the vocabularies of the training samples, the same split as the target's
        dataset.categorical, categorical = learn_categories(
            columns, files["metadata"], sample_ids, train_idx, val_idx
        )
    train_target = None if spec is None or spec.is_classification else target[train_idx]
    return Data(
        train_loader=train_loader,
        val_loader=val_loader,
        n_train=len(train_idx),
        n_val=len(val_idx),
        n_asvs=samples.n_asvs,
        max_asvs=cfg.max_asvs,
        has_target=target is not None,
        target_mean=None if train_target is None else float(train_target.mean()),
        target_std=None if train_target is None else float(train_target.std()),
        target=spec,
        categorical=categorical,
        samples_without_target=samples.without_target,
        unifrac_mode=mode,
        unifrac_cached=cached,
        samples_cached=samples_cached,
        counts={
            "samples_too_shallow": len(samples.too_shallow),
            "sequences_cut": samples.sequences_cut,
            "longest_sequence_bp": samples.longest_sequence_bp,
            "tree_lengths_missing": samples.missing_lengths,
        },
        files={k: None if v is None else str(v) for k, v in files.items()},
        sample_ids=sample_ids,
        dataset=dataset,
        collate=collate,
        val_samples=val_samples,
        val_batch_size=val_batch_size,
    )


def fit_target(cfg: DictConfig, metadata: Path, dataset: SampleDataset, train_idx, val_idx) -> TargetSpec:
    """data.target as the model learns it, fitted on the training samples: a regression's transform, or a
    classification's classes (the dataset's class indices made indices among them)."""
    _, kind, names = read_target_column(metadata, cfg.target, cfg.target_type)
    train, val = torch.as_tensor(train_idx), torch.as_tensor(val_idx)
    if kind == "regression":
        return fit_regression(cfg.target, dataset.target, train, str(cfg.target_transform))
    spec, dataset.target = fit_classes(cfg.target, dataset.target, names, train, val)
    return spec


def unifrac_mode(cfg: DictConfig, files: dict) -> str:
    """data.unifrac_mode, or what the files given imply: batch from a tree (precomputed for a weighted
    metric), precomputed from a matrix (`batch` without a tree was refused up front: tables.check_data)."""
    if cfg.unifrac_mode is None:
        batch = files["tree"] is not None and cfg.unifrac_metric == "unweighted"
        return "batch" if batch else "precomputed"
    return str(cfg.unifrac_mode)


def rarefied_table(samples: Samples) -> biom.Table:
    """The rarefied samples as a biom.Table (every ASV, not only max_asvs): scikit-bio's input."""
    rows, reads = samples.dataset.rows, samples.dataset.reads
    counts = sp.csc_matrix(
        (reads.all(), rows.all(), rows.ptr),
        shape=(len(samples.tokens), len(samples.ids)),
    )
    obs_ids = table_ids(samples.files["table"], "observation")
    return biom.Table(counts, observation_ids=obs_ids, sample_ids=samples.ids)
