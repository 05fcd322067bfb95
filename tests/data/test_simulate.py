"""The simulator: deterministic, cached atomically, and structured like real microbiome data."""

import hashlib

import numpy as np
import pytest
from scipy import sparse
from skbio import TreeNode

from aamperf.data.simulate import (
    SimParams,
    composition_score,
    ensure_simulated,
    simulate,
    simulate_heldout,
    simulate_world,
)
from aamperf.data.tables import read_table, read_target
from aamperf.data.unifrac import compute_unifrac

SMALL = SimParams(n_samples=40, n_asvs=64, n_envs=2, mean_richness=20, depth=2000, seed=0)


def test_same_params_give_identical_files_and_other_seed_differs(tmp_path):
    first = ensure_simulated(SMALL, tmp_path / "a")
    second = ensure_simulated(SMALL, tmp_path / "b")
    other = ensure_simulated(SimParams(**{**SMALL.__dict__, "seed": 1}), tmp_path / "c")
    assert first["tree"].read_bytes() == second["tree"].read_bytes()
    assert first["metadata"].read_bytes() == second["metadata"].read_bytes()
    assert read_table(first["table"]) == read_table(second["table"])
    assert first["tree"].read_bytes() != other["tree"].read_bytes()
    assert read_table(first["table"]) != read_table(other["table"])


def test_data_set_is_written_once_under_its_digest(tmp_path):
    files = ensure_simulated(SMALL, tmp_path)
    mtime = files["table"].stat().st_mtime_ns
    again = ensure_simulated(SMALL, tmp_path)
    assert again == files
    assert files["table"].parent == tmp_path / "simulated" / SMALL.digest()
    assert again["table"].stat().st_mtime_ns == mtime  # reused, not rewritten
    assert sorted(p.name for p in (tmp_path / "simulated").iterdir()) == [SMALL.digest()]  # no temp left


def test_files_agree_with_each_other(tmp_path):
    files = ensure_simulated(SMALL, tmp_path)
    table = read_table(files["table"])
    tips = [tip.name for tip in TreeNode.read(str(files["tree"])).tips()]
    assert sorted(table.ids(axis="observation")) == sorted(tips)
    assert len(set(tips)) == SMALL.n_asvs
    assert all(len(name) == 150 and set(name) <= set("ACGT") for name in tips)
    assert list(table.ids())[:2] == ["S0001", "S0002"]
    targets = read_target(files["metadata"], "target")
    assert sorted(targets) == sorted(table.ids())
    assert np.std(list(targets.values())) > 0


def test_sister_tips_have_more_similar_sequences_than_random_pairs():
    _, tree, _ = simulate(SimParams(60, 128, 2, 20, 2000, 3))

    def mismatch(a: str, b: str) -> float:
        return float(np.mean(np.frombuffer(a.encode(), "u1") != np.frombuffer(b.encode(), "u1")))

    sisters = [
        mismatch(n.children[0].name, n.children[1].name)
        for n in tree.non_tips(include_self=True)
        if all(c.is_tip() for c in n.children)
    ]
    names = [tip.name for tip in tree.tips()]
    rng = np.random.default_rng(0)
    pairs = [mismatch(*rng.choice(names, 2, replace=False)) for _ in range(300)]
    assert len(sisters) >= 10
    assert np.mean(sisters) < 0.5 * np.mean(pairs)
    assert np.mean(pairs) > 0.2  # random ASVs are far apart, as in a real 16S region


def test_samples_are_structured_by_environment():
    table, tree, rows = simulate(SMALL)
    env = np.array([row[1] for row in rows])
    distance = compute_unifrac(table, tree)
    same = (env[:, None] == env[None, :]) & ~np.eye(len(env), dtype=bool)
    assert distance[same].mean() < distance[env[:, None] != env[None, :]].mean() - 0.05
    richness = (table.matrix_data > 0).sum(axis=0).A1
    assert richness.std() > 2  # richness varies between samples
    prevalence = (table.matrix_data > 0).sum(axis=1).A1
    assert (prevalence >= 5).sum() > SMALL.n_asvs // 4  # ASVs are shared across samples
    top_share = table.matrix_data.max(axis=0).toarray().ravel() / table.sum(axis="sample")
    assert np.median(top_share) > 3 / SMALL.mean_richness  # heavy-tailed: one ASV dominates


