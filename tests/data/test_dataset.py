"""build_data end to end: batch layout, max_asvs, rarefaction, split, loaders, data=biom, errors."""

import json
import re

import biom
import h5py
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from skbio import TreeNode

from aamperf.config import DataConfig, DataloaderConfig
from aamperf.data import build_data
from aamperf.data.collate import Collate
from aamperf.data.samples import rarefy_sample, top_asvs
from aamperf.data.tables import read_table, read_target
from aamperf.data.unifrac import compute_unifrac
from aamperf.device import to_device
from aamperf.errors import UserError
from aamperf.trainer import BatchStream

SIM = {"n_samples": 40, "n_asvs": 64, "n_envs": 2, "mean_richness": 20, "depth": 2000, "rarefy_depth": 500}
LOADER = OmegaConf.structured(DataloaderConfig)


def rarefy(table: biom.Table, depth: int, seed: int) -> biom.Table:
    """The table rarefied sample by sample, as the data pipeline does (shallower samples dropped)."""
    matrix = table.matrix_data.toarray()
    drawn = {}
    for j, sid in enumerate(table.ids()):
        present = matrix[:, j] > 0
        reads = rarefy_sample(matrix[present, j], depth, seed, sid)
        if reads is not None:
            drawn[sid] = np.zeros(len(present), dtype=np.int64)
            drawn[sid][present] = reads
    kept = list(drawn)
    matrix = np.stack([drawn[sid] for sid in kept], axis=1)
    return biom.Table(matrix, observation_ids=list(table.ids(axis="observation")), sample_ids=kept)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def data_cfg(cache_dir, **overrides):
    base = {"cache_dir": str(cache_dir), "max_asvs": 32, "target": "target", **SIM, **overrides}
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base)


def decode(row: torch.Tensor) -> str:
    return "".join("?ACGT"[t] for t in row[1:].tolist() if t)


def test_batch_layout(cache_dir):
    data = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER)
    batch = next(iter(data.train_loader))
    assert set(batch) == {
        "tokens",
        "counts",
        "branches",  # batch UniFrac: the branch sets, turned into `unifrac` on the device
        "branch_lengths",
        "branch_rows",
        "target",
        "sample_idx",
        "asv_ids",
        "real_slots",  # where real ASVs lie (aamperf.model.slots.SlotIndex): no GPU read back to find them
        "unique_first",
        "unique_inverse",
        "n_real_slots",
        "n_samples",
        "n_tokens",
    }
    assert data.unifrac_mode == "batch"
    batch = to_device(batch, torch.device("cpu"))
    assert "branches" not in batch
    assert batch["tokens"].shape == (8, 32, 151) and batch["tokens"].dtype == torch.int64
    assert batch["counts"].shape == (8, 32, 1) and batch["counts"].dtype == torch.float32
    assert batch["unifrac"].shape == (8, 8) and batch["unifrac"].dtype == torch.float32
    assert batch["target"].shape == (8, 1) and batch["target"].dtype == torch.float32
    assert batch["sample_idx"].shape == (8,) and batch["sample_idx"].dtype == torch.int64
    assert batch["asv_ids"].shape == (8, 32) and batch["asv_ids"].dtype == torch.int64
    tokens, counts, asv_ids = batch["tokens"], batch["counts"], batch["asv_ids"]
    real = tokens[..., 0] != 0
    assert (tokens[real][:, 0] == 5).all() and (tokens[~real] == 0).all()  # padding rows are all zero
    # asv_ids: -1 exactly on padding, else the row of the token table the slot's tokens came from
    assert ((asv_ids >= 0) == real).all()
    assert torch.equal(data.collate.tokens[asv_ids[real]].long(), tokens[real])
    for b, s in enumerate(batch["sample_idx"].tolist()):
        assert asv_ids[b, real[b]].tolist() == data.dataset[s]["asv_idx"].tolist()
    assert asv_ids[real].unique().numel() < real.sum()  # samples share ASVs (what dedup exploits)
    assert ((counts[..., 0] > 0) == real).all()  # counts are 0 exactly on padding
    assert batch["n_tokens"] == int(((tokens >= 1) & (tokens <= 4)).sum())
    assert isinstance(batch["n_tokens"], int)
    # UniFrac: the sub-matrix of the whole rarefied data set's matrix for these samples
    table = rarefy(read_table(data.files["table"]), 500, seed=0)
    full = compute_unifrac(table, TreeNode.read(data.files["tree"]))
    idx = batch["sample_idx"].numpy()
    np.testing.assert_allclose(batch["unifrac"].numpy(), full[np.ix_(idx, idx)], atol=1e-6)
    targets = read_target(data.files["metadata"], "target")
    expected = [targets[data.sample_ids[i]] for i in idx]
    np.testing.assert_allclose(batch["target"][:, 0].numpy(), expected, rtol=1e-6)
    train_targets = [targets[data.sample_ids[i]] for i in data.train_loader.dataset.indices]
    assert data.target_mean == pytest.approx(np.mean(train_targets), rel=1e-5)
    assert data.has_target and data.n_train + data.n_val == len(table.ids())


