"""A table's samples as the model reads them: rarefied, cut to their most abundant ASVs, every distinct
ASV tokenized once; each sample an unpadded list of ASV rows with counts (and its target)."""

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from aamperf.data.tables import observation_sequences, rarefy, read_table, read_target, resolve_files
from aamperf.data.tokenize import count_real_tokens, tokenize_sequences
from aamperf.errors import UserError

log = logging.getLogger(__name__)


class SampleDataset(Dataset):
    """One item per sample: indices into the ASV token table, their counts, and the sample's index.

    Items are not padded: `Collate(pad_to=...)` decides the padded length, so a padding-aware
    batching phase can change it without touching the data.
    """

    def __init__(
        self,
        asv_idx: list[torch.Tensor],
        counts: list[torch.Tensor],
        n_tokens: list[int],
        target: torch.Tensor | None = None,
    ) -> None:
        assert len(asv_idx) == len(counts) == len(n_tokens)
        self.asv_idx, self.counts, self.n_tokens, self.target = asv_idx, counts, n_tokens, target

    def __len__(self) -> int:
        return len(self.asv_idx)

    def __getitem__(self, i: int) -> dict:
        item = {
            "asv_idx": self.asv_idx[i],
            "counts": self.counts[i],
            "sample_idx": i,
            "n_tokens": self.n_tokens[i],
        }
        if self.target is not None:
            item["target"] = self.target[i]
        return item


def top_asvs(
    column_rows: np.ndarray, column_counts: np.ndarray, max_asvs: int
) -> tuple[np.ndarray, np.ndarray]:
    """The `max_asvs` most abundant ASVs of one sample, most abundant first; ties go to the lower row."""
    order = np.lexsort((column_rows, -column_counts))[:max_asvs]
    return column_rows[order], column_counts[order]


@dataclass
class Samples:
    ids: list[str]  # index = a batch's `sample_idx`
    dataset: SampleDataset
    tokens: torch.Tensor  # [distinct ASVs, 151] uint8
    table: Any  # the rarefied biom.Table (UniFrac is computed from it)
    files: dict[str, Any]  # table / tree / unifrac / metadata / sequences as resolved
    without_target: int  # samples of the table left out for want of a target value (training only)
    too_shallow: list[str]  # samples with fewer reads than data.rarefy_depth: left out


def read_samples(
    cfg: DictConfig, keep_unlabelled: bool = False, sample_ids: list[str] | None = None
) -> Samples:
    """The `data` config's samples (`sample_ids`: only these). With `data.target`, samples without a
    value are left out of training (`keep_unlabelled`: kept, their target NaN: prediction)."""
    files = resolve_files(cfg)
    table = read_table(files["table"], sample_ids)
    targets, without_target = None, 0
    if cfg.target is not None:
        targets = read_target(files["metadata"], cfg.target)
        keep = [sid for sid in table.ids() if sid in targets]
        if not keep and not keep_unlabelled:
            raise UserError(f"data.metadata: no sample of data.table has a value of {cfg.target!r}")
        without_target = len(table.ids()) - len(keep)
        if without_target and not keep_unlabelled:
            log.warning(
                "%d of %d samples have no %r in data.metadata (%s): left out of training and validation",
                without_target,
                len(table.ids()),
                cfg.target,
                files["metadata"],
            )
            table = table.filter(keep, inplace=False)
    sequences = observation_sequences(list(table.ids(axis="observation")), files["sequences"])
    sequence_of = dict(zip(table.ids(axis="observation"), sequences, strict=True))
    before = [str(sid) for sid in table.ids()]
    table = rarefy(table, cfg.rarefy_depth, cfg.seed)
    sample_ids = [str(sid) for sid in table.ids()]
    kept_ids = set(sample_ids)
    too_shallow = [sid for sid in before if sid not in kept_ids]

    # keep the most abundant max_asvs ASVs of each sample, then number the ASVs still in use
    matrix = table.matrix_data.tocsc(copy=True)
    matrix.eliminate_zeros()  # subsampling leaves explicit zeros: they are not ASVs of the sample
    kept = [
        top_asvs(matrix.indices[a:b], matrix.data[a:b], cfg.max_asvs)
        for a, b in zip(matrix.indptr[:-1], matrix.indptr[1:], strict=True)
    ]
    used = np.unique(np.concatenate([rows for rows, _ in kept]))
    new_index = np.full(matrix.shape[0], -1)
    new_index[used] = np.arange(len(used))
    obs_ids = table.ids(axis="observation")
    tokens = tokenize_sequences([sequence_of[obs_ids[row]] for row in used])  # validated when read
    real_per_asv = count_real_tokens(tokens)
    asv_idx = [torch.from_numpy(new_index[rows]) for rows, _ in kept]
    counts = [torch.from_numpy(vals.astype(np.float32)) for _, vals in kept]
    n_tokens = [int(real_per_asv[idx].sum()) for idx in asv_idx]
    target = None if targets is None else torch.tensor([targets.get(sid, float("nan")) for sid in sample_ids])
    dataset = SampleDataset(asv_idx, counts, n_tokens, target)
    return Samples(sample_ids, dataset, tokens, table, files, without_target, too_shallow)
