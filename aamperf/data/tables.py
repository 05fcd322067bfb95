"""Read the user's files (BIOM, Newick, UniFrac matrix, FASTA, metadata) with errors that name the option."""

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import biom
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

# read_target's first home: imported from here by older code and the tests
from aamperf.data.metadata import MISSING_VALUES, read_target, read_target_column  # noqa: F401
from aamperf.data.simulate import SimParams, ensure_simulated
from aamperf.data.tokenize import is_nucleotide_sequence, looks_like_sequence
from aamperf.errors import UserError

BIOM_FILES = ("table", "tree", "unifrac", "metadata", "sequences")  # data.*: the user's files (data=biom)
UNIFRAC_SUFFIXES = (".npy", ".h5", ".hdf5", ".csv", ".tsv", ".txt")


def existing_file(value: str | Path, option: str) -> Path:
    """`value` as an absolute path (relative to the launch directory); UserError if it is not a file
    this process can open."""
    path = Path(to_absolute_path(str(Path(value).expanduser())))
    if not path.is_file():
        raise UserError(f"{option}: no such file: {value}")
    try:
        path.open("rb").close()  # the permission bits do not tell (root, ACLs): open it
    except OSError as exc:
        raise UserError(f"{option}: cannot open {value} ({exc.strerror}); give a file you can read") from exc
    return path


def read_val_samples(value: str) -> list[str]:
    """data.val_samples: the sample ids of a text file, one per line (blank lines skipped), in its order.
    UserError for a file that is missing, lists no id or lists one twice. The ids are only compared with
    the data's (bytes that are not UTF-8 read as U+FFFD): nothing in the file is run or unpickled."""
    path = existing_file(value, "data.val_samples")
    text = path.read_bytes().decode("utf-8-sig", errors="replace")
    ids = [line.strip() for line in text.splitlines() if line.strip()]
    if not ids:
        raise UserError(
            f"data.val_samples: {value} lists no sample id; give the validation sample ids, one per line"
        )
    repeated = [sid for sid, n in Counter(ids).items() if n > 1]
    if repeated:
        raise UserError(
            f"data.val_samples: {value} lists {shown_ids(repeated)} more than once; list each validation "
            "sample once"
        )
    return ids


def shown_ids(ids: list[str], most: int = 3) -> str:
    """The first `most` of `ids` for a one-line message: quoted (control characters escaped), each cut
    at 40 characters, then how many more."""
    quoted = [repr(sid if len(sid) <= 40 else sid[:40] + "...") for sid in ids[:most]]
    return ", ".join(quoted) + (f" and {len(ids) - most} more" if len(ids) > most else "")


def unifrac_ids_file(path: Path) -> Path | None:
    """Where the sample ids of a precomputed matrix are: the file beside a .npy, or None for the types
    that hold their own. UserError for a type aamperf does not read, or a .npy without its ids."""
    suffix = path.suffix.lower()
    if suffix not in UNIFRAC_SUFFIXES:
        raise UserError(f"data.unifrac: unknown file type {suffix!r} of {path} (.npy, .h5, .csv, .tsv)")
    if suffix != ".npy":
        return None
    sidecars = [path.with_suffix(".ids.txt"), path.with_name(path.name + ".ids.txt")]
    ids_file = next((p for p in sidecars if p.is_file()), None)
    if ids_file is None:
        raise UserError(
            f"data.unifrac: {path} needs its sample ids, one per line, in "
            f"{sidecars[0].name} or {sidecars[1].name} beside it"
        )
    return ids_file


def table_ids(path: Path, axis: str = "sample") -> list[str]:
    """A BIOM table's sample (or observation) ids, in its order, without reading its counts where it is
    HDF5."""
    if h5py.is_hdf5(path):
        with h5py.File(path, "r") as f:
            return decoded(f[f"{axis}/ids"][()])
    return [str(i) for i in read_table(path).ids(axis=axis)]


def decoded(ids: np.ndarray) -> list[str]:
    """HDF5 string ids (bytes or str) as plain strings."""
    return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]


def check_counts(data: np.ndarray, path: Path) -> None:
    """UserError unless a table's counts are non-negative integers."""
    if (data < 0).any() or not np.array_equal(data, np.round(data)):
        raise UserError(f"data.table: {path} must hold non-negative integer counts (rarefaction needs reads)")