def test_a_weighted_metric_gives_each_batch_its_samples_weighted_unifrac(cache_dir):
    """data.unifrac_metric=weighted_normalized from the tree: computed up front (precomputed, whatever
    data.unifrac_mode=null would give a tree), each batch's the sub-matrix of scikit-bio's."""
    data = build_data(
        data_cfg(cache_dir, unifrac_metric="weighted_normalized"), batch_size=8, seed=0, loader=LOADER
    )
    assert data.unifrac_mode == "precomputed"
    batch = to_device(next(iter(data.train_loader)), torch.device("cpu"))
    table = rarefy(read_table(data.files["table"]), 500, seed=0)
    tree = TreeNode.read(data.files["tree"])
    weighted = compute_unifrac(table, tree, "weighted_normalized")
    idx = batch["sample_idx"].numpy()
    np.testing.assert_allclose(batch["unifrac"].numpy(), weighted[np.ix_(idx, idx)], atol=1e-6)
    unweighted = compute_unifrac(table, tree)[np.ix_(idx, idx)]
    assert np.abs(batch["unifrac"].numpy() - unweighted).max() > 0.05  # another metric


def test_max_asvs_keeps_the_most_abundant(cache_dir):
    data = build_data(data_cfg(cache_dir, max_asvs=5), batch_size=4, seed=0, loader=LOADER)
    table = rarefy(read_table(data.files["table"]), 500, seed=0)
    batch = next(iter(data.val_loader))
    for b, s in enumerate(batch["sample_idx"].tolist()):
        column = table.data(data.sample_ids[s])
        kept = batch["counts"][b, :, 0]
        assert kept.tolist() == sorted(column, reverse=True)[:5]  # most abundant first
        for row, count in zip(batch["tokens"][b], kept.tolist(), strict=True):  # the right ASVs
            assert table.get_value_by_ids(decode(row), data.sample_ids[s]) == count
    used = torch.cat([item["asv_idx"] for item in data.dataset]).unique()
    assert data.n_asvs == len(used)
    assert data.n_asvs < len(table.ids(axis="observation"))  # ASVs only in the cut tail are not counted
    assert data.collate.tokens.shape[0] == len(table.ids(axis="observation"))  # every one tokenized


def test_ties_are_broken_by_table_order():
    rows, counts = top_asvs(np.array([3, 1, 2, 0]), np.array([5, 5, 7, 1]), 3)
    assert rows.tolist() == [2, 1, 3] and counts.tolist() == [7, 5, 5]


def test_rarefaction_depth_respected_and_shallow_samples_dropped(cache_dir, caplog):
    data = build_data(
        data_cfg(cache_dir, max_asvs=200, rarefy_depth=2000), batch_size=4, seed=0, loader=LOADER
    )
    depths = read_table(data.files["table"]).sum(axis="sample")
    assert 0 < data.n_train + data.n_val == (depths >= 2000).sum() < len(depths)
    assert all(item["counts"].sum() == 2000 for item in data.dataset)
    shallow = int((depths < 2000).sum())  # left out, and said: as predict counts its `too_shallow`
    assert data.counts["samples_too_shallow"] == shallow
    assert f"{shallow} of {len(depths)} samples have fewer reads than data.rarefy_depth=2000" in caplog.text


def test_data_seed_fixes_the_split_and_seed_the_batch_order(cache_dir):
    def build(seed, data_seed):
        data = build_data(data_cfg(cache_dir, seed=data_seed), batch_size=8, seed=seed, loader=LOADER)
        train = set(data.train_loader.dataset.indices)
        val = set(data.val_loader.dataset.indices)
        assert not train & val and len(train | val) == len(data.sample_ids)
        order = [b["sample_idx"].tolist() for b in data.train_loader][:2]
        counts = [item["counts"].tolist() for item in data.dataset]  # after rarefaction
        return order, sorted(val), counts

    order, val, counts = build(seed=0, data_seed=0)
    assert build(seed=0, data_seed=0) == (order, val, counts)
    other_run = build(seed=1, data_seed=0)  # another run of a sweep: the same data, another order
    assert other_run[1:] == (val, counts) and other_run[0] != order
    other_data = build(seed=0, data_seed=1)
    assert other_data[1] != val and other_data[2] != counts


