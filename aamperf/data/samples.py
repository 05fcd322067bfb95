"""A table's samples as the model reads them: rarefied (each sample on its own), cut to its most abundant
ASVs, each an unpadded list of rows of the token table (every observation tokenized once) with counts,
its target and, with a tree, its branch set (batch UniFrac). Held in memory or read from a store file."""

import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from aamperf.data.branches import Branches
from aamperf.data.metadata import read_target
from aamperf.data.tables import observation_sequences, read_table, resolve_files
from aamperf.data.tokenize import count_real_tokens, tokenize_sequences
from aamperf.errors import UserError
from aamperf.tokens import ASV_BP, TOKENS_PER_ASV

log = logging.getLogger(__name__)


def rarefy_sample(counts: np.ndarray, depth: int, seed: int, sample_id: str) -> np.ndarray | None:
    """`depth` reads drawn without replacement from one sample's counts (its non-zero counts, in
    observation order: the draw depends on them only); None when it has fewer.

    Each sample has its own generator, seeded by (data.seed, its id): its draw is the same whatever
    else is in the table, so a table read a chunk at a time (streamed, predict) is rarefied as a whole."""
    if counts.sum() < depth:
        return None
    rng = np.random.default_rng([seed, zlib.crc32(sample_id.encode())])
    return rng.multivariate_hypergeometric(counts.astype(np.int64), depth)


def top_asvs(
    column_rows: np.ndarray, column_counts: np.ndarray, max_asvs: int
) -> tuple[np.ndarray, np.ndarray]:
    """The `max_asvs` most abundant ASVs of one sample, most abundant first; ties go to the lower row."""
    order = np.lexsort((column_rows, -column_counts))[:max_asvs]
    return column_rows[order], column_counts[order]


def sample_asvs(
    rows: np.ndarray, counts: np.ndarray, max_asvs: int, how: str, key: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """The ASVs of one sample (its observation rows, ascending, and their counts) the model reads, by
    data.asv_sampling: `abundance` its `max_asvs` most abundant; `first` its first `max_asvs` in the table's
    order (the original AAM's default); `random` `max_asvs` of them drawn without replacement by a generator
    of `key` (data.seed, the sample's id, the draw: the same draw in every process). Each way most abundant
    first, so that a slot's position means what it means under `abundance`."""
    if how == "first":
        rows, counts = rows[:max_asvs], counts[:max_asvs]
    elif how == "random" and len(rows) > max_asvs:
        kept = np.sort(np.random.default_rng(key).choice(len(rows), max_asvs, replace=False))
        rows, counts = rows[kept], counts[kept]
    return top_asvs(rows, counts, max_asvs)


class Ragged:
    """Rows of different lengths: row i is values[ptr[i]:ptr[i + 1]]. The values are an array in memory,
    or a raw int32 file read one row at a time (a positioned read: no file position shared after a fork)."""

    def __init__(self, ptr: np.ndarray, values: np.ndarray | None = None, file: str | None = None):
        self.ptr, self.values, self.file = ptr, values, file
        self._fd: tuple[int, int] | None = None  # (pid, descriptor)

    @classmethod
    def of(cls, rows: list[np.ndarray], dtype: Any) -> "Ragged":
        ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=ptr[1:])
        return cls(ptr, np.concatenate(rows).astype(dtype) if rows else np.zeros(0, dtype))

    def __len__(self) -> int:
        return len(self.ptr) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        a, b = int(self.ptr[i]), int(self.ptr[i + 1])
        if self.values is not None:
            return self.values[a:b]
        return np.frombuffer(os.pread(self._descriptor(), 4 * (b - a), 4 * a), dtype=np.int32)

    def all(self) -> np.ndarray:
        """Every row's values, in order."""
        return self.values if self.values is not None else np.fromfile(self.file, dtype=np.int32)

    def _descriptor(self) -> int:
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = (os.getpid(), os.open(self.file, os.O_RDONLY))
        return self._fd[1]

    def __getstate__(self) -> dict:  # to spawned workers: the path, not the descriptor
        return {**self.__dict__, "_fd": None}