def test_default_sizes_survive_default_rarefaction():
    table, _, _ = simulate(SimParams(256, 512, 4, 80, 5000, 0))
    depth = table.sum(axis="sample")
    assert table.shape == (512, 256)
    assert (depth >= 1000).mean() > 0.95
    assert 3000 < np.median(depth) < 7000


def test_target_depends_on_composition():
    table, _, rows = simulate(SimParams(300, 64, 3, 20, 2000, 5))
    target = np.array([row[2] for row in rows])
    relative = (table.matrix_data / table.sum(axis="sample")).T.toarray()  # samples x ASVs

    def unexplained(y: np.ndarray) -> float:  # fraction of variance a linear fit on composition misses
        coef, *_ = np.linalg.lstsq(relative, y, rcond=None)
        return float((y - relative @ coef).var() / y.var())

    assert unexplained(target) < 0.05  # the noise is 10% of the signal's sd
    assert unexplained(np.random.default_rng(0).permutation(target)) > 0.5  # composition-free target


@pytest.mark.parametrize(
    ("params", "digest"),
    [(SMALL, "dc5dac5c6e2a8f65"), (SimParams(203, 97, 3, 20, 2000, 5), "229116515109dc88")],
)
def test_counts_and_ids_are_those_of_the_dense_build(params, digest):
    """Digests recorded from SIM_VERSION 2, which filled a dense matrix: the sparse build must not change
    a cached data set's contents (if it does on purpose, bump SIM_VERSION and record new digests)."""
    table, _, _ = simulate(params)
    counts = table.matrix_data.toarray()
    got = hashlib.sha256(counts.astype(np.int64).tobytes())
    got.update("\n".join([*table.ids(axis="observation"), *table.ids()]).encode())
    assert got.hexdigest()[:16] == digest
    assert table.matrix_data.nnz == np.count_nonzero(counts)  # no stored zeros in table.biom
    assert (counts.sum(0) >= 1).all()


@pytest.mark.parametrize("n_samples", [3, 64, 195, 203])  # a lone block, one, a merged tail, a short tail
def test_composition_score_is_the_dense_sum_bit_for_bit(n_samples):
    """Equal, not close, to SIM_VERSION 2's sum over a dense C-ordered matrix: metadata.tsv holds repr."""
    rng = np.random.default_rng(n_samples)
    dense = rng.integers(1, 1000, size=(97, n_samples)) * (rng.random((97, n_samples)) < 0.2)
    dense[0] = 1  # no empty sample
    tip_trait = rng.normal(size=97)
    expected = tip_trait @ (dense / dense.sum(0, keepdims=True))
    assert np.array_equal(composition_score(sparse.csc_matrix(dense), tip_trait), expected)


def test_held_out_samples_come_from_the_same_world_and_are_new():
    """simulate_heldout: the data set's ASVs (the same sequences in the same order) and environments, other
    samples (ids T...), the same ones for the same seed; the data set itself is not changed by them."""
    table, _, rows = simulate(SMALL)
    heldout, heldout_rows = simulate_heldout(SMALL, 30, seed=1)
    assert list(heldout.ids("observation")) == list(table.ids("observation"))
    assert [r[0] for r in heldout_rows] == list(heldout.ids()) == [f"T{i:04d}" for i in range(1, 31)]
    assert {r[1] for r in heldout_rows} <= {r[1] for r in rows}
    assert not np.allclose([r[2] for r in heldout_rows[:10]], [r[2] for r in rows[:10]])
    again, again_rows = simulate_heldout(SMALL, 30, seed=1)
    assert again == heldout and again_rows == heldout_rows
    assert simulate_heldout(SMALL, 30, seed=2)[0] != heldout
    # the target is the same function of the counts: its correlation with the composition score holds
    score = composition_score(heldout.matrix_data.tocsc(), trait_of_tips(SMALL))
    assert np.corrcoef(score, [r[2] for r in heldout_rows])[0, 1] > 0.9


def trait_of_tips(params: SimParams) -> np.ndarray:
    return simulate_world(params, np.random.default_rng(params.seed)).tip_trait