def test_batch_order_is_the_same_with_and_without_workers(cache_dir):
    """Pairing runs by seed needs the same batches whatever the loader: over several passes too
    (torch draws worker seeds from the loader's generator, differently with persistent workers)."""
    workers = OmegaConf.merge(LOADER, {"num_workers": 1, "persistent_workers": True, "prefetch_factor": 2})
    orders = []
    for loader in (LOADER, workers):
        data = build_data(data_cfg(cache_dir), batch_size=8, seed=3, loader=loader)
        stream = BatchStream(data.train_loader)
        per_pass = len(stream.loader)
        orders.append([next(stream)["sample_idx"].tolist() for _ in range(3 * per_pass)])
    assert orders[0] == orders[1]
    assert orders[0][:per_pass] != orders[0][per_pass : 2 * per_pass]  # each pass is shuffled anew


def test_small_val_set_is_one_batch_and_too_small_is_an_error(cache_dir):
    data = build_data(data_cfg(cache_dir, val_fraction=0.1), batch_size=16, seed=0, loader=LOADER)
    assert data.n_val < 16
    assert [len(b["sample_idx"]) for b in data.val_loader] == [data.n_val]
    assert len(data.train_loader) == data.n_train // 16  # drop_last
    with pytest.raises(UserError, match=r"only 0 validation samples .* raise data\.val_fraction"):
        build_data(data_cfg(cache_dir, val_fraction=0.0), batch_size=4, seed=0, loader=LOADER)


def test_validation_batches_keep_their_size_when_the_training_batch_changes(cache_dir):
    """trainer.val_batch_size: batch 16 validated in batches of 8 holds batch 8's val batches, pair for pair
    (the UniFrac part of a val loss), and the batch-size finder's new loaders keep it."""
    from aamperf.data.dataset import rebatch

    def val_batches(data):
        return [b["sample_idx"].tolist() for b in data.val_loader]

    b8 = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER)
    b16 = build_data(data_cfg(cache_dir), batch_size=16, seed=0, loader=LOADER, val_batch_size=8)
    assert b16.train_loader.batch_size == 16 and val_batches(b16) == val_batches(b8)
    assert len(val_batches(b8)[0]) == 8
    rebatch(b16, 4, seed=0, loader=LOADER)
    assert b16.train_loader.batch_size == 4 and val_batches(b16) == val_batches(b8)
    unset = build_data(data_cfg(cache_dir), batch_size=16, seed=0, loader=LOADER)
    assert unset.val_loader.batch_size == min(16, unset.n_val)  # null: the training batch


def test_collate_pad_to_none_pads_to_the_longest_sample():
    collate = Collate(torch.full((3, 151), 5, dtype=torch.uint8), torch.eye(2), pad_to=None)
    items = [
        {"asv_idx": torch.tensor([0, 2]), "counts": torch.tensor([4.0, 1.0]), "sample_idx": 1, "n_tokens": 7},
        {"asv_idx": torch.tensor([1]), "counts": torch.tensor([9.0]), "sample_idx": 0, "n_tokens": 3},
    ]
    batch = collate(items)
    assert batch["tokens"].shape == (2, 2, 151)
    assert batch["counts"][:, :, 0].tolist() == [[4.0, 1.0], [9.0, 0.0]]
    assert batch["asv_ids"].tolist() == [[0, 2], [1, -1]]
    assert batch["unifrac"].tolist() == [[1.0, 0.0], [0.0, 1.0]] and batch["n_tokens"] == 10


def test_build_data_pads_to_the_longest_sample_or_to_a_given_width(cache_dir):
    longest = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER, pad_to=None)
    widths = []
    for batch in longest.train_loader:
        lengths = (batch["asv_ids"] >= 0).sum(dim=1)
        assert batch["tokens"].shape[1] == batch["asv_ids"].shape[1] == int(lengths.max())
        widths.append(int(lengths.max()))
    assert min(widths) < 32  # some batches are shorter than data.max_asvs
    fixed = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER)
    assert (fixed.collate.pad_to, longest.collate.pad_to) == (32, None)
    wide = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER, pad_to=40)
    assert next(iter(wide.val_loader))["asv_ids"].shape == (8, 40)
    with pytest.raises(ValueError, match=r"'bucket', None or an int >= data\.max_asvs=32"):
        build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER, pad_to=16)


