"""The sample level packed (varlen attention over each sample's real ASVs) and the ASV encoder without
masks on full-length ASVs: the padded, masked model's outputs and gradients, and the option in a run."""

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import read_summary
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aamperf.model import AAM
from aamperf.model.packed import Packing
from aamperf.phases.aam_ops import apply_aam_ops, set_full_length
from aamperf.phases.attention import apply_attention
from aamperf.phases.memory import apply_checkpointing

DIM = 32
WIDTH = 10  # the padded width: the samples below hold 1 to 10 real ASVs


def model(**kwargs) -> AAM:
    torch.manual_seed(0)
    sizes = {"embedding_dim": DIM, "num_heads": 2, "asv_layers": 1, "sample_layers": 2, "encoder_layers": 1}
    return AAM(**{**sizes, "max_asvs": 16, "dropout": 0.0, "target_dim": 2, **kwargs})


def batch(full_length: bool) -> dict:
    """4 samples of 4, 10, 1 and 6 real ASVs padded to WIDTH, the third sample's real ASV after a padding
    slot (a hole: padding need not trail); ASVs of 151 tokens or (full_length=False) 100 to 151, PAD after.
    Some ASVs recur in several samples (asv_ids: for asv_rows=unique)."""
    g = torch.Generator().manual_seed(1)
    table = torch.randint(1, 5, (12, 151), generator=g)
    table[:, 0] = 5  # START
    if not full_length:
        for row, length in enumerate(torch.randint(100, 151, (12,), generator=g).tolist()):
            table[row, length:] = 0
    asv_ids = torch.full((4, WIDTH), -1)
    for sample, slots in enumerate([range(4), range(10), [1], range(6)]):
        for slot in slots:
            asv_ids[sample, slot] = int(torch.randint(0, 12, (1,), generator=g))
    tokens = torch.where(asv_ids[..., None] >= 0, table[asv_ids.clamp(min=0)], 0)
    counts = torch.randint(1, 50, (4, WIDTH, 1), generator=g).float() * (asv_ids[..., None] >= 0)
    return {"tokens": tokens, "counts": counts, "asv_ids": asv_ids, "table": table}


def run(net: AAM, data: dict) -> tuple[dict, dict]:
    """Outputs and every parameter's gradient of a loss of every output."""
    net.zero_grad(set_to_none=True)
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])
    loss = out["sample_embedding"].square().sum() + out["target"].sum() + out["nuc_logits"].square().mean()
    loss.backward()
    # a checkpointed layer's parameters are its wrapper's module's: named as the bare layer's
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in net.named_parameters()}
    return {k: v.detach() for k, v in out.items()}, grads


