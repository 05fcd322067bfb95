"""data.val_samples: the user's own validation samples (the original AAM's val_samples.txt) instead of the
seeded split by data.val_fraction; its refusals; the same split on every rank, in fine-tuning, for the
random forest, and on a resume."""

import os
import pickle
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import read_summary

from aamperf.checkpoint import check_resume, config_changes
from aamperf.data import build_data
from aamperf.data.checks import check_data
from aamperf.data.dataset import write_split
from aamperf.data.tables import resolve_files, table_ids
from aamperf.errors import UserError
from aamperf.run import train


def build(cfg, **kwargs):
    return build_data(
        cfg.data, batch_size=cfg.trainer.batch_size, seed=cfg.seed, loader=cfg.dataloader, **kwargs
    )


def ids_of(data, loader) -> list[str]:
    return [data.sample_ids[i] for i in loader.dataset.indices]


def listing(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(f"{sid}\n" for sid in ids))
    return path


class Payload:
    """Unpickled, it would create the directory `marker`: the file's bytes are only ever compared as ids."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def test_the_listed_samples_validate_and_every_other_sample_trains(make_cfg, tmp_path):
    every = build(make_cfg()).sample_ids
    listed = every[::3]  # 9 of the data's 26 samples (14 of the 40 simulated are too shallow)
    path = tmp_path / "val.txt"
    path.write_text("\r\n".join(reversed(listed)) + "\r\n\n")  # in any order, CRLF, a blank line
    cfg = make_cfg(f"data.val_samples={path}")
    data = build(cfg)
    assert ids_of(data, data.val_loader) == [sid for sid in every if sid in listed]  # in the data's order
    assert ids_of(data, data.train_loader) == [sid for sid in every if sid not in listed]
    assert (data.n_val, data.n_train, data.val_samples) == (9, len(every) - 9, str(path))
    # every rank of a distributed run reads the same file: the same split
    rank1 = build(cfg, rank=1, world_size=2)
    assert ids_of(rank1, rank1.val_loader) == ids_of(data, data.val_loader)
    assert ids_of(rank1, rank1.train_loader) == ids_of(data, data.train_loader)
    # the split as a run directory keeps it, read back: the same split again
    write_split(tmp_path, data)
    assert (tmp_path / "val_samples.txt").read_text().splitlines() == ids_of(data, data.val_loader)
    assert (tmp_path / "train_samples.txt").read_text().splitlines() == ids_of(data, data.train_loader)
    again = build(make_cfg(f"data.val_samples={tmp_path / 'val_samples.txt'}"))
    assert ids_of(again, again.train_loader) == ids_of(data, data.train_loader)


def test_without_a_file_the_split_is_the_seeded_one(make_cfg):
    data = build(make_cfg())
    n = len(data.sample_ids)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()  # data.seed=0
    n_val = round(n * 0.2)  # data.val_fraction
    assert list(data.val_loader.dataset.indices) == sorted(perm[:n_val])
    assert list(data.train_loader.dataset.indices) == sorted(perm[n_val:])
    assert data.val_samples is None


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, r"^data\.val_samples: no such file: \S+/val\.txt$"),
        (
            "\n  \n",
            r"^data\.val_samples: \S+ lists no sample id; give the validation sample ids, one per line$",
        ),
        (
            "S0001\nS0002\nS0001\nS0002\n",
            r"^data\.val_samples: \S+ lists 'S0001', 'S0002' more than once; list each validation sample "
            "once$",
        ),
    ],
    ids=["missing", "empty", "duplicates"],
)
def test_a_file_without_a_set_of_ids_is_refused_with_the_config(make_cfg, tmp_path, content, says):
    path = tmp_path / "val.txt"
    if content is not None:
        path.write_text(content)
    problems = check_data(make_cfg(f"data.val_samples={path}"))
    assert len(problems) == 1 and re.search(says, problems[0]), problems


def test_ids_the_data_has_not_are_named(make_cfg, tmp_path):
    cfg = make_cfg()
    every = build(cfg).sample_ids
    shallow = [sid for sid in table_ids(resolve_files(cfg.data)["table"]) if sid not in every]
    assert shallow  # a few simulated samples have fewer reads than data.rarefy_depth
    path = listing(tmp_path / "val.txt", [shallow[0], "nope", "$(rm -rf /)", "S9", *every[:4]])
    says = (
        f"data.val_samples: 4 of the 8 ids in {path} are not among the {len(every)} samples of the data "
        f"('{shallow[0]}', 'nope', '$(rm -rf /)' and 1 more); 1 of them were left out by rarefaction "
        "(data.rarefy_depth=500); list only samples of the data"
    )
    with pytest.raises(UserError) as refused:
        build(make_cfg(f"data.val_samples={path}"))
    assert str(refused.value) == says


def test_a_payload_is_only_unknown_ids(make_cfg, tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "val.pkl"
    path.write_bytes(pickle.dumps(Payload(marker), protocol=0) + pickle.dumps(Payload(marker)))
    with pytest.raises(
        UserError, match=r"^data\.val_samples: \d+ of the \d+ ids in \S+ are not among the "
    ) as e:
        build(make_cfg(f"data.val_samples={path}"))
    assert "\n" not in str(e.value) and not marker.exists()


@pytest.mark.parametrize(
    ("chosen", "says"),
    [
        (lambda every: every[:1], r"^only 1 validation samples \(UniFrac needs >= 2 per batch\); list more "),
        (
            lambda every: every[2:],
            r"^only 2 training samples, fewer than trainer\.batch_size=4; lower trainer\.batch_size, list "
            r"fewer samples in data\.val_samples=\S+, or give more samples$",
        ),
    ],
    ids=["one to validate", "too few to train"],
)
def test_too_small_a_side_names_the_file(make_cfg, tmp_path, chosen, says):
    path = listing(tmp_path / "val.txt", chosen(build(make_cfg()).sample_ids))
    with pytest.raises(UserError, match=says):
        build(make_cfg(f"data.val_samples={path}"))


def test_the_command_line_refuses_unknown_ids_in_one_line(make_cfg, launch_here, tmp_path):
    every = build(make_cfg()).sample_ids
    path = listing(tmp_path / "val.txt", ["nope", *every[:3]])
    proc, run_dir = launch_here(f"data.val_samples={path}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1] == (
        f"error: data.val_samples: 1 of the 4 ids in {path} are not among the {len(every)} samples of the "
        "data ('nope'); list only samples of the data"
    )
    assert "Traceback" not in proc.stderr and not (run_dir / "metrics.jsonl").exists()


def test_fine_tuning_and_its_forest_train_on_the_others_and_validate_on_the_listed(
    make_cfg, pretrained, tmp_path
):
    every = build(make_cfg()).sample_ids
    listed = every[1:17:2]  # 8: two validation batches of 4, every one of them validated
    path = listing(tmp_path / "val.txt", listed)
    settings = ["data.target=target", "trainer.val_batches=2", "metrics.rf_baseline=true"]
    cfg = make_cfg(f"init.from_run={pretrained}", f"data.val_samples={path}", *settings)
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "completed"
    assert (summary["n_train"], summary["n_val"]) == (len(every) - 8, 8)
    predicted = pd.read_csv(tmp_path / "run" / "val_predictions.tsv", sep="\t", dtype={"sample_id": str})
    assert sorted(predicted["sample_id"]) == sorted(listed)
    # the target's transform is fitted on the training samples only
    metadata = pd.read_csv(resolve_files(cfg.data)["metadata"], sep="\t", index_col="sample_id")
    trained = metadata.loc[[sid for sid in every if sid not in listed], "target"].to_numpy()
    assert summary["target"]["shift"] == pytest.approx(np.mean(trained))
    assert summary["target"]["scale"] == pytest.approx(np.std(trained, ddof=1))
    forest = summary["rf_baseline"]  # on the run's split: the same samples
    assert (forest["n_train"], forest["n_val"]) == (len(every) - 8, 8)
    assert read_summary(tmp_path / "run")["config"]["data"]["val_samples"] == str(path)


@pytest.mark.parametrize(("saved", "now"), [("a.txt", "b.txt"), (None, "a.txt"), ("a.txt", None)])
def test_a_resume_keeps_the_split(saved, now):
    changes = config_changes({"data": {"val_samples": saved}}, {"data": {"val_samples": now}})
    with pytest.raises(
        UserError, match=rf"^cannot resume from ckpt with data\.val_samples={now} \(checkpoint: "
    ):
        check_resume(Path("ckpt"), changes)
    # a checkpoint of a version before data.val_samples: the same (seeded) split, nothing changed
    assert config_changes({"data": {}}, {"data": {"val_samples": None}}) == {}
