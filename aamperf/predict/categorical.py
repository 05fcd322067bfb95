"""Predict with a model conditioned on categorical metadata (data.categorical): the samples' categories
mapped with the vocabularies saved with the model (model.pt's `categorical`), a category training never saw
and a missing value to the reserved slot 0, counted per column in the summary and its printout."""

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from aamperf.data.categorical import check_columns, encode, read_values
from aamperf.data.samples import Samples
from aamperf.errors import UserError


def check_metadata(vocabularies: dict[str, list[str]] | None, data_cfg: DictConfig, run: str) -> None:
    """A conditioned model needs its columns in the metadata of the samples it predicts: a one-line
    UserError where a new table comes without data.metadata (the run's own samples have the run's)."""
    if vocabularies and data_cfg.get("metadata") is None and data_cfg.get("source") == "biom":
        raise UserError(
            f"run={run} conditions its target on the metadata columns {', '.join(vocabularies)} "
            "(data.categorical): give data.metadata=<samples.tsv> holding them for data.table's samples"
        )


def attach_categories(samples: Samples, vocabularies: dict[str, list[str]] | None) -> None:
    """Each sample's index in the saved vocabularies into `samples.dataset.categorical` (its batches then
    carry `categorical`); nothing for a model without conditioning."""
    if not vocabularies:
        return
    metadata = samples.files["metadata"]
    check_columns(list(vocabularies), metadata, None)
    samples.dataset.categorical = encode(
        read_values(metadata, list(vocabularies), samples.ids), vocabularies
    ).indices


def category_record(
    vocabularies: dict[str, list[str]] | None, metadata: Path | None, ids: list[str]
) -> dict[str, Any] | None:
    """What predict's summary says of the conditioning: the columns, and per column how many of the
    samples predicted took slot 0 because their category is one training never saw (`unseen`) or their
    value is missing (`missing`); None for a model without conditioning."""
    if not vocabularies or metadata is None:
        return None
    encoded = encode(read_values(Path(metadata), list(vocabularies), ids), vocabularies)
    return {
        "columns": list(vocabularies),
        "unseen": encoded.unseen,
        "missing": encoded.missing,
        "slot": "a category unseen in training or missing is embedded as the reserved slot 0 (a zero vector)",
    }


def categorical_line(summary: dict[str, Any]) -> str | None:
    """The printout's line of the conditioning: per column the samples in slot 0 (None: no conditioning)."""
    record = summary.get("categorical")
    if not record:
        return None
    counts = "; ".join(
        f"{column}: {record['unseen'][column]} unseen in training, {record['missing'][column]} missing"
        for column in record["columns"]
    )
    return f"  categorical (of {summary['n_samples']} samples; slot 0 for these): {counts}"