def test_worker_options_reach_the_loader(cache_dir):
    loader = OmegaConf.merge(LOADER, {"num_workers": 1, "prefetch_factor": 3, "persistent_workers": True})
    data = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=loader)
    assert (data.train_loader.num_workers, data.train_loader.prefetch_factor) == (1, 3)
    assert data.train_loader.persistent_workers and data.train_loader.drop_last
    assert next(iter(data.val_loader))["tokens"].shape == (8, 32, 151)


def test_biom_source_with_fasta_and_precomputed_unifrac(cache_dir, tmp_path):
    sim = build_data(data_cfg(cache_dir, unifrac_mode="precomputed"), batch_size=4, seed=0, loader=LOADER)
    assert sim.unifrac_mode == "precomputed" and "branches" not in next(iter(sim.train_loader))
    table = read_table(sim.files["table"])
    seqs = list(table.ids(axis="observation"))
    renamed = table.update_ids({s: f"asv{i}" for i, s in enumerate(seqs)}, axis="observation", inplace=False)
    with h5py.File(tmp_path / "t.biom", "w") as f:
        renamed.to_hdf5(f, "test")
    longer = {3: seqs[3] + "T" * 30}  # 180 bases: the model reads the first 150, as the table's own id
    (tmp_path / "s.fasta").write_text("".join(f">asv{i}\n{longer.get(i, s)}\n" for i, s in enumerate(seqs)))
    ids = sim.sample_ids[::-1]  # another order than the table's; a subset is enough for the kept samples
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["matrix"] = sim.collate.unifrac.numpy()[::-1, ::-1].astype(np.float64)
        f["ids"] = np.array(ids, dtype="S")
    cfg = data_cfg(
        cache_dir,
        source="biom",
        table=str(tmp_path / "t.biom"),
        unifrac=str(tmp_path / "d.h5"),
        sequences=str(tmp_path / "s.fasta"),
        target=None,
    )
    data = build_data(cfg, batch_size=4, seed=0, loader=LOADER)
    assert data.unifrac_mode == "precomputed"  # the matrix given: no tree, no batch mode
    assert not data.has_target and not data.unifrac_cached and data.files["sequences"].endswith("s.fasta")
    assert data.sample_ids == sim.sample_ids
    assert data.collate.unifrac.equal(sim.collate.unifrac)
    assert data.collate.tokens.equal(sim.collate.tokens)
    assert (data.counts["sequences_cut"], data.counts["longest_sequence_bp"]) == (1, 180)
    assert sim.counts["sequences_cut"] == 0 and sim.counts["longest_sequence_bp"] == 150
    assert "target" not in next(iter(data.train_loader))
    (tmp_path / "d.h5").unlink()
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["matrix"], f["ids"] = np.zeros((2, 2)), np.array(sim.sample_ids[:2], dtype="S")
    with pytest.raises(UserError, match=r"^data\.unifrac: \d+ of \d+ samples of data\.table are not in"):
        build_data(cfg, batch_size=4, seed=0, loader=LOADER)
    with pytest.raises(UserError, match=r"^data\.sequences: \d+ observation ids of data\.table are not DNA"):
        build_data(OmegaConf.merge(cfg, {"sequences": None}), batch_size=4, seed=0, loader=LOADER)


@pytest.mark.parametrize(
    ("overrides", "batch_size", "message"),
    [
        ({}, 1, r"^trainer\.batch_size must be >= 2 \(UniFrac compares pairs of samples\)$"),
        (
            {"source": "biom", "table": "x.biom", "tree": "t.nwk", "target": None},
            4,
            r"^data\.table: no such file: x\.biom$",
        ),
        ({"rarefy_depth": 10**6}, 4, r"^data\.rarefy_depth=1000000: no sample"),
        ({"val_fraction": 0.98}, 4, r"training samples, fewer than trainer\.batch_size=4"),
    ],
)
def test_errors_name_the_fix(cache_dir, overrides, batch_size, message):
    """What is found as the files are read; what the config alone decides: tests/data/test_checks.py."""
    with pytest.raises(UserError, match=message):
        build_data(data_cfg(cache_dir, **overrides), batch_size=batch_size, seed=0, loader=LOADER)


