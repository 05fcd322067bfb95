"""Categorical conditioning (data.categorical, aamperf/data/categorical.py): real runs with each fusion, the
vocabulary of the training samples (a category only validation has, and a missing value, in slot 0), the
target head's input fused by hand, predict on a table with a category training never saw, the refusals,
and the analytic FLOPs against torch's count with the conditioning on."""

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CONF_DIR, read_metrics, read_summary
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from aamperf.checks import check_config
from aamperf.data import build_data
from aamperf.data.collate import Collate
from aamperf.data.loaders import split_batch
from aamperf.data.tables import resolve_files
from aamperf.device import to_device
from aamperf.errors import UserError
from aamperf.model import AAM, AAMLoss
from aamperf.predict.config import register_predict_configs
from aamperf.predict.run import predict
from aamperf.run import train
from aamperf.weights import load_model, read_model_file

FAST = ["trainer.lr=3e-3", "trainer.max_steps=4", "data.target=target"]
CPU = torch.device("cpu")


def biom_with(make_cfg, tmp_path, edit) -> tuple[list[str], pd.DataFrame, dict]:
    """(overrides for data=biom on the simulated files with a metadata copy `edit(metadata, train ids, val
    ids)` changed, that copy, the files): the split is the simulated data's (it depends on the table)."""
    cfg = make_cfg("data.target=target")
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    train_ids = [data.sample_ids[i] for i in data.train_loader.dataset.indices]
    val_ids = [data.sample_ids[i] for i in data.val_loader.dataset.indices]
    metadata = pd.read_csv(data.files["metadata"], sep="\t", index_col=0, dtype=str)
    edit(metadata, train_ids, val_ids)
    metadata.to_csv(tmp_path / "metadata.tsv", sep="\t")
    biom = ["data=biom", f"data.table={data.files['table']}", f"data.tree={data.files['tree']}"]
    return [*biom, f"data.metadata={tmp_path / 'metadata.tsv'}"], metadata, data.files


def only_in_validation(metadata: pd.DataFrame, train_ids: list[str], val_ids: list[str]) -> None:
    """A category only a validation sample has, and a training sample's value missing."""
    metadata.loc[val_ids[0], "environment"] = "lagoon"
    metadata.loc[train_ids[0], "environment"] = "not collected"


# concat in the default suite; each other fusion's run (~1.5 s, 7 s on a busy machine) in `pytest -m slow`:
# what it changes, the target head's input, is checked by test_the_target_head_reads_the_sample_embedding_...
@pytest.mark.parametrize(
    "fusion",
    ["concat", pytest.param("add", marks=pytest.mark.slow), pytest.param("gmu", marks=pytest.mark.slow)],
)
def test_a_run_conditioned_on_a_column_trains_with_the_training_samples_vocabulary(
    make_cfg, tmp_path, fusion
):
    biom, metadata, _ = biom_with(make_cfg, tmp_path, only_in_validation)
    overrides = [*biom, *FAST, "data.categorical=[environment]", f"model.categorical_fusion={fusion}"]
    summary = train(make_cfg(*overrides), tmp_path / "run")
    assert summary["status"] == "completed", summary.get("error")
    record = read_summary(tmp_path / "run")["categorical"]
    data = build_data(make_cfg(*overrides).data, batch_size=4, seed=0, loader=make_cfg().dataloader)
    train_ids = [data.sample_ids[i] for i in data.train_loader.dataset.indices]
    written = metadata.loc[train_ids, "environment"]
    vocabulary = sorted(set(written) - {"not collected"})
    assert record["vocabularies"] == {"environment": vocabulary} and "lagoon" not in vocabulary
    assert record["train_missing"] == {"environment": 1} and record["val_unseen"] == {"environment": 1}
    assert record["fusion"] == fusion
    # every sample's slot: its category's place in the vocabulary + 1, 0 for the unseen and the missing
    expected = [
        vocabulary.index(v) + 1 if v in vocabulary else 0
        for v in metadata.loc[data.sample_ids, "environment"]
    ]
    assert data.dataset.categorical[:, 0].tolist() == expected
    lagoon = data.sample_ids.index(metadata.index[metadata["environment"] == "lagoon"][0])
    assert data.dataset.categorical[lagoon, 0] == 0 and lagoon in data.val_loader.dataset.indices
    # saved with the model, as plain data; its tables sized to the vocabulary (+ slot 0)
    payload = read_model_file(tmp_path / "run")
    assert payload["categorical"]["vocabularies"] == record["vocabularies"]
    assert payload["weights"]["categorical_embeddings.0.weight"].shape == (len(vocabulary) + 1, 32)
    assert ("categorical_projection.weight" in payload["weights"]) == (fusion == "concat")
    assert payload["config"]["model"]["categorical_sizes"] == [len(vocabulary)]


