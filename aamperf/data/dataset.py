"""Samples as unpadded ASV lists, the split and the data a run trains with (the collate that pads them and
slices UniFrac: collate.py; the loaders: loaders.py)."""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import biom
import scipy.sparse as sp
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from aamperf.data.categorical import check_columns, learn_categories, read_values
from aamperf.data.collate import Collate
from aamperf.data.loaders import make_loaders
from aamperf.data.metadata import read_target_column
from aamperf.data.samples import SampleDataset, Samples
from aamperf.data.store import sample_store
from aamperf.data.tables import read_unifrac, read_val_samples, resolve_files, shown_ids, table_ids
from aamperf.data.unifrac import cached_unifrac, select_unifrac
from aamperf.errors import UserError
from aamperf.files import write_atomic
from aamperf.targets import (
    TargetSpec,
    fit_classes,
    fit_groups,
    fit_regression,
    fit_weight_keys,
    group_keys,
)

log = logging.getLogger(__name__)


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
    if cfg.get("normalize_by"):  # zscore_category's columns (data/checks.py: only with it)
        raise UserError(
            f"data.target_transform=zscore_category z-scores a regression; {cfg.target!r} is a "
            "classification (its classes): set data.target_transform=zscore and data.normalize_by=[]"
        )
    spec, dataset.target = fit_classes(cfg.target, dataset.target, names, train, val)
    return spec


def unifrac_mode(cfg: DictConfig, files: dict) -> str:
    """data.unifrac_mode, or what the files given imply: batch from a tree (precomputed for a weighted
    metric), precomputed from a matrix (`batch` without a tree was refused up front: checks.check_data)."""
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
