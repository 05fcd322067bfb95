"""UniFrac between samples (unweighted, or weighted and normalized): computed with scikit-bio and cached on
disk, or precomputed."""

import hashlib
import logging
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import biom
import numpy as np

from aamperf.data.trees import check_tips, read_tree, warn_missing_lengths, zero_missing_lengths
from aamperf.errors import NoSpace, UserError, one_line
from aamperf.files import one_builder, write_atomic

if TYPE_CHECKING:  # scikit-bio costs ~2 s to import; a cache hit never needs it
    from skbio import TreeNode

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # part of the cache key: bump when the computation changes
# data.unifrac_metric -> scikit-bio's metric and its arguments (both part of the cache key)
METRICS = {
    "unweighted": ("unweighted_unifrac", {}),
    "weighted_normalized": ("weighted_unifrac", {"normalized": True}),
}


def cache_key(table: biom.Table, tree_text: bytes, metric: str = "unweighted") -> str:
    """sha256 of the table's content (ids and counts), the tree's text and the options."""
    name, options = METRICS[metric]
    h = hashlib.sha256(f"{'_'.join([name, *options])}|v{CACHE_VERSION}|".encode())  # unweighted_unifrac|v1|
    for axis in ("sample", "observation"):
        h.update("\t".join(table.ids(axis=axis)).encode() + b"\n")
    data = table.matrix_data.tocsr(copy=True)
    data.eliminate_zeros()
    data.sort_indices()
    h.update(np.ascontiguousarray(data.indptr, dtype=np.int64))
    h.update(np.ascontiguousarray(data.indices, dtype=np.int64))
    h.update(np.ascontiguousarray(data.data, dtype=np.float64))
    h.update(tree_text)
    return h.hexdigest()


def compute_unifrac(table: biom.Table, tree: "TreeNode", metric: str = "unweighted") -> np.ndarray:
    """UniFrac [n_samples, n_samples] in the table's sample order (scikit-bio's, of `metric`)."""
    from skbio.diversity import beta_diversity

    obs_ids = [str(obs) for obs in table.ids(axis="observation")]  # plain strings in messages
    check_tips([tip.name for tip in tree.tips()], obs_ids)
    counts = table.matrix_data.T.toarray().astype(np.int64)  # samples x ASVs
    try:
        name, options = METRICS[metric]
        dm = beta_diversity(name, counts, ids=list(table.ids()), taxa=obs_ids, tree=tree, **options)
    except ValueError as e:  # e.g. missing branch lengths
        raise UserError(f"data.tree: scikit-bio cannot compute UniFrac with this tree ({e})") from e
    return dm.data


def cached_unifrac(
    table: biom.Table, tree_path: Path, cache_dir: Path, metric: str = "unweighted"
) -> tuple[np.ndarray, bool, int]:
    """UniFrac (`metric`) of `table` with the tree in `tree_path`: (matrix, served from the cache, branches
    of the tree without a length, read as 0: warned, as each run that uses the tree is).

    The cache is `<cache_dir>/unifrac/<key>.npz`; on a hit the tree is not even parsed. One process
    computes a missing matrix; others started with it (torchrun ranks) wait and read it.
    """
    path = cache_dir / "unifrac" / f"{cache_key(table, tree_path.read_bytes(), metric)}.npz"
    sample_ids = np.asarray(table.ids(), dtype=str)
    hit = read_cached(path, sample_ids, warn=False)
    if hit is None:
        with one_builder(path.parent):
            hit = read_cached(path, sample_ids, warn=True)  # another process computed it meanwhile?
            if hit is None:
                return computed_unifrac(table, tree_path, path, sample_ids, metric)
    warn_missing_lengths(hit[1], tree_path)
    return hit[0], True, hit[1]


def computed_unifrac(table: biom.Table, tree_path: Path, path: Path, sample_ids: np.ndarray, metric: str):
    """cached_unifrac's miss: the matrix computed, then kept in `path` with the count of missing lengths."""
    tree = read_tree(tree_path)
    missing_lengths = zero_missing_lengths(tree)
    warn_missing_lengths(missing_lengths, tree_path)
    matrix = compute_unifrac(table, tree, metric)
    try:  # atomic: a reader sees the old file, no file, or the whole new one
        write_atomic(
            path, lambda f: np.savez(f, matrix=matrix, ids=sample_ids, missing_lengths=missing_lengths)
        )
    except NoSpace:  # the run has its matrix: a cache it cannot keep costs the next run only
        log.warning(
            "UniFrac not cached: no space left in %s (free space, or set data.cache_dir)", path.parent
        )
        return matrix, False, missing_lengths
    log.info("UniFrac for %d samples cached in %s", len(sample_ids), path)
    return matrix, False, missing_lengths


def read_cached(path: Path, sample_ids: np.ndarray, warn: bool) -> tuple[np.ndarray, int] | None:
    """The cached matrix of these samples and the tree's missing lengths, or None (absent; or damaged,
    said where `warn`)."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as cached:  # a zip: each member's CRC is checked as it is read
            if np.array_equal(cached["ids"], sample_ids):  # guards against a hash collision
                # a matrix cached before the count was kept: its tree had every length (others were refused)
                missing = int(cached["missing_lengths"]) if "missing_lengths" in cached else 0
                return cached["matrix"], missing
        problem = "does not match the table"
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:  # truncated, garbage
        problem = f"is damaged ({type(exc).__name__}: {one_line(exc)[:120]})"
    if warn:
        log.warning("UniFrac cache %s %s; recomputing it", path, problem)
    return None


def select_unifrac(matrix: np.ndarray, ids: list[str], sample_ids: list[str]) -> np.ndarray:
    """Rows/columns of a precomputed matrix for `sample_ids`, in that order."""
    position = {sid: i for i, sid in enumerate(ids)}
    missing = [sid for sid in sample_ids if sid not in position]
    if missing:
        raise UserError(
            f"data.unifrac: {len(missing)} of {len(sample_ids)} samples of data.table are not in "
            f"the UniFrac matrix (e.g. {missing[0]!r}); give a matrix that covers every sample"
        )
    order = np.array([position[sid] for sid in sample_ids])
    return matrix[np.ix_(order, order)]