def test_samples_without_a_target_are_counted_and_left_out(cache_dir, tmp_path, caplog):
    import pandas as pd

    files = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER).files
    metadata = pd.read_csv(files["metadata"], sep="\t", index_col=0, dtype={"target": object})
    # 5 samples without a value: left empty, or marked missing as Qiita and the INSDC do
    metadata.iloc[:5, metadata.columns.get_loc("target")] = [None, "Not applicable", "missing: not collected",
                                                              "not provided", "NA"]  # fmt: skip
    metadata.to_csv(tmp_path / "m.tsv", sep="\t")
    biom = {
        "source": "biom",
        "table": files["table"],
        "tree": files["tree"],
        "metadata": str(tmp_path / "m.tsv"),
    }
    data = build_data(data_cfg(cache_dir, **biom), batch_size=8, seed=0, loader=LOADER)
    assert data.samples_without_target == 5
    assert data.n_train + data.n_val == len(metadata) - 5
    assert f"5 of {len(metadata)} samples have no 'target' in data.metadata" in caplog.text


@pytest.mark.slow  # ~11 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_what_reading_the_data_leaves_out_or_changes_is_warned_in_train_log_and_counted(
    cache_dir, tmp_path, launch
):
    """A run as a user starts it, on the files of DADA2 / Qiita / Greengenes habits: tips `ASV_1`
    unquoted, an internal branch without a length, a metadata value 'not collected', two samples below
    data.rarefy_depth, an ASV longer than the model's 150 bases."""
    import pandas as pd

    files = build_data(data_cfg(cache_dir), batch_size=8, seed=0, loader=LOADER).files
    table = read_table(files["table"])
    seqs = [str(s) for s in table.ids(axis="observation")]
    counts = table.matrix_data.toarray()
    counts[:, :2] //= 40  # 2000 reads -> 50: below the run's data.rarefy_depth=500
    ids = [f"ASV_{i}" for i in range(len(seqs))]
    with h5py.File(tmp_path / "t.biom", "w") as f:
        biom.Table(counts, observation_ids=ids, sample_ids=list(table.ids())).to_hdf5(f, "test")
    longer = {0: seqs[0] + "ACGT" * 15}  # 210 bases
    fasta = [f">{asv}\n{longer.get(k, seq)}\n" for k, (asv, seq) in enumerate(zip(ids, seqs, strict=True))]
    (tmp_path / "s.fasta").write_text("".join(fasta))
    newick = open(files["tree"]).read()
    for seq, asv in zip(seqs, ids, strict=True):
        newick = newick.replace(f"{seq}:", f"{asv}:")  # unquoted, as DADA2 / FastTree / ape write them
    newick, n = re.subn(r"\):[0-9.e-]+", ")", newick, count=1)  # an internal node without a length
    assert n == 1 and "ASV_3:" in newick
    (tmp_path / "t.nwk").write_text(newick)
    metadata = pd.read_csv(files["metadata"], sep="\t", index_col=0, dtype=str)
    metadata.iloc[5, metadata.columns.get_loc("target")] = "not collected"
    metadata.to_csv(tmp_path / "m.tsv", sep="\t")
    names = {"table": "t.biom", "tree": "t.nwk", "sequences": "s.fasta", "metadata": "m.tsv"}
    given = [f"data.{option}={tmp_path / name}" for option, name in names.items()]
    for run in ("first", "cached"):  # the store built, then read: the same warnings and counts
        proc, run_dir = launch("data=biom", *given, "data.target=target", name=run)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = (run_dir / "train.log").read_text()
        n = len(metadata)
        assert f"1 of {n} samples have no 'target' in data.metadata" in log
        assert f"2 of {n - 1} samples have fewer reads than data.rarefy_depth=500: left out" in log
        assert f"1 of {len(ids)} ASV sequences of data.table are longer than the model reads" in log
        assert "(longest: 210 bases): cut to their first 150 (model.seq_len=151 is START and 150" in log
        assert f"data.tree: 1 branches of {tmp_path / 't.nwk'} have no length: read as 0" in log
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["samples_cached"] == (run == "cached")
        assert summary["target"]["samples_without_target"] == 1
        assert (summary["samples_too_shallow"], summary["sequences_cut"]) == (2, 1)
        assert (summary["longest_sequence_bp"], summary["tree_lengths_missing"]) == (210, 1)
        assert summary["n_train"] + summary["n_val"] == n - 3
