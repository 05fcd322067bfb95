"""Stage 2 on cached embeddings (aamperf/trainer/cached.py): a frozen encoder's sample embeddings computed
once, the heads trained on them, with the losses of the frozen encoder run at every step. Real runs of the
tiny config from a real 3-step pretraining."""

import pytest
import torch
from conftest import read_metrics, weights_of
from hydra.utils import instantiate

import aamperf.trainer.cached as cached_module
from aamperf.errors import UserError
from aamperf.run import train
from aamperf.tokens import MASK

# a regression fine-tune of the encoder as pretrained: the target and UniFrac parts, no nucleotide part
FROZEN = ["data.target=target", "finetune.freeze=encoder", "loss.nucleotide_weight=0"]
# every step logged, validated every 2 steps and at the end
STEPS = ["trainer.max_steps=5", "trainer.val_every=2", "trainer.lr=3e-3"]
LOSSES = ("loss", "loss_unifrac", "loss_target", "target_mae", "val_loss", "val_unifrac", "val_target")


@pytest.mark.parametrize(
    ("unifrac", "conditioning"),
    [
        ("matrix", []),
        ("per batch", []),
        ("matrix", ["data.categorical=[environment]"]),
        ("matrix", ["model.target_head=transformer"]),
        ("matrix", ["model.target_head=transformer", "data.categorical=[environment]"]),
        (
            "matrix",
            [
                "model.target_head=transformer",
                "model.categorical_fusion=add",
                "aam_ops=packed",
                "data.categorical=[environment]",
            ],
        ),
    ],
    ids=[
        "unifrac matrix",
        "unifrac per batch",
        "categorical",
        "transformer head",
        "transformer head, categorical",
        "transformer head, packed, add",
    ],
)
def test_cached_embeddings_give_the_frozen_paths_losses_at_every_step(
    make_cfg, pretrained, tmp_path, monkeypatch, unifrac, conditioning
):
    """Batch UniFrac of the cached samples: one matrix computed once, or (where it would take more than
    UNIFRAC_MATRIX_BYTES) each batch's from its branch sets, as the frozen path computes it; a target head
    conditioned on a categorical column reads the samples' categories beside their cached embeddings; the
    transformer target head reads the cached per-ASV states (padded to the batch's most real ASVs, where the
    frozen path pads to the batch's width, or packs them)."""
    if unifrac == "per batch":
        monkeypatch.setattr(cached_module, "UNIFRAC_MATRIX_BYTES", 0)
    runs = {}
    for cache in ("auto", "false"):
        cache_option = f"finetune.cache_embeddings={cache}"
        cfg = make_cfg(f"init.from_run={pretrained}", *FROZEN, *STEPS, *conditioning, cache_option)
        runs[cache] = train(cfg, tmp_path / cache)
    cached, every_step = runs["auto"]["finetune"]["cached_embeddings"], runs["false"]["finetune"]
    assert cached["applied"] is True and cached["unifrac"] == unifrac
    assert cached["samples_embedded"] == runs["auto"]["n_train"] + runs["auto"]["n_val"]
    assert cached["step_time_s"] == runs["auto"]["step_time_s"]
    assert every_step["cached_embeddings"]["reason"] == "finetune.cache_embeddings=false"
    rows = {cache: read_metrics(tmp_path / cache) for cache in runs}
    assert [r["step"] for r in rows["auto"]] == [r["step"] for r in rows["false"]] == [1, 2, 3, 4, 5]
    for mine, theirs in zip(rows["auto"], rows["false"], strict=True):
        assert set(mine) & set(LOSSES) == set(theirs) & set(LOSSES)
        for key in set(mine) & set(LOSSES):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine["step"], key)
    assert sum("val_loss" in r for r in rows["auto"]) == 3 and "loss_nucleotide" not in rows["auto"][0]
    assert rows["auto"][0]["loss_target"] != pytest.approx(rows["auto"][-1]["loss_target"], rel=1e-3)
    # the validation's target figures too: of the same samples, from the same predictions
    assert runs["auto"]["val"] == pytest.approx(runs["false"]["val"], rel=1e-5)
    ours, theirs = weights_of(tmp_path / "auto"), weights_of(tmp_path / "false")
    # but a pooling's score bias: it shifts every score alike, which the softmax ignores, so its gradient is
    # 0 up to rounding, and AdamW's m / sqrt(v) turns that rounding, another on each path, into steps (seen
    # 4e-6 apart on an Intel Xeon with AMX); it stays within the steps' lr
    noise = {n for n in ours if n.endswith("pool.score.bias")}
    assert all(ours[n].abs().max() <= 5 * 3e-3 and theirs[n].abs().max() <= 5 * 3e-3 for n in noise)
    assert all(torch.allclose(ours[n], theirs[n], rtol=1e-5, atol=1e-7) for n in set(ours) - noise)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            ["loss.nucleotide_weight=0.5"],
            "loss.nucleotide_weight=0.5: the nucleotide part reads the encoder's per-base outputs on bases "
            "hidden anew each step (loss.nucleotide_weight=0)",
        ),
        (
            ["finetune.freeze=asv_encoder"],
            "finetune.freeze=asv_encoder: the sample encoder trains, so embeddings change every step "
            "(finetune.freeze=encoder)",
        ),
    ],
    ids=["nucleotide part", "sample encoder trains"],
)
def test_auto_is_off_with_its_reason_and_true_is_refused_in_one_line(
    make_cfg, pretrained, tmp_path, overrides, reason
):
    one_step = [f"init.from_run={pretrained}", *FROZEN, *overrides, "trainer.max_steps=1"]
    summary = train(make_cfg(*one_step), tmp_path / "auto")
    assert summary["status"] == "completed"
    assert summary["finetune"]["cached_embeddings"] == {
        "applied": False,
        "reason": reason,
        "step_time_s": summary["step_time_s"],
        "samples_per_s": summary["samples_per_s"],
    }
    with pytest.raises(UserError) as refused:
        train(make_cfg(*one_step, "finetune.cache_embeddings=true"), tmp_path / "true")
    assert str(refused.value) == (
        f"finetune.cache_embeddings=true cannot apply: {reason}; or finetune.cache_embeddings=auto"
    )