def read_table(path: Path, sample_ids: list[str] | None = None) -> biom.Table:
    """BIOM table (HDF5 or JSON) with integer counts; `sample_ids`: only these samples, in this order
    (HDF5: only their counts are read)."""
    try:
        if sample_ids is not None and h5py.is_hdf5(path):
            with h5py.File(path, "r") as f:
                table = biom.Table.from_hdf5(f, ids=sample_ids)
        else:
            table = biom.load_table(str(path))
        if sample_ids is not None:
            table = table.sort_order(sample_ids)  # a JSON table's other samples go here too
    except Exception as e:  # biom raises many types (OSError, ValueError, KeyError, TypeError)
        raise UserError(f"data.table: cannot read {path} as a BIOM table ({type(e).__name__}: {e})") from e
    if table.is_empty():
        raise UserError(f"data.table: cannot read {path} as a BIOM table (no samples or observations in it)")
    check_counts(table.matrix_data.data, path)
    return table


def table_chunks(
    path: Path, chunk_samples: int, start: int = 0, stop: int | None = None
) -> Iterator[tuple[list[str], sp.csc_matrix]]:
    """The table's samples `chunk_samples` at a time, from sample `start` to `stop` (None: the end):
    (ids, counts [observations, samples] int64).

    HDF5 (BIOM 2.x): each chunk's counts are read from the file's by-sample layout (`sample/matrix`),
    so memory holds one chunk whatever the table's size. JSON is read whole, then chunked."""
    if not h5py.is_hdf5(path):
        table = read_table(path)
        matrix, ids = table.matrix_data.tocsc(), [str(sid) for sid in table.ids()]
        end = len(ids) if stop is None else min(stop, len(ids))
        for a in range(start, end, chunk_samples):
            yield (
                ids[a : min(a + chunk_samples, end)],
                matrix[:, a : min(a + chunk_samples, end)].astype(np.int64),
            )
        return
    try:
        with h5py.File(path, "r") as f:
            ids = decoded(f["sample/ids"][()])
            n_obs = len(f["observation/ids"])
            matrix = f["sample/matrix"]
            indptr = matrix["indptr"][()].astype(np.int64)
            if not ids or not n_obs:
                raise ValueError("no samples or observations in it")
            end = len(ids) if stop is None else min(stop, len(ids))
            for a in range(start, end, chunk_samples):
                b = min(a + chunk_samples, end)
                lo, hi = indptr[a], indptr[b]
                data = matrix["data"][lo:hi]
                check_counts(data, path)
                counts = sp.csc_matrix(
                    (data.astype(np.int64), matrix["indices"][lo:hi], indptr[a : b + 1] - lo),
                    shape=(n_obs, b - a),
                )
                yield ids[a:b], counts
    except UserError:
        raise
    except Exception as e:  # h5py's KeyError / OSError for a file that is HDF5 but not BIOM
        raise UserError(f"data.table: cannot read {path} as a BIOM table ({type(e).__name__}: {e})") from e


def read_sequences(path: Path) -> dict[str, str]:
    """FASTA id -> upper-case sequence."""
    import skbio

    try:
        records = skbio.io.read(str(path), format="fasta", constructor=skbio.Sequence)
        sequences = {rec.metadata["id"]: str(rec).upper() for rec in records}
    except Exception as e:
        raise UserError(f"data.sequences: cannot read {path} as FASTA ({type(e).__name__}: {e})") from e
    bad = [key for key, seq in sequences.items() if not is_nucleotide_sequence(seq)]
    if bad:
        raise UserError(
            f"data.sequences: {len(bad)} records of {path} are not nucleotide sequences "
            f"(first: {bad[0]!r}); letters A/C/G/T and IUPAC codes only"
        )
    return sequences


def observation_sequences(obs_ids: list[str], sequences_path: Path | None) -> list[str]:
    """The sequence of each observation: the id itself, or its FASTA record from `data.sequences`."""
    obs_ids = [str(obs) for obs in obs_ids]  # biom's ids are numpy strings: messages show them plainly
    if sequences_path is None:
        not_seq = [obs for obs in obs_ids if not looks_like_sequence(obs)]
        if not_seq:
            raise UserError(
                f"data.sequences: {len(not_seq)} observation ids of data.table are not DNA "
                f"sequences (e.g. {not_seq[0]!r}: letters other than A/C/G/T and the IUPAC codes); set "
                "data.sequences=<FASTA id -> sequence>"
            )
        return [obs.upper() for obs in obs_ids]
    sequences = read_sequences(sequences_path)
    missing = [obs for obs in obs_ids if obs not in sequences]
    if missing:
        raise UserError(
            f"data.sequences: {len(missing)} of {len(obs_ids)} observation ids of data.table "
            f"have no record in {sequences_path} (e.g. {missing[0]!r})"
        )
    return [sequences[obs] for obs in obs_ids]


