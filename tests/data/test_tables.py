"""Readers of the user's files, tokenization and rarefaction, with the errors that name the fix."""

import biom
import h5py
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from aamperf.data.samples import rarefy_chunk
from aamperf.data.tables import (
    existing_file,
    observation_sequences,
    read_table,
    read_target,
    read_unifrac,
)
from aamperf.data.tokenize import count_real_tokens, tokenize_sequences
from aamperf.data.trees import read_tree
from aamperf.errors import UserError
from aamperf.tokens import START

IDS = ["s1", "s2", "s3"]
MATRIX = np.array([[0.0, 0.25, 0.5], [0.25, 0.0, 0.75], [0.5, 0.75, 0.0]])


def small_table() -> biom.Table:
    counts = np.array([[5, 0, 3], [1, 2, 0], [0, 7, 9], [4, 1, 1]])
    return biom.Table(counts, observation_ids=["AC", "GT", "ACGT", "TTGA"], sample_ids=IDS)


def test_biom_round_trip_hdf5_and_json(tmp_path):
    table = small_table()
    with h5py.File(tmp_path / "t.biom", "w") as f:
        table.to_hdf5(f, generated_by="test")
    (tmp_path / "t.json").write_text(table.to_json("test"))
    for name in ("t.biom", "t.json"):
        back = read_table(tmp_path / name)
        assert list(back.ids()) == IDS
        assert list(back.ids(axis="observation")) == ["AC", "GT", "ACGT", "TTGA"]
        np.testing.assert_array_equal(back.matrix_data.toarray(), table.matrix_data.toarray())


def test_unreadable_or_missing_files_name_the_option(tmp_path):
    (tmp_path / "bad.biom").write_text("not a biom table")
    with pytest.raises(UserError, match=r"^data\.table: cannot read .*bad\.biom as a BIOM table"):
        read_table(tmp_path / "bad.biom")
    with pytest.raises(UserError, match=r"^data\.table: no such file: x\.biom$"):
        existing_file("x.biom", "data.table")
    (tmp_path / "bad.nwk").write_text("((a,b);")
    with pytest.raises(UserError, match=r"^data\.tree: cannot read"):
        read_tree(tmp_path / "bad.nwk")


def test_fractional_counts_are_refused(tmp_path):
    with h5py.File(tmp_path / "rel.biom", "w") as f:
        biom.Table(np.array([[0.5, 1.0], [0.5, 0.0]]), ["A", "C"], ["s1", "s2"]).to_hdf5(f, "test")
    with pytest.raises(UserError, match="non-negative integer counts"):
        read_table(tmp_path / "rel.biom")


def test_tokens_follow_the_aam_vocabulary():
    tokens = tokenize_sequences(["ACGT", "acgtn", "G" * 160, "ARYN"])
    assert tokens.shape == (4, 151) and tokens.dtype == torch.uint8
    assert tokens[0, :6].tolist() == [START, 1, 2, 3, 4, 0]
    assert tokens[1, :6].tolist() == [START, 1, 2, 3, 4, 0]  # lower case read, N -> pad
    assert tokens[2, 1:].tolist() == [3] * 150  # truncated to 150 bp
    assert tokens[3, :5].tolist() == [START, 1, 0, 0, 0]  # ambiguous IUPAC letters -> pad
    assert count_real_tokens(tokens).tolist() == [4, 4, 150, 1]
    with pytest.raises(ValueError, match="'-'"):
        tokenize_sequences(["AC-GT"])


def test_observation_ids_that_are_not_sequences_need_a_fasta(tmp_path):
    # one alphabet for ids and FASTA records: A/C/G/T and the ambiguous IUPAC letters
    assert observation_sequences(["acgt", "NACG", "ACGTRY"], None) == ["ACGT", "NACG", "ACGTRY"]
    with pytest.raises(UserError, match=r"^data\.sequences: 1 observation ids .* \(e\.g\. 'OTU_0':"):
        observation_sequences(["ACGT", np.str_("OTU_0")], None)  # biom's ids: shown as plain strings
    fasta = tmp_path / "seqs.fasta"
    fasta.write_text(">feat1 some description\nACGTR\nacgt\n>feat2\nTTTT\n")
    assert observation_sequences(["feat2", "feat1"], fasta) == ["TTTT", "ACGTRACGT"]
    with pytest.raises(UserError, match=r"^data\.sequences: 1 of 2 .* \(e\.g\. 'feat3'\)"):
        observation_sequences(["feat1", "feat3"], fasta)
    fasta.write_text(">feat1\nAC12\n")
    with pytest.raises(UserError, match=r"^data\.sequences: 1 records .* not nucleotide"):
        observation_sequences(["feat1"], fasta)


