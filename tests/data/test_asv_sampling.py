"""data.asv_sampling: which ASVs of a sample with more than max_asvs the model reads (the most abundant, the
first in the table's order, or a new random draw each pass), the same in every process and on a resume; and
predict's passes over random draws (their mean and spread)."""

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import losses
from hydra.utils import instantiate
from test_predict_targets import predicted_here

from aamperf.data import build_data
from aamperf.data.samples import sample_asvs, top_asvs
from aamperf.errors import UserError
from aamperf.predict.masks import hidden_bases, sequence_keys
from aamperf.predict.target import in_own_units, read_saved_target
from aamperf.run import train
from aamperf.trainer.cached import why_not
from aamperf.weights import load_model, read_model_file

ROWS = np.array([2, 5, 7, 11, 13, 17, 19, 23], dtype=np.int32)  # a sample's observations, table order
COUNTS = np.array([4, 9, 1, 9, 30, 2, 7, 5], dtype=np.int32)


def test_each_way_keeps_max_asvs_of_the_sample_most_abundant_first():
    assert [r.tolist() for r in sample_asvs(ROWS, COUNTS, 3, "abundance", (0, 1, 0))] == [
        [13, 5, 11],
        [30, 9, 9],
    ]
    assert [r.tolist() for r in sample_asvs(ROWS, COUNTS, 3, "first", (0, 1, 0))] == [[5, 2, 7], [9, 4, 1]]
    draws = [sample_asvs(ROWS, COUNTS, 3, "random", (0, 1, draw)) for draw in range(20)]
    for rows, counts in draws:
        assert len(set(rows.tolist())) == 3 and set(rows.tolist()) <= set(ROWS.tolist())
        assert counts.tolist() == [COUNTS[ROWS.tolist().index(r)] for r in rows]  # each row's own count
        assert list(counts) == sorted(counts, reverse=True)
    assert len({tuple(rows.tolist()) for rows, _ in draws}) > 5  # draws differ
    again = sample_asvs(ROWS, COUNTS, 3, "random", (0, 1, 7))
    assert np.array_equal(again[0], draws[7][0])  # a key is one draw, in any process
    for how in ("abundance", "first", "random"):  # a sample within max_asvs keeps every ASV
        rows, counts = sample_asvs(ROWS, COUNTS, 8, how, (0, 1, 3))
        assert [rows.tolist(), counts.tolist()] == [r.tolist() for r in top_asvs(ROWS, COUNTS, 8)]


def rows_of(batch: dict) -> dict[int, list[int]]:
    """Each sample's ASVs in a batch: {sample index: its asv_ids, padding left out}."""
    pairs = zip(batch["sample_idx"].tolist(), batch["asv_ids"].tolist(), strict=True)
    return {s: [a for a in ids if a >= 0] for s, ids in pairs}


def test_random_draws_anew_each_pass_and_validation_reads_draw_0(make_cfg):
    cfg = make_cfg("data.asv_sampling=random", "model.max_asvs=8", "data.mean_richness=30")
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    passes = [{}, {}]
    for seen in passes:  # two passes over the training samples
        for batch in data.train_loader:
            seen.update(rows_of(batch))
            tokens = batch["tokens"]
            assert batch["n_tokens"] == int(((tokens > 0) & (tokens < 5)).sum())  # of the drawn ASVs
    # a pass drops its last partial batch: the samples of both passes with more than 8 ASVs
    many = [s for s in passes[0].keys() & passes[1].keys() if len(data.dataset.rows[s]) > 8]
    assert len(many) > 8 and sum(passes[0][s] != passes[1][s] for s in many) > len(many) // 2
    for s in many:  # a draw of the sample's own ASVs
        assert len(passes[0][s]) == 8 and set(passes[0][s]) <= set(data.dataset.rows[s].tolist())
    val = [rows_of(b) for b in (next(iter(data.val_loader)), next(iter(data.val_loader)))]
    assert val[0] == val[1]
    assert all(v == data.dataset[s]["asv_idx"].tolist() for s, v in val[0].items())  # draw 0
    assert data.n_asvs == len(np.unique(data.dataset.rows.all()))  # any of them may be read


