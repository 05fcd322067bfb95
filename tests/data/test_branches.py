"""Batch UniFrac: equal to scikit-bio on QIIME's test data and on simulated data, whatever the batch, on
every rank's rows; a run in batch mode trains as one on the precomputed matrix."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import skbio
import torch
from conftest import read_metrics
from omegaconf import OmegaConf
from skbio.diversity import beta_diversity

from aamperf.data.branches import batch_matrix, batch_unifrac, read_branches
from aamperf.data.collate import Collate
from aamperf.errors import UserError
from aamperf.run import train

QIIME = Path(skbio.__file__).parent / "diversity/beta/tests/data/qiime-191-tt"  # shipped with scikit-bio


def unifrac_of(tree_path: Path, counts: np.ndarray, obs_ids: list[str], rows=None) -> np.ndarray:
    """Batch UniFrac of the samples (columns of `counts`) as one batch."""
    sets = read_branches(tree_path, obs_ids).of_samples(sp.csc_matrix(counts))
    per_sample = [sets.indices[sets.indptr[i] : sets.indptr[i + 1]] for i in range(counts.shape[1])]
    matrix, lengths = batch_matrix(per_sample, read_branches(tree_path, obs_ids).lengths)
    rows = torch.arange(counts.shape[1]) if rows is None else rows
    return batch_unifrac(matrix, lengths, rows).numpy()


def skbio_unifrac(tree_path: Path, counts: np.ndarray, obs_ids: list[str]) -> np.ndarray:
    tree = skbio.TreeNode.read(str(tree_path))
    ids = [f"s{j}" for j in range(counts.shape[1])]
    return beta_diversity("unweighted_unifrac", counts.T, ids=ids, taxa=obs_ids, tree=tree).data


def test_qiime_tiny_test_data_equals_scikit_bio_and_qiime():
    table = pd.read_csv(QIIME / "otu-table.tsv", sep="\t", skiprows=1, index_col=0)
    obs_ids, counts = [str(i) for i in table.index], table.to_numpy()
    mine = unifrac_of(QIIME / "tree.nwk", counts, obs_ids)
    np.testing.assert_allclose(mine, skbio_unifrac(QIIME / "tree.nwk", counts, obs_ids), atol=1e-6)
    qiime = pd.read_csv(QIIME / "unweighted_unifrac_dm.txt", sep="\t", index_col=0)
    samples = list(table.columns)
    np.testing.assert_allclose(mine, qiime.loc[samples, samples].to_numpy(), atol=1e-6)
    assert len(np.unique(mine.round(6))) > 10  # not all zeros or ones: a real check


def test_a_root_with_a_length_and_zero_length_branches_count_as_scikit_bio_counts_them(tmp_path):
    # the root's own length is shared by every sample; zero-length branches count for nothing
    (tmp_path / "t.nwk").write_text("((a:1,b:2,e:0)ab:0.5,(c:3,d:4)cd:0)root:2;\n")
    counts = np.array([[3, 1, 0, 0], [2, 0, 0, 0], [0, 5, 0, 0], [0, 0, 7, 0], [0, 0, 0, 4]])
    ids = ["a", "b", "c", "d", "e"]
    mine = unifrac_of(tmp_path / "t.nwk", counts, ids)
    np.testing.assert_allclose(mine, skbio_unifrac(tmp_path / "t.nwk", counts, ids), atol=1e-6)
    # S1 = {a, b} vs S2 = {a, c}: unique b + c = 5 over observed a b ab c root = 8.5
    assert mine[0, 1] == pytest.approx(5 / 8.5, abs=1e-6)
    assert mine[3, 3] == 0.0  # a sample whose only ASV sits on a zero-length branch: distance 0 to itself


def test_a_tree_that_misses_an_asv_or_repeats_a_tip_is_one_line(tmp_path):
    (tmp_path / "t.nwk").write_text("((a:1,b:2):0.5,c:3);")
    with pytest.raises(
        UserError, match=r"^data\.tree: 1 of 4 ASVs of the table are not tips .* \(e\.g\. 'd'\)"
    ):
        read_branches(tmp_path / "t.nwk", ["a", "b", "c", "d"])
    (tmp_path / "t.nwk").write_text("((a:1,a:2):0.5,c:3);")
    with pytest.raises(UserError, match=r"^data\.tree: 1 tip names appear more than once"):
        read_branches(tmp_path / "t.nwk", ["a", "c"])
    (tmp_path / "t.nwk").write_text("((a:1,b:2):-1,c:3);")
    with pytest.raises(UserError, match=r"^data\.tree: .* has a branch length that is negative"):
        read_branches(tmp_path / "t.nwk", ["a", "c"])


def test_a_branch_without_a_length_counts_as_zero_and_is_counted(tmp_path):
    """Greengenes' tree has internal nodes without a length: read as 0 (scikit-bio refuses them)."""
    (tmp_path / "t.nwk").write_text("(((a:1,b:2)ab,e:4)abe:0.5,(c:3,d)cd:2)root;\n")
    (tmp_path / "zero.nwk").write_text("(((a:1,b:2)ab:0,e:4)abe:0.5,(c:3,d:0)cd:2)root;\n")
    counts = np.array([[3, 1, 0, 0], [2, 0, 1, 0], [0, 5, 0, 1], [0, 0, 7, 0], [0, 0, 0, 4]])
    ids = ["a", "b", "c", "d", "e"]
    assert read_branches(tmp_path / "t.nwk", ids).missing_lengths == 2  # ab and d; the root may have none
    assert read_branches(tmp_path / "zero.nwk", ids).missing_lengths == 0
    mine = unifrac_of(tmp_path / "t.nwk", counts, ids)
    np.testing.assert_allclose(mine, skbio_unifrac(tmp_path / "zero.nwk", counts, ids), atol=1e-6)
    # S1 {a, b, ab, abe} vs S2 {a, ab, abe, c, cd}: b + c + cd = 7 of a b ab abe c cd = 8.5 (ab: 0)
    assert mine[0, 1] == pytest.approx(7 / 8.5, abs=1e-6)


