"""aamperf/data/checks.py: every problem of data.* the config and the file system decide, found before a run
reads any data, each naming its fix."""

import re

import pytest

from aamperf.data.checks import check_data


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data=biom"], r"^data\.source=biom needs data\.table=<file\.biom>$"),
        (["data=biom", "data.table=x.biom"], r"^data\.table: no such file: x\.biom$"),
        (["data=biom"], r"^data=biom needs exactly one of data\.tree=.* or data\.unifrac="),
        (["data=biom", "data.tree=t.nwk", "data.target=age"], r"^data\.target=age needs data\.metadata"),
        (["data.table=x.biom"], r"^data\.table is set but data\.source=simulated ignores it; add data=biom$"),
        (["data.n_envs=0"], r"^data\.n_envs=0 must be >= 1$"),
        (["data.val_fraction=1.0"], r"^data\.val_fraction=1\.0 must be between 0 and 1"),
        (["data.rarefy_depth=0"], r"^data\.rarefy_depth=0 must be >= 1"),
        (
            ["data=biom", "data.table=t.biom", "data.unifrac=d.npy", "data.unifrac_mode=batch"],
            r"data\.unifrac_mode=batch computes UniFrac from data\.tree; give data\.tree=<tree\.nwk>",
        ),
        (["data.val_fraction=0.02"], r"leaves 1 validation samples .*; raise data\.val_fraction$"),
        (["data.n_samples=12"], r"^data\.n_samples=12 leaves at most 10 training samples .* a batch of 16"),
        (
            ["data=biom", "data.unifrac={tmp}/d.npy"],
            r"d\.npy needs its sample ids, .* in d\.ids\.txt",
        ),
        (["data=biom", "data.unifrac={tmp}/d.parquet"], r"^data\.unifrac: unknown file type '\.parquet'"),
        (["data.target_transform=zscore_category"], r"name them, data\.normalize_by=\[<column>,\.\.\.\]$"),
        (
            ["data.target=target", "data.weight_by=[target]", "loss.category_weights=balanced"],
            r"is data\.target itself",
        ),
        (
            ["data.target=null", "data.weight_by=[environment]", "loss.category_weights=balanced"],
            r"and data\.target is null",
        ),
    ],
)
def test_what_the_config_decides_is_found_up_front(make_cfg, tmp_path, overrides, message):
    (tmp_path / "d.npy").write_bytes(b"")
    (tmp_path / "d.parquet").write_bytes(b"")
    cfg = make_cfg(*(o.format(tmp=tmp_path) for o in overrides), "trainer.batch_size=16")
    problems = check_data(cfg)
    assert any(re.search(message, problem) for problem in problems), problems