def test_a_resumed_cached_fine_tune_ends_as_the_whole_run(make_cfg, pretrained, tmp_path):
    """The batch stream, schedule and optimizer go on from the checkpoint: bit for bit the whole run."""
    resumable = [f"init.from_run={pretrained}", *FROZEN, *STEPS, "trainer.checkpoint_every=2"]
    resumable += ["trainer.resume=auto"]
    assert train(make_cfg(*resumable), tmp_path / "whole")["status"] == "completed"
    whole_rows, whole = read_metrics(tmp_path / "whole"), weights_of(tmp_path / "whole")
    cfg = make_cfg(*resumable, "trainer.max_steps=3")  # stopped after step 3, its last checkpoint step 2
    assert train(cfg, tmp_path / "resumed")["status"] == "completed"
    (tmp_path / "resumed" / "checkpoints" / "step_00000003.pt").unlink(missing_ok=True)
    summary = train(make_cfg(*resumable), tmp_path / "resumed")
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
    assert summary["finetune"]["cached_embeddings"]["applied"] is True
    resumed = weights_of(tmp_path / "resumed")
    assert all(torch.equal(resumed[name], whole[name]) for name in whole)
    last = read_metrics(tmp_path / "resumed")[-1]
    assert last["step"] == 5 and last["loss"] == whole_rows[-1]["loss"]
    assert last["val_loss"] == whole_rows[-1]["val_loss"]


@pytest.mark.parametrize("nucleotide_weight", [0.0, 1.0])
def test_the_loss_hides_bases_only_where_it_learns_them(make_cfg, nucleotide_weight):
    """At nucleotide_weight=0 the model sees every base and no nucleotide part is made of nothing hidden."""
    cfg = make_cfg(f"loss.nucleotide_weight={nucleotide_weight}", "loss.mask_fraction=0.5")
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    tokens = torch.randint(1, 5, (2, 3, 151))  # every slot a real ASV of A/C/G/T
    batch = {
        "tokens": tokens,
        "counts": torch.ones(2, 3, 1),
        "asv_ids": torch.arange(6).view(2, 3),
        "unifrac": torch.tensor([[0.0, 0.5], [0.5, 0.0]]),
        "sample_idx": torch.arange(2),
    }
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    _, parts = loss_fn(model, batch, step=1)
    if nucleotide_weight == 0:
        assert torch.equal(seen[0], tokens) and "nucleotide" not in parts
    else:
        assert (seen[0] == MASK).sum() > 0 and "nucleotide" in parts
        assert torch.equal(seen[0].masked_fill(seen[0] == MASK, 0), tokens.masked_fill(seen[0] == MASK, 0))


@pytest.mark.slow  # 19 s (compile's trial) on a 2-core AMX Xeon: the default suite stays near 10 min
def test_compile_auto_does_not_try_the_whole_model_where_the_heads_train_alone(
    make_cfg, pretrained, tmp_path
):
    """A trial would time steps of the encoder the cached run never takes: compile=auto decides without one
    (no probe, no compiled graph); where the encoder runs each step it still tries."""
    cfg = make_cfg(f"init.from_run={pretrained}", *FROZEN, "trainer.max_steps=2", "compile=auto")
    summary = train(cfg, tmp_path / "cached")
    record = summary["phases"]["compile"]
    assert summary["finetune"]["cached_embeddings"]["applied"] is True
    assert record["status"] == "skipped" and record["auto"]["chose"] == "disabled"
    assert record["auto"]["reason"].startswith("the steps train the heads alone, on cached embeddings")
    assert "trial_s" not in record["auto"]
    every_step = make_cfg(f"init.from_run={pretrained}", *FROZEN, "trainer.max_steps=2", "compile=auto",
                          "finetune.cache_embeddings=false")  # fmt: skip
    summary = train(every_step, tmp_path / "every step")
    assert "heads alone" not in summary["phases"]["compile"]["auto"]["reason"]
