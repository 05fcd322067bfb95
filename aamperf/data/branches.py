"""Unweighted UniFrac per batch: each sample's set of tree branches, and a batch's distances from them.

A sample's branches are the union of its ASVs' paths to the root. Between two samples, unweighted
UniFrac is the length of the branches only one of them has over the length of the branches either has
(scikit-bio's definition, root branch included when the tree gives it a length). For a batch of B
samples with a 0/1 matrix M [B, U] over the U branches any of them has, and lengths L [U]:
shared = (M * L) @ M.T, union = total_i + total_j - shared, distance = 1 - shared / union.
No other sample enters a pair's distance, so a batch's distances are those of the full matrix.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from aamperf.data.trees import check_tips, read_tree, zero_missing_lengths
from aamperf.errors import UserError


@dataclass
class Branches:
    """The tree as arrays, for the table's observations: which branches lie on each one's path to the root."""

    lengths: np.ndarray  # float64 [n_branches]: the branches with a length > 0 (the others never count)
    paths: sp.csr_matrix  # [n_observations, n_branches] 0/1: the branches on each observation's path
    missing_lengths: int = 0  # branches of the tree written without a length, read as 0 (the root aside)

    def of_samples(self, presence: sp.csc_matrix) -> sp.csr_matrix:
        """[n_samples, n_branches] 0/1 from presence [n_observations, n_samples] (counts > 0)."""
        present = sp.csr_matrix(presence.T, dtype=np.float32)
        present.data[:] = 1.0
        covered = present @ self.paths  # how many of the sample's ASVs lie below each branch
        covered.data[:] = 1.0
        covered.sort_indices()
        return covered


def read_branches(tree_path: Path, observation_ids: list[str]) -> Branches:
    """The branches of the Newick tree in `tree_path` on the paths of `observation_ids` (its tips)."""
    tree = read_tree(tree_path)
    missing_lengths = zero_missing_lengths(tree)
    nodes = list(tree.postorder(include_self=True))
    index = {id(node): i for i, node in enumerate(nodes)}
    parent = np.array([-1 if n.parent is None else index[id(n.parent)] for n in nodes])
    lengths = np.array([float(n.length or 0.0) for n in nodes])  # the root (last in postorder) may have none
    if np.isnan(lengths).any() or (lengths < 0).any():
        raise UserError(f"data.tree: {tree_path} has a branch length that is negative or not a number")
    tips = {node.name: index[id(node)] for node in nodes if not node.children}
    check_tips([node.name for node in nodes if not node.children], observation_ids)
    # walk every observation's path up at once: one step per level of the tree
    rows, cols = [], []
    row, node = np.arange(len(observation_ids)), np.array([tips[obs] for obs in observation_ids])
    while len(node):
        rows.append(row)
        cols.append(node)
        up = parent[node]
        row, node = row[up >= 0], up[up >= 0]
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    counted = lengths > 0  # a zero-length branch (an unrooted top, a polytomy's) adds nothing
    keep = counted[cols]
    column = np.cumsum(counted) - 1
    data = np.ones(int(keep.sum()), dtype=np.float32)
    paths = sp.csr_matrix(
        (data, (rows[keep], column[cols[keep]])), shape=(len(observation_ids), int(counted.sum()))
    )
    return Branches(lengths[counted], paths, missing_lengths)


def batch_matrix(branch_sets: list[np.ndarray], lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's branch sets as a 0/1 matrix [B, U] over the U branches any of them has, and their lengths."""
    used, column = np.unique(np.concatenate(branch_sets), return_inverse=True)
    matrix = torch.zeros(len(branch_sets), len(used), dtype=torch.uint8)
    rows = np.repeat(np.arange(len(branch_sets)), [len(s) for s in branch_sets])
    matrix[torch.from_numpy(rows), torch.from_numpy(column)] = 1
    return matrix, torch.from_numpy(lengths[used])


def batch_unifrac(matrix: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Unweighted UniFrac [len(rows), B] float32 between the batch's samples `rows` and all of it, on the
    tensors' device. float64: shared and union lengths are sums of up to U branch lengths, and the
    difference of two such sums must keep 1e-6."""
    m = matrix.double()
    weighted = m * lengths.double()
    shared = weighted[rows] @ m.T  # [b, B] length both samples have
    total = weighted.sum(dim=1)
    union = total[rows, None] + total[None, :] - shared
    # two samples without a branch of positive length are the same (scikit-bio: 0)
    distance = torch.where(union > 0, 1.0 - shared / union.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return distance.float()
