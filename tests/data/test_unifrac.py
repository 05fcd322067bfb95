"""UniFrac: equal to scikit-bio and to a hand computation, cached on disk (one process builds a missing
entry, the others wait for it), errors that name the fix."""

import fcntl
import io
import json
import os
import subprocess
import sys
import time

import biom
import numpy as np
import pytest
from omegaconf import OmegaConf
from skbio import TreeNode
from skbio.diversity import beta_diversity

from aamperf.config import DataConfig, DataloaderConfig
from aamperf.data import build_data
from aamperf.data.store import build_store, store_key
from aamperf.data.tables import resolve_files
from aamperf.data.unifrac import cached_unifrac, compute_unifrac, select_unifrac
from aamperf.errors import UserError

NEWICK = "((a:1,b:2)ab:0.5,(c:3,d:4)cd:1.5)root;\n"
# S1 = {a, b}, S2 = {a, c}, S3 = {d}; counts do not matter to unweighted UniFrac
TABLE = biom.Table(
    np.array([[3, 1, 0], [2, 0, 0], [0, 5, 0], [0, 0, 7]]), ["a", "b", "c", "d"], ["S1", "S2", "S3"]
)
# unique branch length / branch length observed in either sample:
# S1-S2: (a+b+ab+c+cd - a-ab) / 8 = 6.5/8; S1-S3: all unique = 1; S2-S3: (10 - cd) / 10 = 8.5/10
HAND = np.array([[0.0, 0.8125, 1.0], [0.8125, 0.0, 0.85], [1.0, 0.85, 0.0]])


# weighted, normalized: sum over branches of length x |share of A's reads below it - share of B's|, over
# sum over tips of root distance x (A's share + B's share). Root distances a 1.5, b 2.5, c 4.5, d 5.5.
# S1 (a .6, b .4) - S2 (a 1/6, c 5/6): (1 x 13/30 + 2 x .4 + .5 x 5/6 + 3 x 5/6 + 1.5 x 5/6) / (1.9 + 4)
# = 5.4 / 5.9;
# S1 - S3 (d): nothing shared, 1; S2 - S3: (1/6 + .5/6 + 2.5 + 1.5/6 + 4) / (4 + 5.5) = 7 / 9.5
WEIGHTED_HAND = np.array([[0.0, 5.4 / 5.9, 1.0], [5.4 / 5.9, 0.0, 7 / 9.5], [1.0, 7 / 9.5, 0.0]])


def tree() -> TreeNode:
    return TreeNode.read(io.StringIO(NEWICK))


def test_unifrac_equals_hand_computation_and_scikit_bio():
    matrix = compute_unifrac(TABLE, tree())
    np.testing.assert_allclose(matrix, HAND, atol=1e-12)
    direct = beta_diversity(
        "unweighted_unifrac",
        TABLE.matrix_data.T.toarray(),
        ids=["S1", "S2", "S3"],
        taxa=["a", "b", "c", "d"],
        tree=tree(),
    )
    np.testing.assert_allclose(matrix, direct.data, atol=1e-12)


def test_weighted_normalized_unifrac_equals_hand_computation_and_is_cached_apart(tmp_path):
    np.testing.assert_allclose(
        compute_unifrac(TABLE, tree(), "weighted_normalized"), WEIGHTED_HAND, atol=1e-12
    )
    (tmp_path / "t.nwk").write_text(NEWICK)
    unweighted, _, _ = cached_unifrac(TABLE, tmp_path / "t.nwk", tmp_path)
    weighted, cached, _ = cached_unifrac(TABLE, tmp_path / "t.nwk", tmp_path, "weighted_normalized")
    assert not cached  # not the unweighted matrix's entry
    np.testing.assert_allclose(unweighted, HAND, atol=1e-12)
    np.testing.assert_allclose(weighted, WEIGHTED_HAND, atol=1e-12)
    assert cached_unifrac(TABLE, tmp_path / "t.nwk", tmp_path, "weighted_normalized")[1]


