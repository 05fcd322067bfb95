"""Categorical conditioning (`data.categorical`): metadata columns read as strings, each column's vocabulary
from the training samples (sorted), every sample's category as its index in it, 0 reserved for a category
unseen in training or a missing value. The vocabularies go with the model (model.pt's `categorical`,
summary.json's), so predict maps a new table's categories as training did (aamperf/predict/)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import DictConfig
from torch import Tensor

from aamperf.data.metadata import metadata_column
from aamperf.errors import UserError

UNSEEN = 0  # the slot of a category the training samples lack, or of a missing value


@dataclass
class Encoded:
    """A table's categories as the model reads them: indices [n_samples, columns] long, and per column how
    many samples fell in slot 0 because their value is missing or unseen in training."""

    indices: Tensor
    missing: dict[str, int]
    unseen: dict[str, int]


def check_columns(
    columns: list[str], metadata: Path | None, target: str | None, key: str = "data.categorical"
) -> None:
    """The refusals of metadata columns named by `key` (data.categorical, data.normalize_by), each one
    line: without metadata, a column that is the target, a column the metadata lacks (naming the columns
    it has)."""
    if not columns:
        return
    if metadata is None:
        raise UserError(
            f"{key}={list(columns)} reads metadata columns: give data.metadata=<samples.tsv>, or {key}=[]"
        )
    if target is not None and target in columns:
        raise UserError(
            f"data.categorical: {target!r} is data.target itself (conditioning on the answer); drop it from "
            "data.categorical"
        )
    header = metadata_header(metadata)
    absent = [column for column in columns if column not in header]
    if absent:
        raise UserError(
            f"{key}: no column {', '.join(map(repr, absent))} in {metadata} "
            f"(columns: {', '.join(header) or 'none'}); name columns it has in {key}"
        )


def metadata_header(path: Path) -> list[str]:
    """The metadata TSV's columns, the sample id's left out."""
    return [str(c) for c in pd.read_csv(path, sep="\t", index_col=0, dtype=str, nrows=0).columns]


def read_values(metadata: Path, columns: list[str], sample_ids: list[str]) -> dict[str, list[str | None]]:
    """Each column's value of each sample (in `sample_ids`' order) as the metadata writes it, stripped;
    None where it is missing (empty, NA, 'not collected', ...) or the sample has no row."""
    values = {}
    for column in columns:
        written = metadata_column(metadata, column).reindex(sample_ids)
        values[column] = [None if pd.isna(v) else str(v).strip() for v in written]
    return values


def fit_vocabularies(values: dict[str, list[str | None]], train_idx: list[int]) -> dict[str, list[str]]:
    """Each column's categories among the training samples, sorted: index i + 1 is category i."""
    return {
        column: sorted({column_values[i] for i in train_idx} - {None})
        for column, column_values in values.items()
    }


def encode(values: dict[str, list[str | None]], vocabularies: dict[str, list[str]]) -> Encoded:
    """Every sample's index in each column's vocabulary (+1: slot 0 is `UNSEEN`), counting per column the
    values missing and those the vocabulary lacks."""
    columns, missing, unseen = [], {}, {}
    for column, vocabulary in vocabularies.items():
        index = {category: i + 1 for i, category in enumerate(vocabulary)}
        column_values = values[column]
        columns.append([index.get(v, UNSEEN) if v is not None else UNSEEN for v in column_values])
        missing[column] = sum(v is None for v in column_values)
        unseen[column] = sum(v is not None and v not in index for v in column_values)
    # [columns, samples] -> [samples, columns]
    return Encoded(torch.tensor(columns, dtype=torch.long).T.contiguous(), missing, unseen)


def learn_categories(
    columns: list[str], metadata: Path, sample_ids: list[str], train_idx: list[int], val_idx: list[int]
) -> tuple[Tensor, dict[str, Any]]:
    """data.categorical: (every sample's indices [n_samples, columns], the record summary.json and model.pt
    keep: columns, vocabularies of the training samples, and the training and validation samples missing a
    value or (validation) holding a category no training sample has)."""
    values = read_values(metadata, columns, sample_ids)
    vocabularies = fit_vocabularies(values, train_idx)
    train = encode({c: [v[i] for i in train_idx] for c, v in values.items()}, vocabularies)
    val = encode({c: [v[i] for i in val_idx] for c, v in values.items()}, vocabularies)
    record = {
        "columns": list(columns),
        "vocabularies": vocabularies,
        "train_missing": train.missing,
        "val_missing": val.missing,
        "val_unseen": val.unseen,
    }
    return encode(values, vocabularies).indices, record


def saved_vocabularies(saved: Any, path: Path) -> dict[str, list[str]] | None:
    """The vocabularies a model file's `categorical` record holds (None: the model is not conditioned),
    checked as data: a column name -> a list of strings."""
    if saved is None:
        return None
    vocabularies = saved.get("vocabularies") if isinstance(saved, dict) else None
    if not isinstance(vocabularies, dict) or not all(
        isinstance(column, str) and isinstance(v, list) and all(isinstance(c, str) for c in v)
        for column, v in vocabularies.items()
    ):
        raise UserError(
            f"{path}: its categorical record holds no vocabularies by column; train the run again"
        )
    return vocabularies


def condition_model(cfg: DictConfig, categorical: dict[str, Any] | None, summary: dict[str, Any]) -> None:
    """Size the model's categorical tables to the data's vocabularies (`model.categorical_sizes`, before the
    model is built from it, as the target head follows the target) and say the conditioning in
    summary.json's `categorical`. A model that takes no categorical_sizes cannot be conditioned: refused."""
    if categorical is None:
        return
    if "categorical_sizes" not in cfg.model:
        raise UserError(
            f"data.categorical={categorical['columns']}: model {cfg.model.get('_target_')} takes no "
            "categorical_sizes: use aamperf's AAM (model=aam_tiny, ...), or data.categorical=[]"
        )
    cfg.model.categorical_sizes = [len(v) for v in categorical["vocabularies"].values()]
    summary["categorical"] = {**categorical, "fusion": cfg.model.get("categorical_fusion")}