class SampleDataset(Dataset):
    """One item per sample: its `max_asvs` most abundant ASVs (rows of the token table) and their counts,
    its real-token count, target and branch set. Items are not padded: `Collate(pad_to=...)` decides."""

    def __init__(
        self,
        rarefied: tuple[Ragged, Ragged],  # (observation rows, counts) of each rarefied sample
        max_asvs: int,
        n_tokens: np.ndarray,
        target: torch.Tensor | None = None,
        branches: Ragged | None = None,
    ) -> None:
        assert len(rarefied[0]) == len(rarefied[1]) == len(n_tokens)
        self.rows, self.reads = rarefied
        self.max_asvs, self.n_tokens, self.target, self.branches = max_asvs, n_tokens, target, branches
        # [n_samples, columns] long: each sample's categories (data.categorical), set once the training
        # samples' vocabularies are known (aamperf/data/categorical.py); None without conditioning
        self.categorical: torch.Tensor | None = None
        # data.asv_sampling other than `abundance` (`sample_by`): how, the draws' key of each sample, and each
        # observation's real tokens (a sample's n_tokens then follows its draw)
        self.asv_sampling, self.keys, self.real_tokens = "abundance", None, None

    def sample_by(self, how: str, seed: int, ids: list[str], real_tokens: np.ndarray) -> None:
        """Keep each sample's ASVs by data.asv_sampling `how` (`sample_asvs`): the samples' `ids` and
        data.seed key the random draws; `real_tokens` [observations]: each ASV's real nucleotides."""
        self.asv_sampling, self.real_tokens = how, real_tokens
        self.keys = [(seed, zlib.crc32(sid.encode())) for sid in ids]

    @property
    def draws_anew(self) -> bool:
        """Does a sample's item change from one pass to the next (`item`'s `draw`)?"""
        return self.asv_sampling == "random"

    def __len__(self) -> int:
        return len(self.n_tokens)

    def __getitem__(self, i: int) -> dict:
        return self.item(i)

    def item(self, i: int, draw: int = 0) -> dict:
        """Sample i as the model reads it; under data.asv_sampling=random its ASVs of draw `draw` (0: the
        draw validation and predict read)."""
        if self.asv_sampling == "abundance":
            rows, counts = top_asvs(self.rows[i], self.reads[i], self.max_asvs)
            n_tokens = int(self.n_tokens[i])
        else:
            key = (*self.keys[i], draw)
            rows, counts = sample_asvs(self.rows[i], self.reads[i], self.max_asvs, self.asv_sampling, key)
            n_tokens = int(self.real_tokens[rows].sum())
        item = {
            "asv_idx": torch.from_numpy(rows.astype(np.int64)),
            "counts": torch.from_numpy(counts.astype(np.float32)),
            "sample_idx": i,
            "n_tokens": n_tokens,
        }
        if self.target is not None:
            item["target"] = self.target[i]
        if self.branches is not None:
            item["branches"] = self.branches[i]
        if self.categorical is not None:
            item["categorical"] = self.categorical[i]
        return item


@dataclass
class Chunk:
    """Some samples of a table, rarefied: what a store keeps of them, or what predict reads."""

    ids: list[str]
    rows: list[np.ndarray]  # each sample's observations after rarefaction (all, not only max_asvs)
    reads: list[np.ndarray]  # their counts
    n_tokens: np.ndarray  # real nucleotides in the sample's max_asvs most abundant ASVs
    too_shallow: list[str] = field(default_factory=list)  # fewer reads than data.rarefy_depth: left out
    kept_asvs: np.ndarray | None = None  # the distinct observations among the samples' max_asvs most abundant
    branches: list[np.ndarray] | None = None  # each sample's branch set