def test_second_call_is_served_from_the_cache_file(tmp_path):
    (tmp_path / "t.nwk").write_text(NEWICK)
    matrix, cached, _ = cached_unifrac(TABLE, tmp_path / "t.nwk", tmp_path)
    assert not cached
    (cache_file,) = (tmp_path / "unifrac").glob("*.npz")
    assert len(cache_file.stem) == 64  # sha256
    # plant a different matrix in the cache file: the second call must return it, not recompute
    np.savez(cache_file, matrix=matrix * 0.5, ids=np.array(["S1", "S2", "S3"]))
    again, cached, _ = cached_unifrac(TABLE, tmp_path / "t.nwk", tmp_path)
    assert cached
    np.testing.assert_allclose(again, HAND * 0.5)
    # another tree text (one branch longer) is another cache entry
    (tmp_path / "t.nwk").write_text(NEWICK.replace("d:4", "d:5"))
    other, cached, _ = cached_unifrac(TABLE, tmp_path / "t.nwk", tmp_path)
    assert not cached
    assert other[1, 2] == pytest.approx(9.5 / 11)
    assert len(list((tmp_path / "unifrac").iterdir())) == 2  # no temp file left behind


def test_build_twice_serves_the_samples_and_unifrac_from_their_caches(tmp_path):
    cfg = OmegaConf.structured(DataConfig)
    overrides = {
        "cache_dir": str(tmp_path),
        "max_asvs": 16,
        "n_samples": 24,
        "n_asvs": 48,
        "mean_richness": 12,
        "depth": 1500,
        "rarefy_depth": 500,
    }
    cfg = OmegaConf.merge(cfg, overrides)
    loader = OmegaConf.structured(DataloaderConfig)

    def build(run_seed=0, **options):
        return build_data(OmegaConf.merge(cfg, options), batch_size=4, seed=run_seed, loader=loader)

    first = build()  # batch mode: the rarefied samples and their branch sets in one store file
    (store,) = (tmp_path / "samples").iterdir()
    mtime = (store / "index.npz").stat().st_mtime_ns
    second = build()
    assert (first.samples_cached, second.samples_cached) == (False, True)
    assert (store / "index.npz").stat().st_mtime_ns == mtime
    assert [item["branches"].tolist() for item in second.dataset] == [
        item["branches"].tolist() for item in first.dataset
    ]
    assert build(run_seed=1).samples_cached  # another run seed: the same data
    assert not build(max_asvs=8).samples_cached  # what a sample keeps changed: another store
    # precomputed: the n x n matrix, cached by the rarefied table's content and the tree
    first, second = build(unifrac_mode="precomputed"), build(unifrac_mode="precomputed")
    (cache_file,) = (tmp_path / "unifrac").glob("*.npz")
    assert (first.unifrac_cached, second.unifrac_cached) == (False, True)
    assert second.collate.unifrac.equal(first.collate.unifrac)
    # another data.seed: another simulation and rarefaction, other entries
    third = build(unifrac_mode="precomputed", seed=1)
    assert not third.unifrac_cached and not third.samples_cached
    assert len(list((tmp_path / "unifrac").glob("*.npz"))) == 2


def test_a_tree_with_underscored_tips_and_a_branch_without_a_length_is_read_and_counted(tmp_path, caplog):
    """The tree precomputed UniFrac reads: tips as written (ASV_1, unquoted), a missing length as 0,
    counted on every run, the cached one too."""
    table = TABLE.update_ids({o: f"ASV_{o}" for o in "abcd"}, axis="observation", inplace=False)
    (tmp_path / "t.nwk").write_text("((ASV_a:1,ASV_b:2)ab,(ASV_c:3,ASV_d:4)cd:1.5)root;\n")
    zero = TreeNode.read(["((ASV_a:1,ASV_b:2)ab:0,(ASV_c:3,ASV_d:4)cd:1.5)root;"], convert_underscores=False)
    expected = compute_unifrac(table, zero)
    assert expected[0, 1] == pytest.approx(6.5 / 7.5)  # S1-S2: b + c + cd of a b c cd (ab: 0)
    for served in (False, True):
        caplog.clear()
        matrix, cached, missing = cached_unifrac(table, tmp_path / "t.nwk", tmp_path)
        assert (cached, missing) == (served, 1)
        np.testing.assert_allclose(matrix, expected, atol=1e-12)
        assert "data.tree: 1 branches of " in caplog.text and "have no length: read as 0" in caplog.text