def test_unquoted_tips_with_underscores_are_read_as_written(tmp_path):
    """DADA2, FastTree and ape write `ASV_1` unquoted: it must match the table's ASV_1 (Newick's own
    rule reads it as 'ASV 1')."""
    (tmp_path / "t.nwk").write_text("((ASV_1:1,'ASV_2':2):0.5,ASV_3:3);\n")
    ids = ["ASV_1", "ASV_2", "ASV_3"]
    counts = np.array([[1, 0, 4], [1, 1, 0], [0, 2, 3]])
    tree = skbio.TreeNode.read(["((ASV_1:1,ASV_2:2):0.5,ASV_3:3);"], convert_underscores=False)
    expected = beta_diversity("unweighted_unifrac", counts.T, ids=["s0", "s1", "s2"], taxa=ids, tree=tree)
    np.testing.assert_allclose(unifrac_of(tmp_path / "t.nwk", counts, ids), expected.data, atol=1e-6)


def test_simulated_batches_equal_the_full_matrix_whatever_else_is_in_the_batch(make_cfg):
    from aamperf.data import build_data
    from aamperf.device import to_device

    cfg = make_cfg("data.n_samples=60")
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader)
    precomputed = build_data(
        OmegaConf.merge(cfg.data, {"unifrac_mode": "precomputed"}),
        batch_size=8,
        seed=0,
        loader=cfg.dataloader,
    )
    full = precomputed.collate.unifrac.double().numpy()  # scikit-bio's, on the rarefied table
    assert precomputed.sample_ids == data.sample_ids
    seen = 0
    for first, second in [([0, 1, 2, 3], [3, 2, 9, 0, 40, 41]), (list(range(0, 45, 7)), [14, 0])]:
        a = to_device(data.collate([data.dataset[i] for i in first]), torch.device("cpu"))["unifrac"]
        b = to_device(data.collate([data.dataset[i] for i in second]), torch.device("cpu"))["unifrac"]
        np.testing.assert_allclose(a.numpy(), full[np.ix_(first, first)], atol=1e-6)
        np.testing.assert_allclose(b.numpy(), full[np.ix_(second, second)], atol=1e-6)
        seen += (full[np.ix_(first, first)] > 0.1).sum()
    assert seen > 20


def test_each_rank_gets_its_rows_against_the_global_batch(make_cfg):
    from aamperf.data import build_data
    from aamperf.device import to_device

    cfg = make_cfg()
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader)
    items = [data.dataset[i] for i in range(8)]
    whole = to_device(data.collate(items), torch.device("cpu"))["unifrac"]
    c = data.collate
    for rank in (0, 1):
        ranked = Collate(c.tokens, None, c.pad_to, rank, 2, c.bucket_cap, c.branch_lengths)
        mine = to_device(ranked(items), torch.device("cpu"))["unifrac"]
        assert mine.shape == (4, 8)
        assert torch.equal(mine, whole[rank * 4 : (rank + 1) * 4])


def test_a_run_in_batch_mode_trains_as_one_on_the_precomputed_matrix(make_cfg, tmp_path):
    losses = {}
    for mode in ("batch", "precomputed"):
        summary = train(make_cfg(f"data.unifrac_mode={mode}", "trainer.max_steps=4"), tmp_path / mode)
        assert summary["unifrac_mode"] == mode
        rows = read_metrics(tmp_path / mode)
        losses[mode] = [r[key] for r in rows for key in ("loss", "loss_unifrac", "val_loss") if key in r]
    assert len(losses["batch"]) == 4 * 2 + 2  # validated at steps 2 and 4
    assert losses["batch"] == pytest.approx(losses["precomputed"], rel=1e-5)
    assert losses["batch"] != pytest.approx(losses["batch"][::-1], rel=1e-5)  # the steps differ