def rarefy_chunk(
    ids: list[str],
    counts: sp.csc_matrix,
    cfg: DictConfig,
    real_tokens: np.ndarray,
    branches: Branches | None = None,
) -> Chunk:
    """Rarefy each sample of `counts` [observations, samples] to data.rarefy_depth (seeded by data.seed)."""
    chunk = Chunk([], [], [], np.zeros(0, dtype=np.int64))
    counts = counts.copy()
    counts.eliminate_zeros()  # the draw sees the sample's ASVs in observation order, whatever the file
    counts.sort_indices()
    top = []  # each sample's max_asvs most abundant observations
    for j, sid in enumerate(ids):
        a, b = counts.indptr[j], counts.indptr[j + 1]
        drawn = rarefy_sample(counts.data[a:b], cfg.rarefy_depth, cfg.seed, sid)
        if drawn is None:
            chunk.too_shallow.append(sid)
            continue
        present = drawn > 0
        rows, reads = counts.indices[a:b][present].astype(np.int32), drawn[present].astype(np.int32)
        chunk.ids.append(sid)
        chunk.rows.append(rows)
        chunk.reads.append(reads)
        top.append(top_asvs(rows, reads, cfg.max_asvs)[0])
    chunk.n_tokens = np.array([int(real_tokens[rows].sum()) for rows in top], dtype=np.int64)
    chunk.kept_asvs = np.unique(np.concatenate(top)) if top else np.zeros(0, dtype=np.int32)
    if branches is not None:
        presence = sp.csc_matrix(
            (
                np.ones(sum(len(r) for r in chunk.rows), np.float32),
                np.concatenate(chunk.rows or [[]]),
                np.cumsum([0] + [len(r) for r in chunk.rows]),
            ),
            shape=(counts.shape[0], len(chunk.ids)),
        )
        sets = branches.of_samples(presence)
        chunk.branches = [sets.indices[sets.indptr[i] : sets.indptr[i + 1]] for i in range(len(chunk.ids))]
    return chunk


def no_sample_deep_enough(cfg: DictConfig, deepest: int) -> UserError:
    return UserError(
        f"data.rarefy_depth={cfg.rarefy_depth}: no sample has that many reads (deepest: {deepest}); "
        "lower data.rarefy_depth"
    )


def table_tokens(obs_ids: list[str], sequences_path) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Every observation of the table tokenized once [n_obs, 151] uint8, its real-nucleotide count, and
    each sequence's length in bases (those longer than `ASV_BP` are cut to it)."""
    sequences = observation_sequences(obs_ids, sequences_path)
    tokens = tokenize_sequences(sequences)  # validated when read
    lengths = np.array([len(seq) for seq in sequences], dtype=np.int64)
    return tokens, count_real_tokens(tokens).numpy(), lengths


def count_range(reads: Ragged, samples: list[int]) -> tuple[int, int]:
    """(least, greatest) count among these samples' rarefied ASVs (every one, not only max_asvs): the
    scale of AAM's count head, as the original AAM's min-max of its training table's non-zero counts."""
    counts = [c for c in (reads[i] for i in samples) if len(c)]
    if not counts:
        return 0, 1
    return int(min(c.min() for c in counts)), int(max(c.max() for c in counts))


@dataclass
class Samples:
    ids: list[str]  # index = a batch's `sample_idx`
    dataset: SampleDataset
    tokens: torch.Tensor  # [observations of the table, 151] uint8
    files: dict[str, Any]  # table / tree / unifrac / metadata / sequences as resolved
    without_target: int  # samples of the table left out for want of a target value (training only)
    too_shallow: list[str]  # samples with fewer reads than data.rarefy_depth: left out
    n_asvs: int  # distinct ASVs a run may read: among the ones data.asv_sampling keeps (`keep_asvs_by`)
    branch_lengths: np.ndarray | None = None  # of the branches the samples' branch sets index (batch UniFrac)
    sequences_cut: int = 0  # observations of the table longer than ASV_BP bases: cut to their first ASV_BP
    longest_sequence_bp: int = 0  # of the table's observations
    missing_lengths: int = 0  # branches of data.tree without a length, read as 0 (batch UniFrac)


