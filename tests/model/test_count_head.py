"""The count head (model.count_head, the original AAM's count prediction): each real ASV's count scaled to
[0, 1] by the training samples' least and greatest, predicted from its state; padded and packed the same;
its loss part the MSE over the real ASVs; in a run, a fine-tune (fresh) and the cached path's refusal."""

import numpy as np
import pytest
import torch
from conftest import read_metrics, weights_of
from hydra.utils import instantiate
from test_packed import assert_same, batch, model

from aamperf.checks import check_config
from aamperf.data import build_data
from aamperf.errors import UserError
from aamperf.finetune import load_pretrained
from aamperf.model import AAMLoss
from aamperf.rng import seed_everything
from aamperf.run import train

COUNT_REASON = "model.count_head=true: the count head reads each ASV's state and count, which are not cached"


def outputs_and_gradients(net, data: dict) -> tuple[dict, dict]:
    """Outputs and every parameter's gradient of a loss of every output, the counts' among them."""
    net.zero_grad(set_to_none=True)
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])
    loss = out["sample_embedding"].square().sum() + out["target"].sum() + out["nuc_logits"].square().mean()
    loss = loss + (out["count"] * torch.linspace(0, 1, out["count"].numel()).view_as(out["count"])).sum()
    loss.backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    return {k: v.detach() for k, v in out.items()}, grads


def test_the_head_predicts_a_count_in_0_1_for_each_real_asv_and_0_on_padding():
    data = batch(full_length=False)
    net = model(count_head=True)
    count = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])["count"]
    real = data["asv_ids"] >= 0
    assert count.shape == real.shape
    assert (count[~real] == 0).all() and ((count[real] > 0) & (count[real] < 1)).all()
    assert len(net.count_encoder.blocks) == 2  # count_layers=None: the sample encoder's 2 layers
    assert len(model(count_head=True, count_layers=1).count_encoder.blocks) == 1
    assert "count" not in model()(data["tokens"], data["counts"], asv_ids=data["asv_ids"])


def test_packed_the_head_gives_the_padded_counts_and_gradients():
    data = batch(full_length=False)
    net = model(count_head=True)
    padded = outputs_and_gradients(net, data)
    net.pack_samples = True
    packed = outputs_and_gradients(net, data)
    assert_same(packed, padded)
    torch.testing.assert_close(packed[0]["count"], padded[0]["count"], atol=1e-6, rtol=1e-5)
    assert padded[1]["count_head.weight"].abs().max() > 0  # the head is trained by what it predicts


def test_the_count_part_is_the_mse_of_the_scaled_counts_over_the_real_asvs():
    data = batch(full_length=False)
    net = model(count_head=True, target_dim=0)
    loss_fn = AAMLoss(unifrac_weight=0.0, nucleotide_weight=0.0, count_weight=2.0)
    loss_fn.set_counts(1, 49)
    data = {**data, "unifrac": torch.zeros(4, 4)}
    total, parts = loss_fn(net, data, step=0)
    predicted = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])["count"]  # no dropout
    real = data["asv_ids"] >= 0
    by_hand = ((predicted[real] - (data["counts"][..., 0][real] - 1) / 48) ** 2).mean()
    torch.testing.assert_close(parts["count"], by_hand.detach())
    torch.testing.assert_close(total, 2.0 * by_hand + 0.0 * parts["unifrac"])
    assert "count" not in loss_fn(model(target_dim=0), data, step=0)[1]  # no head, no part
    loss_fn.set_counts(7, 7)  # one count everywhere: shifted only, no division by 0
    assert torch.isfinite(loss_fn(net, data, step=0)[1]["count"])


def test_a_bad_count_option_is_refused_before_a_run(make_cfg):
    with pytest.raises(UserError, match=r"model.count_layers=-1 must be null \(sample_layers\) or an int"):
        check_config(make_cfg("model.count_head=true", "model.count_layers=-1"))
    with pytest.raises(UserError, match=r"model.count_head=yes must be true or false"):
        check_config(make_cfg("model.count_head=yes"))
    with pytest.raises(UserError, match=r"loss.count_weight=-1 must be a number >= 0"):
        check_config(make_cfg("loss.count_weight=-1"))


