"""Read a metadata TSV's target column (data.metadata, data.target): a number or a class per sample,
with errors that name the option."""

from pathlib import Path

import numpy as np
import pandas as pd

from aamperf.errors import UserError

# What metadata writes for "no value" (compared stripped, in lower case): the INSDC / ENA / MIxS terms
# (https://www.insdc.org/submitting-standards/missing-value-reporting/), the forms Qiita and QIIME
# templates use ("Not applicable", "Missing: Not provided"), and the spreadsheet spellings. A sample whose
# data.target holds one is left out as one without a value is.
MISSING_VALUES = frozenset(
    {
        "",
        "na",
        "n/a",
        "nan",
        "not applicable",
        "not collected",
        "not provided",
        "restricted access",
        "missing",
        "missing: not applicable",
        "missing: not collected",
        "missing: not provided",
        "missing: restricted access",
        "missing: control sample",
        "missing: sample group",
        "missing: synthetic construct",
        "missing: lab stock",
        "missing: third party data",
        "missing: data agreement established pre-2023",
        "missing: endangered species",
        "missing: human-identifiable",
    }
)


def read_target(path: Path, column: str, target_type: str = "regression") -> dict[str, float]:
    """Sample id -> value of `column` in a TSV whose first column is the sample id: the number, or for a
    categorical target (`target_type`: `read_target_column`) the index of its class among the sorted
    distinct values."""
    return read_target_column(path, column, target_type)[0]


def read_target_column(path: Path, column: str, target_type: str = "regression") -> tuple[
    dict[str, float], str, list[str]
]:  # fmt: skip
    """(sample id -> value, the target's kind, its classes) of `column` in the TSV `path`. data.target_type
    auto: a numeric column is a regression, any other a classification; classification of a numeric
    column when asked. Classes: the distinct values, sorted (numerically where they are numbers)."""
    written = metadata_column(path, column)
    values = pd.to_numeric(written, errors="coerce")
    bad = values.isna() & written.notna()
    if target_type == "classification" or (target_type == "auto" and bad.any()):
        return categories(written.dropna(), values.dropna() if not bad.any() else None, path, column)
    if bad.any():
        raise UserError(
            f"data.target: column {column!r} of {path} is not numeric "
            f"(sample {str(bad.idxmax())!r}: {written[bad].iloc[0]!r}); give a number, or leave it empty "
            "(or 'not collected', 'not provided', 'NA', ...) to leave the sample out, or set "
            "data.target_type=classification (or auto) to learn its classes"
        )
    infinite = values.abs() == np.inf
    if infinite.any():
        raise UserError(
            f"data.target: column {column!r} of {path} holds infinite values (samples "
            f"{', '.join(map(str, values.index[infinite][:5]))}); give finite numbers, or leave them empty "
            "to drop those samples"
        )
    return {str(sid): float(v) for sid, v in values.dropna().items()}, "regression", []


def categories(
    written: pd.Series, numbers: pd.Series | None, path: Path, column: str
) -> tuple[dict[str, float], str, list[str]]:
    """A categorical column: each sample's class index among the sorted distinct values (`numbers`: the
    values as numbers, sorted as such). One value per sample is an id or free text, not categories."""
    written = written.str.strip()
    names = sorted(set(written)) if numbers is None else [str(v) for v in sorted(set(written), key=float)]
    if len(names) == len(written):
        raise UserError(
            f"data.target: column {column!r} of {path} is neither numeric nor categorical: its "
            f"{len(names)} samples hold {len(names)} distinct values (an id, free text); pick another column"
        )
    index = {name: float(i) for i, name in enumerate(names)}
    return {str(sid): index[v] for sid, v in written.items()}, "classification", names


def metadata_column(path: Path, column: str) -> pd.Series:
    """`column` of the metadata TSV `path` as written (strings; missing values as NaN), by sample id."""
    try:
        frame = pd.read_csv(path, sep="\t", index_col=0, dtype=str, comment=None)
    except Exception as e:
        raise UserError(f"data.metadata: cannot read {path} as TSV ({type(e).__name__}: {e})") from e
    frame = frame[~frame.index.astype(str).str.startswith("#")]  # QIIME 2 '#q2:types' directive rows
    if column not in frame.columns:
        header = ", ".join(map(str, frame.columns)) or "none"
        with open(path, errors="replace") as f:
            first = f.readline()
        if "\t" not in first and "," in first:
            raise UserError(
                f"data.metadata: {path} is comma-separated; aamperf reads tab-separated files (TSV): save it "
                "with tabs, the sample id in the first column"
            )
        raise UserError(f"data.target: no column {column!r} in {path} (columns: {header})")
    ids = frame.index.astype(str)
    repeated = sorted(set(ids[ids.duplicated()]))
    if repeated:
        raise UserError(
            f"data.metadata: sample ids listed more than once in {path}: {', '.join(repeated[:5])}"
            + (f" (and {len(repeated) - 5} more)" if len(repeated) > 5 else "")
            + "; keep one row per sample"
        )
    return frame[column].mask(frame[column].str.strip().str.lower().isin(MISSING_VALUES))