def test_target_column_is_read_as_numbers(tmp_path):
    path = tmp_path / "meta.tsv"
    path.write_text("#SampleID\tage\tsite\n#q2:types\tnumeric\tcategorical\ns1\t3.5\tgut\ns2\t\tgut\n")
    assert read_target(path, "age") == {"s1": 3.5}  # s2 has no value
    with pytest.raises(UserError, match=r"^data\.target: no column 'bmi' .*columns: age, site"):
        read_target(path, "bmi")
    with pytest.raises(UserError, match=r"^data\.target: column 'site' .* not numeric"):
        read_target(path, "site")


@pytest.mark.parametrize("layout", ["npy", "npy.ids", "h5", "ssu.h5", "csv", "tsv"])
def test_precomputed_unifrac_formats(tmp_path, layout):
    if layout.startswith("npy"):
        path = tmp_path / "dist.npy"
        np.save(path, MATRIX)
        sidecar = tmp_path / ("dist.ids.txt" if layout == "npy" else "dist.npy.ids.txt")
        sidecar.write_text("\n".join(IDS) + "\n")
    elif layout == "h5":
        path = tmp_path / "dist.h5"
        with h5py.File(path, "w") as f:
            f["matrix"], f["ids"] = MATRIX, np.array(IDS, dtype="S")
    elif layout == "ssu.h5":  # the unifrac package's ssu: variable-length string ids in `order`, fp32
        path = tmp_path / "dist.h5"
        with h5py.File(path, "w") as f:
            f["matrix"] = MATRIX.astype(np.float32)
            f.create_dataset("order", data=IDS, dtype=h5py.string_dtype())
    else:
        sep = "," if layout == "csv" else "\t"
        path = tmp_path / f"dist.{layout}"
        lines = [sep.join(["", *IDS])] + [
            sep.join([i, *map(str, row)]) for i, row in zip(IDS, MATRIX, strict=True)
        ]
        path.write_text("\n".join(lines) + "\n")
    matrix, ids = read_unifrac(path)
    assert ids == IDS
    np.testing.assert_allclose(matrix, MATRIX, rtol=1e-7 if layout == "ssu.h5" else 0)


def test_precomputed_unifrac_errors(tmp_path):
    with h5py.File(tmp_path / "dist.h5", "w") as f:  # the original AAM's own layout: no sample ids
        f["distances"] = MATRIX
    with pytest.raises(
        UserError, match=r"^data\.unifrac: .* holds datasets distances; .* `ids` \(or `order`"
    ):
        read_unifrac(tmp_path / "dist.h5")
    np.save(tmp_path / "dist.npy", MATRIX)
    with pytest.raises(UserError, match=r"^data\.unifrac: .* dist\.ids\.txt or dist\.npy\.ids\.txt"):
        read_unifrac(tmp_path / "dist.npy")
    (tmp_path / "dist.ids.txt").write_text("s1\ns2\n")
    with pytest.raises(UserError, match=r"^data\.unifrac: .* \(3, 3\) matrix for 2 ids"):
        read_unifrac(tmp_path / "dist.npy")


def _with(change):
    matrix = MATRIX.astype(float).copy()
    change(matrix)
    return matrix


@pytest.mark.parametrize(
    ("matrix", "says"),
    [
        (_with(lambda m: m.__setitem__((0, 1), 0.9)), "not symmetric ('s1' x 's2': 0.9, but"),
        (-MATRIX, "a distance outside [0, 1] ('s1' x 's2': -"),
        (1.0 - MATRIX, "the distance of 's1' to itself is 1, not 0 (a similarity matrix?"),
        (
            _with(lambda m: m.__setitem__((1, 2), np.nan)),
            "a distance that is not a number ('s2' x 's3': nan)",
        ),
    ],
    ids=["asymmetric", "negative", "similarity", "nan"],
)
def test_a_matrix_that_is_not_a_unifrac_distance_matrix_is_refused_saying_where(tmp_path, matrix, says):
    np.save(tmp_path / "dist.npy", matrix)
    (tmp_path / "dist.ids.txt").write_text("\n".join(IDS) + "\n")
    with pytest.raises(UserError, match=r"^data\.unifrac: .* is not a UniFrac distance matrix: ") as refused:
        read_unifrac(tmp_path / "dist.npy")
    assert says in str(refused.value)