def conditioned_model(make_cfg, fusion: str, *overrides: str) -> tuple[AAM, dict]:
    """(a tiny AAM conditioned on environment, in eval mode, a batch of the simulated data with it)."""
    cfg = make_cfg(
        "data.target=target",
        "data.categorical=[environment]",
        f"model.categorical_fusion={fusion}",
        *overrides,
    )
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader)
    cfg.model.categorical_sizes = [len(v) for v in data.categorical["vocabularies"].values()]
    torch.manual_seed(0)
    return instantiate(cfg.model).eval(), to_device(next(iter(data.train_loader)), CPU)


@pytest.mark.parametrize("fusion", ["concat", "add", "gmu", "cross_attention"])
def test_the_target_head_reads_the_sample_embedding_fused_with_the_category(make_cfg, fusion):
    model, batch = conditioned_model(make_cfg, fusion)
    with torch.no_grad():
        out = model(
            batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"], categorical=batch["categorical"]
        )
        other = (batch["categorical"] % 4) + 1  # another category for every sample
        moved = model(batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"], categorical=other)
        unseen = model(
            batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"], categorical=torch.zeros_like(other)
        )
        sample = out["sample_embedding"]
        column = model.categorical_embeddings[0].weight[batch["categorical"][:, 0]]
        if fusion == "concat":
            by_hand = model.categorical_projection(torch.cat([sample, column], dim=-1))
        elif (
            fusion == "gmu"
        ):  # the original AAM's GMU: sample + sigmoid(gate [sample, c]) * tanh(transform c)
            gate = torch.sigmoid(model.categorical_gate(torch.cat([sample, column], dim=-1)))
            by_hand = sample + gate * torch.tanh(model.categorical_transform(column))
        elif fusion == "cross_attention":  # the original's attention to one metadata token, as it computes
            by_hand = model.categorical_norm(sample + model.categorical_update(column))
        else:
            by_hand = sample + column
        torch.testing.assert_close(out["target"], model.target_head(by_hand))
        assert not torch.allclose(out["target"], moved["target"])  # the category is read
        # only the target head is conditioned: the embedding UniFrac reads is the encoder's
        torch.testing.assert_close(moved["sample_embedding"], sample)
        # slot 0 (unseen / missing) is a zero vector: the embedding alone (concat: zeros beside it)
        assert not model.categorical_embeddings[0].weight[0].any()
        zero = torch.cat([sample, torch.zeros_like(sample)], -1) if fusion == "concat" else sample
        fused = model.categorical_projection(zero) if fusion == "concat" else zero
        if fusion == "gmu":
            nothing = torch.zeros_like(sample)
            gate = torch.sigmoid(model.categorical_gate(torch.cat([sample, nothing], -1)))
            fused = sample + gate * torch.tanh(model.categorical_transform(nothing))
        if fusion == "cross_attention":
            fused = model.categorical_norm(sample + model.categorical_update(torch.zeros_like(sample)))
        torch.testing.assert_close(unseen["target"], model.target_head(fused))
    # the loss passes the batch's categories: its target part is the conditioned output's
    loss_fn = AAMLoss(unifrac_weight=0, nucleotide_weight=0)
    with torch.no_grad():
        _, _, predicted = loss_fn.evaluate(model, batch, 0)
    torch.testing.assert_close(predicted, out["target"])


def counted_and_analytic(model: AAM, batch: dict) -> tuple[int, float]:
    """(FLOPs torch counts in forward + backward of the loss on `batch`, the model's analytic hardware
    FLOPs of it)."""
    batch = {**batch, "target": torch.zeros(batch["tokens"].size(0), 1)}
    with FlopCounterMode(display=False) as counter:
        total, _ = AAMLoss()(model.train(), batch, step=0)
        total.backward()
    return counter.get_total_flops(), model.batch_flops(batch["tokens"], batch["asv_ids"])[1]


@pytest.mark.parametrize("fusion", ["concat", "add", "gmu", "cross_attention"])
def test_analytic_flops_match_the_flop_counter_with_conditioning(make_cfg, fusion):
    """The whole step within tests/model/test_flops.py's 0.1%, and what the conditioning adds (against the
    same model without it) exactly: concat's Linear(2D, D) forward and backward on the batch's 8 samples."""
    model, batch = conditioned_model(make_cfg, fusion)
    plain = AAM(**{**model_arguments(make_cfg, fusion), "categorical_sizes": []})
    counted, analytic = counted_and_analytic(model, batch)
    assert abs(analytic / counted - 1) < 0.001
    counted_plain, analytic_plain = counted_and_analytic(plain, batch)
    # forward and backward (3 forwards) of 8 samples: concat's Linear(2D, D); gmu's gate, Linear(2D, D),
    # and its transform, Linear(D, D); cross_attention's Linear(D, D); add's sums none
    extra = {"concat": 2 * 32, "gmu": 2 * 32 + 32, "cross_attention": 32, "add": 0}[fusion] * 3 * 2 * 8 * 32
    assert counted - counted_plain == extra == analytic - analytic_plain


@pytest.mark.parametrize("fusion", ["concat", "gmu", "cross_attention"])
def test_a_narrower_categorical_embedding_fuses_and_counts_its_flops(make_cfg, fusion):
    """model.categorical_dim=8 (the original AAM's --categorical-embed-dim) below D=32: each column's table
    is 8 wide, the fusion reads [sample, column] of 32 + 8, and the analytic FLOPs follow the counter's."""
    model, batch = conditioned_model(make_cfg, fusion, "model.categorical_dim=8")
    assert model.categorical_embeddings[0].weight.shape[1] == 8
    with torch.no_grad():
        out = model(
            batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"], categorical=batch["categorical"]
        )
        sample, column = out["sample_embedding"], model.categorical_embeddings[0](batch["categorical"][:, 0])
        both = torch.cat([sample, column], dim=-1)
        if fusion == "concat":
            by_hand = model.categorical_projection(both)
        elif fusion == "cross_attention":
            by_hand = model.categorical_norm(sample + model.categorical_update(column))
        else:
            by_hand = sample + torch.sigmoid(model.categorical_gate(both)) * torch.tanh(
                model.categorical_transform(column)
            )
        torch.testing.assert_close(out["target"], model.target_head(by_hand))
    plain = AAM(**{**model_arguments(make_cfg, fusion, "model.categorical_dim=8"), "categorical_sizes": []})
    counted, analytic = counted_and_analytic(model, batch)
    counted_plain, analytic_plain = counted_and_analytic(plain, batch)
    extra = 3 * 2 * 8 * {"concat": 32 + 8, "gmu": 32 + 8 + 8, "cross_attention": 8}[fusion] * 32
    assert counted - counted_plain == extra == analytic - analytic_plain


def test_the_originals_cross_attention_to_one_metadata_token_is_layernorm_of_x_plus_a_linear_map():
    """The original AAM's CrossAttentionFusion: each ASV's state [B, S, D] attends (torch's
    MultiheadAttention) to its metadata projected to one token; over one key the softmax is 1, so every
    position gets the same update, LayerNorm(x + W_o W_v (W_c c + b_c) + ...): one Linear of c. Its query and
    key projections train nothing."""
    torch.manual_seed(0)
    dim, heads, columns = 32, 8, 12
    project, attention = (
        torch.nn.Linear(columns, dim),
        torch.nn.MultiheadAttention(dim, heads, batch_first=True),
    )
    states, c = torch.randn(4, 10, dim), torch.randn(4, columns)
    metadata = project(c).unsqueeze(1)  # [B, 1, D]: the one key and value
    theirs = torch.nn.functional.layer_norm(states + attention(states, metadata, metadata)[0], (dim,))
    value = attention.in_proj_weight[2 * dim :], attention.in_proj_bias[2 * dim :]
    out = attention.out_proj
    update = torch.nn.Linear(columns, dim)  # the same affine map as one Linear: cross_attention's
    with torch.no_grad():
        update.weight.copy_(out.weight @ value[0] @ project.weight)
        update.bias.copy_(out.weight @ (value[0] @ project.bias + value[1]) + out.bias)
    ours = torch.nn.functional.layer_norm(states + update(c).unsqueeze(1), (dim,))
    torch.testing.assert_close(ours, theirs)
    (theirs * torch.randn_like(theirs)).sum().backward()  # a LayerNorm's outputs sum to 0: weigh them
    query_key = attention.in_proj_weight.grad[: 2 * dim]
    assert not query_key.any() and attention.in_proj_weight.grad[2 * dim :].abs().min() > 0


def test_a_categorical_dim_add_cannot_sum_is_refused(make_cfg):
    with pytest.raises(
        UserError, match=r"model\.categorical_dim=8 must be null or model\.embedding_dim \(32\)"
    ):
        check_config(make_cfg("model.categorical_fusion=add", "model.categorical_dim=8"))


def model_arguments(make_cfg, fusion: str, *overrides: str) -> dict:
    """The tiny model's arguments, conditioned on one column of 4 categories."""
    cfg = make_cfg(f"model.categorical_fusion={fusion}", "model.categorical_sizes=[4]", *overrides)
    arguments = OmegaConf.to_container(cfg.model, resolve=True)
    return {key: value for key, value in arguments.items() if key != "_target_"}


def predicted_here(run_dir, out, *overrides: str) -> dict:
    register_predict_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("predict", [f"run={run_dir}", "device=cpu", "progress=false", *overrides])
    return predict(cfg, out)


def test_predict_maps_a_category_training_never_saw_to_slot_0_and_counts_it(make_cfg, tmp_path, launch_here):
    """Trained on env0..env3; a new metadata gives two samples `glacier` (unseen) and one none: slot 0,
    said per column in predict's summary and printout; the targets are the model's on those slots."""
    overrides = [*FAST, "data.categorical=[environment]"]
    train(make_cfg(*overrides), tmp_path / "run")
    data = build_data(make_cfg(*overrides).data, batch_size=4, seed=0, loader=make_cfg().dataloader)
    files = data.files
    metadata = pd.read_csv(files["metadata"], sep="\t", index_col=0, dtype=str)
    metadata.loc[data.sample_ids[:2], "environment"] = "glacier"
    metadata.loc[data.sample_ids[2], "environment"] = ""
    metadata.to_csv(tmp_path / "new.tsv", sep="\t")
    new = [f"data.table={files['table']}", f"data.metadata={tmp_path / 'new.tsv'}"]
    proc, out = launch_here(
        f"run={tmp_path / 'run'}", "device=cpu", *new, name="out", module="aamperf.predict", tiny=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(out)
    ids = pd.read_csv(out / "targets.tsv", sep="\t", index_col=0).index.astype(str).tolist()
    glacier, blank = 2, 1
    assert summary["categorical"]["unseen"] == {"environment": glacier}
    assert summary["categorical"]["missing"] == {"environment": blank}
    assert f"environment: {glacier} unseen in training, {blank} missing" in proc.stdout
    # the predictions are the model's with those samples in slot 0
    model, payload = load_model(tmp_path / "run")
    vocabulary = payload["categorical"]["vocabularies"]["environment"]
    slots = [vocabulary.index(v) + 1 if v in vocabulary else 0 for v in metadata.loc[ids, "environment"]]
    assert 0 in slots
    from aamperf.data.samples import read_samples
    from aamperf.predict.masks import hidden_bases, sequence_keys
    from aamperf.predict.run import collate_of
    from aamperf.tokens import MASK

    cfg = make_cfg().data
    samples = read_samples(cfg, keep_unlabelled=True, sample_ids=ids)
    samples.dataset.categorical = torch.tensor(slots)[:, None]
    batch = collate_of(samples)([samples.dataset[i] for i in range(len(ids))])
    hidden = hidden_bases(batch, sequence_keys(samples.tokens), 0, summary["masks"])  # as the run hid them
    with torch.no_grad():
        tokens = batch["tokens"].masked_fill(hidden, MASK)
        target = model(tokens, batch["counts"], categorical=batch["categorical"])["target"]
    saved = payload["target"]
    table = pd.read_csv(out / "targets.tsv", sep="\t", index_col=0)
    own = target.squeeze(1).double() * saved["scale"] + saved["shift"]
    np.testing.assert_allclose(table["predicted"], own.numpy(), rtol=1e-4)
    # a new table without metadata is refused: the model needs its columns
    with pytest.raises(UserError, match=r"conditions its target on the metadata columns environment"):
        predicted_here(tmp_path / "run", tmp_path / "none", f"data.table={files['table']}")


def test_a_column_the_metadata_lacks_is_refused_through_the_cli(launch_here):
    proc, _ = launch_here("data.target=target", "data.categorical=[habitat]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: data.categorical: no column 'habitat' in ")
    assert errors[0].endswith(" (columns: environment, target); name columns it has in data.categorical")


def test_the_target_itself_and_a_run_without_metadata_are_refused(make_cfg):
    cfg = make_cfg("data.target=environment", "data.categorical=[environment]")
    with pytest.raises(UserError, match=r"^data\.categorical: 'environment' is data\.target itself"):
        build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    files = resolve_files(make_cfg().data)
    cfg = make_cfg(
        "data=biom",
        f"data.table={files['table']}",
        f"data.tree={files['tree']}",
        "data.categorical=[environment]",
    )
    with pytest.raises(
        UserError, match=r"^data\.categorical=\['environment'\] reads metadata columns: give data\.metadata="
    ):
        build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)


def test_a_fine_tune_from_a_run_without_conditioning_starts_the_conditioning_fresh(make_cfg, tmp_path):
    """The pretraining has no categorical tables: the fine-tune loads its encoder and trains the conditioning
    from its own initialization; with the encoder frozen, on cached embeddings (aamperf/trainer/cached.py)
    or running the encoder at every step, the same losses and the same conditioning learnt."""
    train(make_cfg("trainer.max_steps=2"), tmp_path / "pretrain")
    overrides = [*FAST, "data.categorical=[environment]", f"init.from_run={tmp_path / 'pretrain'}"]
    overrides += ["finetune.freeze=encoder", "loss.nucleotide_weight=0"]
    runs = {
        cache: train(make_cfg(*overrides, f"finetune.cache_embeddings={cache}"), tmp_path / cache)
        for cache in ("true", "false")
    }
    summary = runs["false"]
    assert summary["status"] == "completed", summary.get("error")
    fresh = summary["finetune"]["fresh"]
    assert "categorical_embeddings.0.weight" in fresh and "categorical_projection.weight" in fresh
    assert runs["true"]["finetune"]["cached_embeddings"]["applied"] is True
    rows = {cache: read_metrics(tmp_path / cache) for cache in runs}
    for mine, theirs in zip(rows["true"], rows["false"], strict=True):
        assert mine["loss_target"] == pytest.approx(theirs["loss_target"], rel=1e-5), mine["step"]
    ours, theirs = (read_model_file(tmp_path / cache)["weights"] for cache in runs)
    table = "categorical_embeddings.0.weight"
    assert torch.allclose(ours[table], theirs[table], rtol=1e-5, atol=1e-7)
    pretrained = read_model_file(tmp_path / "pretrain")["weights"]
    assert not any(name.startswith("categorical") for name in pretrained)


def test_each_rank_s_slice_and_each_micro_batch_carry_their_samples_categories(make_cfg):
    """Under torch.distributed a rank's batch is its slice of the global batch (Collate), a gradient-cache
    step's micro-batches are slices of the step's (split_batch): the categories follow their samples."""
    cfg = make_cfg("data.target=target", "data.categorical=[environment]")
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader)
    items = [data.dataset[i] for i in data.train_loader.dataset.indices[:8]]
    categories = data.dataset.categorical[[item["sample_idx"] for item in items]]
    for rank in (0, 1):
        sliced = Collate(data.collate.tokens, data.collate.unifrac, None, rank=rank, world_size=2)(items)
        assert sliced["categorical"].tolist() == categories[4 * rank : 4 * rank + 4].tolist()
        assert sliced["categorical"].dtype == torch.long
    whole = data.collate(items)
    for m, micro in enumerate(split_batch(whole, 2)):
        assert micro["categorical"].tolist() == categories[4 * m : 4 * m + 4].tolist()


def test_a_fusion_aamperf_lacks_is_refused_before_the_run_builds_anything(make_cfg):
    with pytest.raises(UserError, match=r"model\.categorical_fusion=gated must be one of concat, add"):
        check_config(make_cfg("model.categorical_fusion=gated"))