def read_samples(
    cfg: DictConfig, keep_unlabelled: bool = False, sample_ids: list[str] | None = None
) -> Samples:
    """The `data` config's samples (`sample_ids`: only these), in memory: what predict reads a chunk at a
    time. With `data.target`, samples without a value are left out (`keep_unlabelled`: kept, target NaN)."""
    files = resolve_files(cfg)
    table = read_table(files["table"], sample_ids)
    targets, without_target = None, 0
    if cfg.target is not None:
        targets = read_target(files["metadata"], cfg.target, cfg.get("target_type", "auto"))
        keep = [sid for sid in table.ids() if sid in targets]
        if not keep and not keep_unlabelled:
            raise UserError(f"data.metadata: no sample of data.table has a value of {cfg.target!r}")
        without_target = len(table.ids()) - len(keep)
        if without_target and not keep_unlabelled:
            warn_without_target(without_target, len(table.ids()), cfg.target, files["metadata"])
            table = table.filter(keep, inplace=False)
    tokens, real_tokens, lengths = table_tokens(
        [str(obs) for obs in table.ids(axis="observation")], files["sequences"]
    )
    ids = [str(sid) for sid in table.ids()]
    chunk = rarefy_chunk(ids, table.matrix_data.tocsc().astype(np.int64), cfg, real_tokens)
    if not chunk.ids:
        raise no_sample_deep_enough(cfg, int(table.sum(axis="sample").max()))
    target = None if targets is None else torch.tensor([targets.get(sid, float("nan")) for sid in chunk.ids])
    rarefied = (Ragged.of(chunk.rows, np.int32), Ragged.of(chunk.reads, np.int32))
    dataset = SampleDataset(rarefied, cfg.max_asvs, chunk.n_tokens, target)
    kept, cut = len(chunk.kept_asvs), int((lengths > ASV_BP).sum())
    samples = Samples(chunk.ids, dataset, tokens, files, without_target, chunk.too_shallow, kept)
    samples.sequences_cut, samples.longest_sequence_bp = cut, int(lengths.max())
    keep_asvs_by(samples, cfg)
    return samples


def keep_asvs_by(samples: Samples, cfg: DictConfig) -> None:
    """The samples' ASVs kept by data.asv_sampling (`sample_asvs`; `abundance`, the store's, changes
    nothing); `n_asvs` then counts the distinct ASVs a run may read: the first ones, or under `random` every
    ASV of the samples."""
    how = str(cfg.get("asv_sampling", "abundance"))
    if how == "abundance":
        return
    dataset = samples.dataset
    dataset.sample_by(how, cfg.seed, samples.ids, count_real_tokens(samples.tokens).numpy())
    if how == "random":
        samples.n_asvs = len(np.unique(dataset.rows.all()))
        return
    items = [dataset.item(i) for i in range(len(dataset))]  # `first`: the same ASVs every time
    dataset.n_tokens = np.array([item["n_tokens"] for item in items], dtype=np.int64)
    samples.n_asvs = len(np.unique(np.concatenate([item["asv_idx"].numpy() for item in items])))


def warn_too_shallow(too_shallow: list[str], total: int, depth: int) -> None:
    if too_shallow:
        log.warning(
            "%d of %d samples have fewer reads than data.rarefy_depth=%d: left out of training and "
            "validation (%s%s); lower data.rarefy_depth to keep them",
            len(too_shallow),
            total,
            depth,
            ", ".join(too_shallow[:5]),
            ", ..." if len(too_shallow) > 5 else "",
        )


def warn_sequences_cut(n: int, total: int, longest_bp: int) -> None:
    if n:
        log.warning(
            "%d of %d ASV sequences of data.table are longer than the model reads (longest: %d bases): "
            "cut to their first %d (model.seq_len=%d is START and %d bases, the length of aamperf's tokens)",
            n,
            total,
            longest_bp,
            ASV_BP,
            TOKENS_PER_ASV,
            ASV_BP,
        )


def warn_without_target(n: int, total: int, column: str, metadata) -> None:
    log.warning(
        "%d of %d samples have no %r in data.metadata (%s): left out of training and validation",
        n,
        total,
        column,
        metadata,
    )