def test_qiita_and_insdc_missing_value_terms_are_read_as_missing(tmp_path):
    terms = ["Not applicable", "not collected", "Missing: Not provided", "missing: restricted access",
             "restricted access", "missing: third party data", "Missing: control sample", "NA", "n/a",
             "nan", " not provided ", ""]  # fmt: skip
    rows = "".join(f"m{i}\t{term}\n" for i, term in enumerate(terms))
    (tmp_path / "m.tsv").write_text(f"sample_name\tph\ns1\t7.25\n{rows}s2\t-1e3\n")
    assert read_target(tmp_path / "m.tsv", "ph") == {"s1": 7.25, "s2": -1000.0}
    (tmp_path / "m.tsv").write_text("sample_name\tph\ns1\t7.25\ns2\tunknown\n")  # not a term: a mistake
    with pytest.raises(UserError, match=r"column 'ph' of .* is not numeric \(sample 's2': 'unknown'\)"):
        read_target(tmp_path / "m.tsv", "ph")


def test_metadata_mistakes_are_refused_naming_the_fix(tmp_path):
    comma = tmp_path / "m.csv"
    comma.write_text("sample,age\ns1,3\ns2,4\n")
    with pytest.raises(UserError, match=r"comma-separated; aamperf reads tab-separated files \(TSV\)"):
        read_target(comma, "age")
    twice = tmp_path / "twice.tsv"
    twice.write_text("sample\tage\ns1\t3\ns2\t4\ns1\t5\n")
    with pytest.raises(
        UserError, match=r"sample ids listed more than once in .*: s1; keep one row per sample"
    ):
        read_target(twice, "age")
    infinite = tmp_path / "inf.tsv"
    infinite.write_text("sample\tage\ns1\t3\ns2\tinf\n")
    with pytest.raises(UserError, match=r"holds infinite values \(samples s2\)"):
        read_target(infinite, "age")


def test_rarefaction_depth_is_respected_and_shallow_samples_dropped():
    table = small_table()  # sample depths: 10, 10, 13
    counts, real_tokens = table.matrix_data.tocsc().astype(np.int64), np.ones(4)

    def rarefy(ids, depth, seed=0, max_asvs=4):
        cfg = OmegaConf.create({"rarefy_depth": depth, "seed": seed, "max_asvs": max_asvs})
        return rarefy_chunk(ids, counts[:, [IDS.index(sid) for sid in ids]], cfg, real_tokens)

    deep = rarefy(IDS, 11)
    assert deep.ids == ["s3"] and deep.too_shallow == ["s1", "s2"]
    chunk = rarefy(IDS, 6)
    assert [int(r.sum()) for r in chunk.reads] == [6, 6, 6]
    dense = counts.toarray()
    for j, (rows, reads) in enumerate(zip(chunk.rows, chunk.reads, strict=True)):
        assert (reads > 0).all() and (reads <= dense[rows, j]).all()  # drawn without replacement
    again = rarefy(IDS, 6)
    assert all(np.array_equal(a, b) for a, b in zip(again.reads, chunk.reads, strict=True))  # seeded
    # each sample its own draw: alone, or after other samples, it is rarefied the same (chunks, streams)
    alone = rarefy(["s3"], 6)
    assert np.array_equal(alone.reads[0], chunk.reads[2]) and np.array_equal(alone.rows[0], chunk.rows[2])
    other_seed = rarefy(IDS, 6, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(other_seed.reads, chunk.reads, strict=True))
    assert rarefy(IDS, 6, max_asvs=1).n_tokens.tolist() == [1, 1, 1]  # real tokens of the kept ASVs


def test_a_tree_with_a_repeated_tip_is_refused_saying_so(tmp_path):
    from skbio import TreeNode

    from aamperf.data.unifrac import compute_unifrac

    tree = TreeNode.read(["((o1:1,o2:1):1,(o1:1,o3:1):1);"])
    table = biom.Table(np.array([[1, 0], [0, 1], [1, 1]]), ["o1", "o2", "o3"], ["s1", "s2"])
    with pytest.raises(UserError, match=r"^data\.tree: 1 tip names appear more than once .* \(e\.g\. 'o1'\)"):
        compute_unifrac(table, tree)