def test_random_draws_are_the_same_with_workers_and_on_a_resume(make_cfg, tmp_path):
    random = ["data.asv_sampling=random", "model.max_asvs=8", "data.mean_richness=30", "model.dropout=0"]
    one = build_data(make_cfg(*random).data, batch_size=4, seed=0, loader=make_cfg(*random).dataloader)
    workers = make_cfg(*random, "dataloader.num_workers=1")
    two = build_data(workers.data, batch_size=4, seed=0, loader=workers.dataloader)
    for a, b in zip(one.train_loader, two.train_loader, strict=True):
        assert torch.equal(a["asv_ids"], b["asv_ids"]) and torch.equal(a["counts"], b["counts"])
    steps = ["trainer.max_steps=16", "trainer.val_every=4", "trainer.lr_schedule=constant"]
    whole = train(make_cfg(*random, *steps), tmp_path / "whole")  # 16 steps: over two passes of 26 samples
    resumable = [*random, *steps, "trainer.checkpoint_every=8", "trainer.resume=auto"]
    assert train(make_cfg(*resumable, "trainer.max_steps=8"), tmp_path / "resumed")["steps"] == 8
    resumed = train(make_cfg(*resumable), tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 8 and whole["steps"] == 16
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")


def test_first_keeps_the_first_asvs_in_the_table_s_order(make_cfg):
    cfg = make_cfg("data.asv_sampling=first", "model.max_asvs=8", "data.mean_richness=30")
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    for i in range(len(data.dataset)):
        assert sorted(data.dataset[i]["asv_idx"].tolist()) == data.dataset.rows[i][:8].tolist()
        tokens = data.collate.tokens[data.dataset[i]["asv_idx"]]
        assert data.dataset.n_tokens[i] == int(((tokens > 0) & (tokens < 5)).sum())


def test_predict_passes_write_the_mean_and_spread_of_each_draw_s_prediction(make_cfg, tmp_path):
    cfg = make_cfg("data.asv_sampling=random", "model.max_asvs=8", "data.mean_richness=30")
    train(cfg, tmp_path / "run")
    table, summary = predicted_here(tmp_path / "run", tmp_path / "out", "passes=3", "mask=none")
    model, payload = load_model(tmp_path / "run")
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    target = read_saved_target(read_model_file(tmp_path / "run"), tmp_path / "run")
    own = []
    for draw in range(3):  # each draw of every sample by hand, in the target's units
        batch = data.collate([data.dataset.item(i, draw) for i in range(len(data.dataset))])
        with torch.no_grad():
            out = model(batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"])["target"]
        own.append(in_own_units(target, out)[:, 0])
    own = torch.stack(own, dim=1)
    assert list(table.index) == data.sample_ids
    np.testing.assert_allclose(table["predicted"], own.mean(1).numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(table["predicted_std"], own.std(1, correction=0).numpy(), rtol=1e-3, atol=1e-6)
    assert (table["predicted_std"] > 0).mean() > 0.5 and summary["quality"] is not None
    once, _ = predicted_here(tmp_path / "run", tmp_path / "once", "mask=none")  # passes=1: draw 0, no spread
    assert "predicted_std" not in once
    np.testing.assert_allclose(once["predicted"], own[:, 0].numpy(), rtol=1e-4, atol=1e-6)


def test_passes_without_random_draws_or_masks_are_refused(make_cfg, tmp_path, launch_here):
    train(make_cfg("trainer.max_steps=2"), tmp_path / "run")
    refused = r"^passes=3 reads each sample anew each pass, which neither data.asv_sampling=abundance nor "
    refused += r"the masks do .*; set data.asv_sampling=random, or passes=1$"
    with pytest.raises(UserError, match=refused):
        predicted_here(tmp_path / "run", tmp_path / "out", "passes=3", "mask=none")
    assert not (tmp_path / "out" / "targets.tsv").exists()
    proc, _ = launch_here(
        f"run={tmp_path / 'run'}", "mask=all", name="bad", module="aamperf.predict", tiny=False
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and errors == [
        "error: mask=all: expected Mask: Invalid value 'all', expected one of [run, none]"
    ]
    over_draws = ("passes=2", "data.asv_sampling=random", "mask=none")
    table, _ = predicted_here(tmp_path / "run", tmp_path / "out", *over_draws)
    assert "predicted_std" in table  # a run of the most abundant, predicted over random draws
    pd.testing.assert_index_equal(table.index, table.index.unique())


def test_predict_hides_bases_as_the_run_did_each_pass_another_draw(make_cfg, tmp_path):
    """A run trained with masked nucleotides (the default loss) reads masked sequences: predict hides
    loss.mask_fraction of each sequence's bases (mask=run), keyed by the sequence, another draw each pass;
    mask=none reads whole sequences."""
    train(make_cfg("trainer.max_steps=2"), tmp_path / "run")
    masked, summary = predicted_here(tmp_path / "run", tmp_path / "masked", "passes=4")
    assert summary["masks"] == {"seed": 0, "fraction": 0.15, "strategy": "random"} and summary["passes"] == 4
    assert (masked["predicted_std"] > 0).all()  # each pass its own bases hidden
    whole, summary = predicted_here(tmp_path / "run", tmp_path / "whole", "mask=none")
    assert summary["masks"] is None and not np.allclose(whole["predicted"], masked["predicted"])
    data = build_data(make_cfg().data, batch_size=4, seed=0, loader=make_cfg().dataloader)
    batch = data.collate([data.dataset[i] for i in range(len(data.dataset))])
    keys = sequence_keys(data.collate.tokens)
    masks = {"seed": 0, "fraction": 0.15, "strategy": "random"}
    hidden = [hidden_bases(batch, keys, draw, masks) for draw in (0, 1)]
    real = (batch["tokens"] >= 1) & (batch["tokens"] <= 4)
    assert abs(hidden[0].sum() / real.sum() - 0.15) < 0.01 and not torch.equal(hidden[0], hidden[1])
    assert not (hidden[0] & ~real).any()
    same = batch["asv_ids"] == batch["asv_ids"][0, 0]  # an ASV in several samples: one mask in each
    assert same.sum() > 1 and all(torch.equal(hidden[0][same][0], row) for row in hidden[0][same])


def test_a_frozen_encoder_s_embeddings_are_not_cached_under_random_draws(make_cfg):
    frozen = ["finetune.freeze=encoder", "loss.unifrac_weight=0", "loss.nucleotide_weight=0"]
    cfg = make_cfg(*frozen, "data.asv_sampling=random")
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    assert why_not(cfg, model, loss_fn, 1) == (
        "data.asv_sampling=random: a sample's ASVs, and so its embedding, change every pass"
    )
    assert why_not(make_cfg(*frozen, "data.asv_sampling=first"), model, loss_fn, 1) is None