def test_tree_must_cover_every_asv():
    partial = TreeNode.read(io.StringIO("((a:1,b:2):0.5,c:3);"))
    with pytest.raises(
        UserError, match=r"^data\.tree: 1 of 4 ASVs of the table are not tips .* \(e\.g\. 'd'\)"
    ):
        compute_unifrac(TABLE, partial)


def test_precomputed_matrix_is_reordered_and_must_cover_samples():
    ids = ["S3", "S1", "S2"]
    order = [2, 0, 1]
    shuffled = HAND[np.ix_(order, order)]
    np.testing.assert_array_equal(select_unifrac(shuffled, ids, ["S1", "S2", "S3"]), HAND)
    with pytest.raises(UserError, match=r"^data\.unifrac: 1 of 3 samples .* \(e\.g\. 'S4'\)"):
        select_unifrac(shuffled, ids, ["S1", "S2", "S4"])


def test_a_store_built_by_worker_processes_is_the_one_built_in_process(tmp_path, monkeypatch):
    import aamperf.data.store as store

    cfg = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        {"cache_dir": str(tmp_path), "max_asvs": 16, "n_samples": 40, "n_asvs": 48, "mean_richness": 12},
    )
    loader = OmegaConf.structured(DataloaderConfig)
    monkeypatch.setattr(store, "CHUNK_SAMPLES", 7)  # 6 chunks, the last one short
    monkeypatch.setattr(store, "PARALLEL_FROM_CHUNKS", 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # 2 workers even on one core
    started = []
    real_pool = store.ProcessPoolExecutor
    monkeypatch.setattr(store, "ProcessPoolExecutor", lambda *a, **k: started.append(a) or real_pool(*a, **k))
    parallel = build_data(cfg, batch_size=4, seed=0, loader=loader)
    monkeypatch.setattr(store, "PARALLEL_FROM_CHUNKS", 100)
    here = build_data(
        OmegaConf.merge(cfg, {"cache_dir": str(tmp_path / "here")}), batch_size=4, seed=0, loader=loader
    )
    assert len(started) == 1 and started[0][0] == 2  # the first build had its workers, the second none
    assert parallel.sample_ids == here.sample_ids and len(here.sample_ids) > 30
    (a,), (b,) = (tmp_path / "samples").iterdir(), (tmp_path / "here" / "samples").iterdir()
    for name in ("rows", "reads", "branches"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


BUILD = """
import json, sys
from omegaconf import OmegaConf
from aamperf.config import DataConfig, DataloaderConfig
from aamperf.data import build_data
cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), json.loads(sys.argv[1]))
print("building", flush=True)
data = build_data(cfg, batch_size=4, seed=0, loader=OmegaConf.structured(DataloaderConfig))
print(json.dumps(data.samples_cached), flush=True)
"""


def test_a_process_finding_the_store_being_built_waits_and_reads_it(tmp_path):
    """What torchrun's ranks do on a first run: one builds the sample store; another, started with it,
    waits for it and reads that copy (where it would have built its own)."""
    overrides = {"cache_dir": str(tmp_path), "max_asvs": 16, "n_samples": 24, "n_asvs": 48}
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), overrides)
    files = resolve_files(cfg)
    path = tmp_path / "samples" / store_key(cfg, files, with_branches=True)  # batch mode: branch sets
    path.parent.mkdir()
    builder = os.open(path.parent, os.O_RDONLY)  # this process is the one building
    fcntl.flock(builder, fcntl.LOCK_EX)
    other = subprocess.Popen(
        [sys.executable, "-c", BUILD, json.dumps(overrides)], stdout=subprocess.PIPE, text=True
    )
    assert other.stdout.readline() == "building\n"
    time.sleep(1.0)  # the other is at the store now
    assert not path.exists()  # it waits: it has not built its own
    build_store(cfg, files, True, path)
    os.close(builder)
    out, _ = other.communicate(timeout=120)
    assert other.returncode == 0 and json.loads(out) is True  # it read the store this process built
