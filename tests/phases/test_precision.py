"""precision.residual=autocast: the transformer stacks' residual stream and LayerNorms in autocast's dtype."""

import copy

import pytest
import torch
from conftest import read_summary
from hydra.utils import instantiate

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.model.layers import Block, LayerNorm, Transformer
from aamperf.phases.precision import apply_residual
from aamperf.run import train


@pytest.fixture
def tiny(make_cfg):
    """aam_tiny in eval mode (no dropout: the two models draw nothing), one real batch of 4."""
    cfg = make_cfg()
    torch.manual_seed(0)
    model = instantiate(cfg.model).eval()
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    return model, instantiate(cfg.loss), to_device(next(iter(data.train_loader)), torch.device("cpu"))


def bf16_step(model, loss_fn, batch):
    """Loss and gradients of a step under bf16 autocast, the dtypes each block received and the bytes
    forward saved for backward."""
    model.zero_grad(set_to_none=True)
    received, saved = [], {}
    hooks = [
        m.register_forward_pre_hook(lambda _, args: received.append(args[0].dtype))
        for m in model.modules()
        if isinstance(m, Block)
    ]

    def pack(t):
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with bf16, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = loss_fn(model, batch, 1)
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, set(received), sum(saved.values())


def test_the_stream_in_bf16_keeps_fewer_bytes_for_nearly_the_same_loss_and_gradients(tiny, make_cfg):
    model, loss_fn, batch = tiny
    stream = copy.deepcopy(model)
    record = apply_residual(stream, make_cfg("precision=bf16", "precision.residual=autocast").precision)
    stacks = sum(isinstance(m, Transformer) for m in model.modules())
    norms = sum(isinstance(m, LayerNorm) for m in model.modules())
    assert record == {"residual": "autocast", "residual_stacks": stacks, "residual_norms": norms}

    loss, grads, received, kept = bf16_step(model, loss_fn, batch)
    loss_b, grads_b, received_b, kept_b = bf16_step(stream, loss_fn, batch)
    assert received == {torch.float32} and received_b == {torch.bfloat16}  # every block's input
    assert kept_b < 0.9 * kept, (kept_b, kept)  # the residual stream's and the norms' inputs: 2 bytes, not 4
    torch.testing.assert_close(loss_b, loss, rtol=0.02, atol=0.0)  # bf16's rounding, not another model
    assert grads_b.keys() == grads.keys()
    flat, flat_b = (torch.cat([g.flatten() for g in gs.values()]) for gs in (grads, grads_b))
    assert torch.nn.functional.cosine_similarity(flat, flat_b, dim=0) > 0.99


def test_without_autocast_the_flagged_model_computes_exactly_the_fp32_model(tiny, make_cfg):
    model, loss_fn, batch = tiny
    stream = copy.deepcopy(model)
    apply_residual(stream, make_cfg("precision=bf16", "precision.residual=autocast").precision)
    torch.manual_seed(1)
    expected, _ = loss_fn(model, batch, 1)
    torch.manual_seed(1)
    got, _ = loss_fn(stream, batch, 1)
    assert torch.equal(got, expected)  # an fp32 step (precision=fp32, or fp32 confirmed faster) is unchanged


def test_fp32_leaves_the_model_alone_and_a_model_without_aamperf_layers_is_named(tiny, make_cfg):
    model, _, _ = tiny
    assert apply_residual(model, make_cfg("precision=bf16").precision) == {"residual": "fp32"}
    assert not any(getattr(m, "autocast_stream", False) for m in model.modules())
    record = apply_residual(torch.nn.Linear(2, 2), make_cfg("precision.residual=autocast").precision)
    assert record["residual_note"] == "the model has no aamperf Transformer or LayerNorm: nothing changed"


def test_a_run_records_the_stream_and_trains(make_cfg, tmp_path):
    summary = train(make_cfg("precision=bf16", "precision.residual=autocast"), tmp_path)
    assert summary["status"] == "completed"
    phase = read_summary(tmp_path)["phases"]["precision"]
    assert phase["dtype"] == "bf16" and phase["residual"] == "autocast" and phase["residual_stacks"] >= 2


def test_a_flagged_layer_norm_runs_in_the_autocast_dtype_and_a_plain_one_in_fp32():
    torch.manual_seed(0)
    plain, flagged = LayerNorm(64), LayerNorm(64)
    flagged.in_autocast_dtype = True
    x = torch.randn(5, 64) * 3 + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, low = plain(x), flagged(x)
    assert kept.dtype == torch.float32 and low.dtype == torch.bfloat16  # autocast's rule, and the option's
    torch.testing.assert_close(low.float(), kept, rtol=0.02, atol=0.02)
    assert flagged.weight.dtype == torch.float32  # the parameters stay fp32
    assert torch.equal(flagged(x), plain(x))  # no autocast: nothing changes


def test_a_block_with_its_norms_in_bf16_compiles_whole_and_matches_eager():
    torch.manual_seed(0)
    block = Block(32, 2, 4, dropout=0.0)
    for module in block.modules():
        if isinstance(module, LayerNorm):
            module.in_autocast_dtype = True
    x = torch.randn(3, 17, 32, dtype=torch.bfloat16)
    # fullgraph: the autocast queries break no graph (aot_eager: dynamo and autograd's tracing, no codegen)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = block(x, None), compiled(x, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02)
