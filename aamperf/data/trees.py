"""Read the Newick tree of `data.tree`: tips as written, branches without a length read as 0."""

import logging
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from aamperf.errors import UserError

if TYPE_CHECKING:  # scikit-bio costs ~2 s to import: the readers that need it import it
    from skbio import TreeNode

log = logging.getLogger(__name__)


def read_tree(path: Path) -> "TreeNode":
    """Newick tree; tips are the table's observation ids, read as written: an unquoted `ASV_1` (DADA2,
    FastTree, ape write them so) stays `ASV_1`, where Newick's own rule would read 'ASV 1'."""
    from skbio import TreeNode

    try:
        with warnings.catch_warnings():  # skbio warns "does not look like a newick file", then raises
            warnings.simplefilter("ignore")
            return TreeNode.read(str(path), format="newick", convert_underscores=False)
    except Exception as e:  # skbio's NewickFormatError and friends
        raise UserError(f"data.tree: cannot read {path} as Newick ({type(e).__name__}: {e})") from e


def zero_missing_lengths(tree: "TreeNode") -> int:
    """Set the branches written without a length (Greengenes' tree has internal nodes so) to 0, the
    root's aside: how many there were. A zero-length branch adds nothing to UniFrac."""
    missing = [node for node in tree.traverse(include_self=False) if node.length is None]
    for node in missing:
        node.length = 0.0
    return len(missing)


def warn_missing_lengths(n: int, path: Path) -> None:
    if n:
        log.warning(
            "data.tree: %d branches of %s have no length: read as 0 (they add nothing to UniFrac)",
            n,
            path,
        )


def check_tips(tip_names: list[str], observation_ids: list[str]) -> None:
    """UserError unless each tip name is once in the tree and every observation of the table is a tip."""
    names = Counter(tip_names)
    repeated = sorted(str(name) for name, n in names.items() if n > 1)
    if repeated:
        raise UserError(
            f"data.tree: {len(repeated)} tip names appear more than once in the tree (e.g. "
            f"{repeated[0][:40]!r}); give a tree with each ASV as one tip"
        )
    missing = [obs for obs in observation_ids if obs not in names]
    if missing:
        raise UserError(
            f"data.tree: {len(missing)} of {len(observation_ids)} ASVs of the table are not tips of the "
            f"tree (e.g. {missing[0][:40]!r}); give a tree that covers every ASV of data.table"
        )