def assert_same(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    for key in ("sample_embedding", "target", "asv_embedding", "nuc_logits"):
        torch.testing.assert_close(got[0][key], expected[0][key], atol=1e-5, rtol=1e-5)
    grads, want = got[1], expected[1]
    assert want.keys() == grads.keys() and all(want[n] is not None for n in want)
    for name in want:  # fp32 sums in another order: relative to the gradient's scale (a pooling score's
        # bias has a zero gradient, softmax ignores a shift: floored)
        scale = max(want[name].abs().max().item(), 1e-4)
        torch.testing.assert_close(grads[name] / scale, want[name] / scale, atol=1e-4, rtol=0, msg=name)


def inputs_of(module: torch.nn.Module, seen: list) -> None:
    module.register_forward_hook(lambda m, args, out: seen.append(args))


@pytest.mark.parametrize("rows", ["all", "real", "unique"])
@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_packed_sample_level_gives_the_padded_outputs_and_gradients(rows, attention):
    data = batch(full_length=False)
    net = model()
    apply_attention(net, OmegaConf.create({"impl": attention, "backends": []}))
    net.asv_rows = rows
    padded = run(net, data)
    seen = []
    inputs_of(net.sample_transformer, seen)
    net.pack_samples = True
    packed = run(net, data)
    # the sample level ran on the 21 real ASVs packed, not on the [4, WIDTH] padded batch
    assert seen[0][0].shape == (4 + 10 + 1 + 6, DIM)
    assert padded[0]["sample_embedding"].abs().max() > 0.1
    assert_same(packed, padded)


def test_packed_sample_level_under_checkpointing_gives_the_padded_gradients(make_cfg):
    data = batch(full_length=False)
    net = model()
    padded = run(net, data)
    record = apply_checkpointing(net, make_cfg("memory=full").memory)
    net.pack_samples = True
    assert record["status"] == "applied" and net.checkpointed_layers() == (1, 2, 1, 0)
    assert_same(run(net, data), padded)


def test_nested_jagged_attention_is_the_attention_of_each_sample_alone():
    g = torch.Generator().manual_seed(2)
    packing = Packing.from_slots(torch.tensor([0, 1, 2, 7, 14, 15, 16, 17, 18, 19]), batch=3, width=7)
    assert packing.offsets.tolist() == [0, 3, 4, 10] and packing.segment.tolist() == [0, 0, 0, 1] + [2] * 6
    qkv = torch.randn(10, 3, 2, 8, generator=g).requires_grad_()
    outputs, grads = [], []
    for attend in (packing.jagged_attention, packing.attention_by_sample):
        out = attend(*qkv.unbind(1), 0.0)
        (grad,) = torch.autograd.grad(out.square().sum(), qkv)
        outputs.append(out)
        grads.append(grad)
    alone = [  # each sample's q, k, v [heads, length, head_dim] on their own
        F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in sample.unbind(1))).transpose(0, 1)
        for sample in qkv.split([3, 1, 6])
    ]
    torch.testing.assert_close(outputs[1], torch.cat(alone))
    torch.testing.assert_close(outputs[0], outputs[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_packed_sample_level_with_dropout_trains_and_differs_per_draw():
    data = batch(full_length=False)
    net = model(dropout=0.5).train()
    net.pack_samples = True
    first, grads = run(net, data)
    second, _ = run(net, data)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert (first["sample_embedding"] - second["sample_embedding"]).abs().max() > 1e-3  # dropout draws


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_asv_encoder_without_masks_gives_the_masked_outputs_on_full_length_asvs(attention):
    data = batch(full_length=True)
    net = model()
    apply_attention(net, OmegaConf.create({"impl": attention, "backends": []}))
    set_full_length(net, data["table"])
    assert net.full_length_asvs
    for rows in ("all", "real"):
        net.asv_rows, net.unmasked_asvs = rows, False
        masked = run(net, data)
        seen = []
        inputs_of(net.asv_encoder.blocks[0].attn.attend, seen)
        net.unmasked_asvs = True
        unmasked = run(net, data)
        assert [args[3] if len(args) > 3 else None for args in seen] == [None]  # no mask reached attention
        assert_same(unmasked, masked)


def test_the_phase_drops_the_masks_only_where_the_data_is_full_length(make_cfg, caplog):
    ops = make_cfg("aam_ops=packed").aam_ops
    for full_length in (True, False):
        net = model()
        set_full_length(net, batch(full_length)["table"])
        with caplog.at_level(logging.INFO, logger="aamperf.phases.aam_ops"):
            record = apply_aam_ops(net, ops)
        assert net.pack_samples and record["sample_level"] == "packed"
        assert net.unmasked_asvs == full_length and record["asv_masks"] == (not full_length)
        kept = "the data has ASVs with PAD inside (under 150 bp, or ambiguous bases)"
        assert record.get("asv_masks_kept") == (None if full_length else kept)
        assert (kept in caplog.text) == (not full_length)
    plain = apply_aam_ops(model(), make_cfg().aam_ops)
    assert plain["status"] == "skipped" and "sample_level" not in plain


def test_hardware_flops_of_the_packed_sample_level_are_its_real_asvs():
    net = model()
    tokens = batch(full_length=False)["tokens"]
    model_flops, padded = net.batch_flops(tokens)
    net.pack_samples = True
    packed_model_flops, packed = net.batch_flops(tokens)
    # asv_rows=real encodes the real rows only: packed, the hardware does the model's math, no padding
    assert packed == pytest.approx(model_flops) and packed_model_flops == model_flops < padded


def test_the_option_composes_and_a_tiny_run_trains_with_it(launch):
    job = subprocess.run(
        [sys.executable, "-m", "aamperf.train", "aam_ops=packed", "model=aam_tiny", "--cfg", "job"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    ops = OmegaConf.create(job.stdout).aam_ops
    assert ops.pack_samples and ops.unmask_full_length and ops.dedup
    proc, run_dir = launch("aam_ops=packed", "model.dropout=0.1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(run_dir)
    record = summary["phases"]["aam_ops"]
    assert summary["status"] == "completed" and summary["steps"] == 3
    # the simulated ASVs are 150 bp, none with PAD inside: the ASV encoder ran without masks
    assert record["sample_level"] == "packed" and record["asv_masks"] is False
    assert summary["hardware_flops_per_step"] < summary["model_flops_per_step"] * 1.05


def test_a_model_instantiated_from_the_config_packs_too(make_cfg):
    cfg = make_cfg("aam_ops=packed", "model.dropout=0")
    net = instantiate(cfg.model)
    apply_aam_ops(net, cfg.aam_ops)
    data = batch(full_length=False)
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])
    assert net.pack_samples and not net.unmasked_asvs  # full_length_asvs never set: masks kept
    assert out["sample_embedding"].shape == (4, cfg.model.embedding_dim)