def read_unifrac(path: Path) -> tuple[np.ndarray, list[str]]:
    """A precomputed distance matrix and its sample ids, by file type.

    .npy: the matrix, with the ids one per line in `<name>.ids.txt` (or `<name>.npy.ids.txt`) beside it;
    .h5/.hdf5: datasets `matrix` and `ids`, or `matrix` and `order` (the unifrac package's `ssu -o
    <file> --format hdf5`); .csv/.tsv: square, sample ids as header row and first column (the layout of
    scikit-bio's DistanceMatrix.write and of QIIME 2's exported distance-matrix.tsv).
    """
    suffix, ids_file = path.suffix.lower(), unifrac_ids_file(path)
    try:
        if ids_file is not None:  # .npy
            matrix = np.load(path)
            ids = [line.strip() for line in ids_file.read_text().splitlines() if line.strip()]
        elif suffix in (".h5", ".hdf5"):
            with h5py.File(path, "r") as f:
                named = [key for key in ("ids", "order") if key in f]
                if "matrix" not in f or not named:
                    raise UserError(
                        f"data.unifrac: {path} holds datasets {', '.join(sorted(f)) or 'none'}; an HDF5 "
                        "matrix needs `matrix` and its sample ids in `ids` (or `order`, as ssu writes them)"
                    )
                matrix = f["matrix"][()]
                ids = decoded(f[named[0]][()])
        else:  # .csv, .tsv, .txt
            frame = pd.read_csv(path, sep="," if suffix == ".csv" else "\t", index_col=0, dtype={0: str})
            if list(frame.columns.astype(str)) != list(frame.index.astype(str)):
                raise UserError(
                    f"data.unifrac: the header row of {path} must list the same sample ids, "
                    "in the same order, as its first column"
                )
            matrix, ids = frame.to_numpy(dtype=np.float64), [str(i) for i in frame.index]
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"data.unifrac: cannot read {path} ({type(e).__name__}: {e})") from e
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] != len(ids):
        raise UserError(
            f"data.unifrac: {path} holds a {matrix.shape} matrix for {len(ids)} ids; "
            "it must be square with one id per row"
        )
    if len(set(ids)) != len(ids):
        raise UserError(f"data.unifrac: {path} lists a sample id more than once; give one row per sample")
    problem = not_a_distance_matrix(matrix.astype(np.float64), ids)
    if problem:
        raise UserError(f"data.unifrac: {path} is not a UniFrac distance matrix: {problem}")
    return matrix.astype(np.float64), ids


DISTANCE_TOLERANCE = 1e-6  # float32 round-off of a matrix written by another tool


def not_a_distance_matrix(matrix: np.ndarray, ids: list[str]) -> str | None:
    """What makes `matrix` no UniFrac distance matrix (square, finite, symmetric, zero diagonal, values
    in [0, 1]), with where; None when it is one."""

    def where(mask: np.ndarray) -> str:
        i, j = np.argwhere(mask)[0]
        return f"{ids[i]!r} x {ids[j]!r}: {matrix[i, j]:.6g}"

    if not np.isfinite(matrix).all():
        return f"a distance that is not a number ({where(~np.isfinite(matrix))})"
    diagonal = np.abs(np.diag(matrix)) > DISTANCE_TOLERANCE
    if diagonal.any():
        i = int(np.argmax(diagonal))
        looks = " (a similarity matrix? UniFrac is a distance: 0 from a sample to itself)"
        return f"the distance of {ids[i]!r} to itself is {matrix[i, i]:.6g}, not 0" + (
            looks if np.allclose(np.diag(matrix), 1.0) else ""
        )
    outside = (matrix < -DISTANCE_TOLERANCE) | (matrix > 1 + DISTANCE_TOLERANCE)
    if outside.any():
        return f"a distance outside [0, 1] ({where(outside)})"
    asymmetric = np.abs(matrix - matrix.T) > DISTANCE_TOLERANCE
    if asymmetric.any():
        i, j = np.argwhere(asymmetric)[0]
        other = f"{matrix[j, i]:.6g} the other way"
        return f"not symmetric ({ids[i]!r} x {ids[j]!r}: {matrix[i, j]:.6g}, but {other})"
    return None


def resolve_files(cfg: DictConfig) -> dict[str, Path | None]:
    """The files the `data` config points at (simulating them first for data=simulated); the config
    itself was checked up front (check_data)."""
    if cfg.source == "simulated":
        params = SimParams(cfg.n_samples, cfg.n_asvs, cfg.n_envs, cfg.mean_richness, cfg.depth, cfg.seed)
        return {
            **ensure_simulated(params, Path(cfg.cache_dir).expanduser()),
            "unifrac": None,
            "sequences": None,
        }
    return {
        name: None if cfg[name] is None else existing_file(cfg[name], f"data.{name}") for name in BIOM_FILES
    }