def test_a_run_with_the_head_learns_the_training_samples_counts(make_cfg, tmp_path):
    cfg = make_cfg("model.count_head=true", "trainer.max_steps=4")
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "completed"
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=cfg.dataloader)
    train_reads = np.concatenate([data.dataset.reads[i] for i in data.train_loader.dataset.indices])
    scale = {"count_low": int(train_reads.min()), "count_high": int(train_reads.max())}
    assert summary["count_head"] == scale and scale["count_high"] > scale["count_low"] >= 1
    lines = read_metrics(tmp_path / "run")
    counts = [line["loss_count"] for line in lines]
    assert len(counts) == 4 and all(0 < c < 1 for c in counts) and counts[-1] < counts[0]  # it learns
    assert any("val_count" in line for line in lines)
    assert "count_encoder.blocks.0.attn.qkv.weight" in weights_of(tmp_path / "run")


def test_a_fine_tune_starts_the_head_fresh_and_a_frozen_one_is_not_cached(make_cfg, pretrained, tmp_path):
    cfg = make_cfg(f"init.from_run={pretrained}", "data.target=target", "model.count_head=true")
    seed_everything(cfg.seed)
    net, summary, saved = instantiate(cfg.model), {}, weights_of(pretrained)
    load_pretrained(net, cfg, summary)
    ours = net.state_dict()
    heads = [n for n in ours if n.split(".")[0] in ("target_head", "count_encoder", "count_head")]
    assert summary["finetune"]["fresh"] == heads and "count_head.weight" in heads
    assert all(torch.equal(ours[n], saved[n]) for n in saved if n not in heads)  # the encoder loaded
    frozen = ["finetune.freeze=encoder", "loss.unifrac_weight=0", "loss.nucleotide_weight=0"]
    overrides = (f"init.from_run={pretrained}", "data.target=target", "model.count_head=true", *frozen)
    summary = train(make_cfg(*overrides), tmp_path / "frozen")
    assert summary["status"] == "completed"
    cached = summary["finetune"]["cached_embeddings"]
    assert (cached["applied"], cached["reason"]) == (False, COUNT_REASON)


@pytest.mark.parametrize("method", ["add", "concat", "film"])
def test_each_count_embedding_method_joins_the_counts_as_the_original_s_and_packs_alike(method):
    """model.count_embedding_method (the original's --count-embedding-method): add a Linear of log(1 + c),
    concatenate it and project back to D, or FiLM (a scale and a shift from it); padded == packed."""
    net = model(count_embedding_method=method)
    g = torch.Generator().manual_seed(3)
    h, counts = torch.randn(2, 5, 32, generator=g), torch.randint(1, 50, (2, 5, 1), generator=g).float()
    c = net.count_embedding(torch.log1p(counts))
    by_hand = {
        "add": lambda: h + c,
        "concat": lambda: net.count_projection(torch.cat([h, c], dim=-1)),
        "film": lambda: h * (1 + c[..., :32]) + c[..., 32:],
    }[method]()
    torch.testing.assert_close(net.with_counts(h, counts), by_hand)
    assert (net.count_projection is not None) == (method == "concat")
    data = batch(full_length=False)
    padded = outputs_and_gradients(model(count_embedding_method=method, count_head=True), data)
    packed_net = model(count_embedding_method=method, count_head=True)
    packed_net.pack_samples = True
    assert_same(outputs_and_gradients(packed_net, data), padded)
    with pytest.raises(ValueError, match="count_embedding_method=gate must be one of add, concat, film"):
        model(count_embedding_method="gate")


@pytest.mark.parametrize("method", ["add", "concat", "film"])
def test_the_counts_join_the_asv_vector_before_its_slot_position_as_the_original_s(method):
    """What the sample transformer reads: count_embedding_method's join of the ASV vector and its count, then
    the slot's position (the original's order; add's sum is the same either way)."""
    data = batch(full_length=False)
    net = model(count_embedding_method=method).eval()
    seen = []
    net.sample_transformer.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])
    width = data["tokens"].size(1)
    by_hand = net.with_counts(out["asv_embedding"], data["counts"]) + net.asv_position.weight[:width]
    real = data["asv_ids"] >= 0
    torch.testing.assert_close(seen[0][real], by_hand[real], atol=1e-6, rtol=1e-5)
