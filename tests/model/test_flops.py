"""AAM's FLOP counts (model: the math on the real ASVs; hardware: what the code executes) against
torch's FlopCounterMode on a real training step."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from aamperf.model import AAM, AAMLoss
from aamperf.phases.memory import apply_checkpointing


def make_batch(batch_size: int, n_asvs: int, real: list[int] | None = None, pairs: bool = True) -> dict:
    """A batch whose sample i holds real[i] ASVs (default: two thirds of n_asvs) then padding; with
    `pairs`, samples 2k and 2k + 1 hold the same ASVs (so dedup halves the real rows)."""
    real = real or [2 * n_asvs // 3] * batch_size
    tokens = torch.randint(1, 5, (batch_size, n_asvs, 151), generator=torch.Generator().manual_seed(0))
    tokens[..., 0] = 5
    asv_ids = torch.arange(batch_size * n_asvs).view(batch_size, n_asvs)
    if pairs:
        tokens[1::2], asv_ids[1::2] = tokens[0::2], asv_ids[0::2]
    for i, n in enumerate(real):
        tokens[i, n:], asv_ids[i, n:] = 0, -1
    return {
        "tokens": tokens,
        "counts": torch.ones(batch_size, n_asvs, 1),
        "sample_idx": torch.arange(batch_size),
        "asv_ids": asv_ids,
        "unifrac": torch.rand(batch_size, batch_size),
    }


def counted_flops(model: AAM, batch_size: int, n_asvs: int, batch: dict | None = None) -> int:
    """FLOPs torch counts in forward + backward of the loss (default batch: `make_batch`)."""
    batch = {**(batch or make_batch(batch_size, n_asvs)), "target": torch.zeros(batch_size, model.target_dim)}
    with FlopCounterMode(display=False) as counter:
        total, _ = AAMLoss()(model, batch, step=0)
        total.backward()
    return counter.get_total_flops()


SIZES = [
    {"embedding_dim": 32, "num_heads": 2, "asv_layers": 1, "sample_layers": 1, "encoder_layers": 1},
    {
        "embedding_dim": 48,
        "num_heads": 3,
        "asv_layers": 2,
        "sample_layers": 1,
        "encoder_layers": 3,
        "ffn_mult": 2,
        "target_dim": 0,
        "count_embedding": False,
    },
    {  # the original AAM's target head: its own transformer and pooling over the per-ASV states
        "embedding_dim": 32,
        "num_heads": 2,
        "asv_layers": 1,
        "sample_layers": 1,
        "encoder_layers": 1,
        "target_head": "transformer",
        "target_layers": 2,
    },
    {  # the original AAM's count head: a transformer over the per-ASV states, a Linear(D, 1) on each
        "embedding_dim": 32,
        "num_heads": 2,
        "asv_layers": 1,
        "sample_layers": 1,
        "encoder_layers": 1,
        "count_head": True,
        "count_layers": 2,
    },
    {  # the original AAM's other ways of joining counts to the ASV vectors
        "embedding_dim": 32,
        "num_heads": 2,
        "asv_layers": 1,
        "sample_layers": 1,
        "encoder_layers": 1,
        "count_embedding_method": "concat",
    },
    {
        "embedding_dim": 32,
        "num_heads": 2,
        "asv_layers": 1,
        "sample_layers": 1,
        "encoder_layers": 1,
        "count_embedding_method": "film",
    },
    {  # the original AAM's regressor head: an MLP on what the transformer head pools, a Linear beside it
        "embedding_dim": 32,
        "num_heads": 2,
        "asv_layers": 1,
        "sample_layers": 1,
        "encoder_layers": 1,
        "target_head": "transformer",
        "target_layers": 1,
        "target_hidden_dims": [16, 8],
        "target_residual": True,
    },
]


@pytest.mark.parametrize("kwargs", SIZES)
def test_analytic_flops_match_the_flop_counter(kwargs):
    model = AAM(max_asvs=16, dropout=0.1, **kwargs)
    model.asv_rows = "all"  # every row encoded, padding included: all batch_size * n_asvs rows
    analytic = model.flops_per_step(batch_size=4, n_asvs=12)
    counted = counted_flops(model, batch_size=4, n_asvs=12)
    # the contract is 10%; the count is exact but for Linear(1, D) on counts, whose input needs no gradient
    assert abs(analytic / counted - 1) < 0.001


@pytest.mark.parametrize(("asv_rows", "encoded_rows"), [("real", 4 * 8), ("unique", 2 * 8)])
@pytest.mark.parametrize("kwargs", SIZES)
def test_analytic_flops_with_fewer_encoded_rows_match_the_flop_counter(kwargs, asv_rows, encoded_rows):
    model = AAM(max_asvs=16, dropout=0.1, **kwargs)
    model.asv_rows = asv_rows
    analytic = model.flops_per_step(batch_size=4, n_asvs=12, encoded_rows=encoded_rows)
    counted = counted_flops(model, batch_size=4, n_asvs=12)
    assert abs(analytic / counted - 1) < 0.001
    assert analytic < 0.8 * model.flops_per_step(batch_size=4, n_asvs=12)  # the reduction is counted


@pytest.mark.parametrize("kwargs", SIZES)
def test_model_flops_match_the_flop_counter_on_a_batch_without_padding(kwargs):
    """No padding slot, no repeated ASV, every sample as long as the batch: model = hardware = torch's."""
    model = AAM(max_asvs=16, dropout=0.1, **kwargs)
    batch = make_batch(4, 12, real=[12] * 4, pairs=False)
    model_flops, hardware_flops = model.batch_flops(batch["tokens"], batch["asv_ids"])
    assert model_flops == hardware_flops
    assert abs(model_flops / counted_flops(model, 4, 12, batch) - 1) < 0.001


def test_model_flops_count_each_sample_at_its_own_length():
    """Samples of 3, 7, 12 and 5 ASVs: the sample encoder's attention is per sample (3^2 + 7^2 + ...),
    not the padded width squared; the per-sample count equals the sum of one-sample batches."""
    model = AAM(max_asvs=16, dropout=0.0, **SIZES[1])
    real = [3, 7, 12, 5]
    whole = model.model_flops_per_step(real)
    assert whole == pytest.approx(sum(model.model_flops_per_step([n]) for n in real))
    alone = 0  # each sample alone, without padding, as torch counts forward + backward of the model
    for n in real:
        batch = make_batch(1, n, real=[n], pairs=False)
        with FlopCounterMode(display=False) as counter:
            out = model(batch["tokens"], batch["counts"], batch["asv_ids"])
            (out["sample_embedding"].sum() + out["nuc_logits"].sum()).backward()
        alone += counter.get_total_flops()
    assert abs(whole / alone - 1) < 0.001
    assert whole < model.flops_per_step(4, 12, encoded_rows=sum(real))  # padded width: more work


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_hardware_flops_count_the_recomputation_of_checkpointed_layers(mode):
    model = AAM(max_asvs=16, dropout=0.1, **SIZES[1])  # 2 + 1 + 3 layers
    model.asv_rows = "unique"
    record = apply_checkpointing(model, OmegaConf.create({"checkpointing": mode, "recompute_every": 2}))
    assert model.checkpointed_layers() == ((2, 1, 3, 0) if mode == "full" else (1, 1, 2, 0))
    assert record["layers"] == sum(model.checkpointed_layers())
    batch = make_batch(4, 12)
    model_flops, hardware_flops = model.batch_flops(batch["tokens"], batch["asv_ids"])
    counted = counted_flops(model, 4, 12, batch)
    assert abs(hardware_flops / counted - 1) < 0.001  # the extra forward is what torch dispatches
    model_alone = AAM(max_asvs=16, dropout=0.1, **SIZES[1])
    assert model_flops == model_alone.batch_flops(batch["tokens"], batch["asv_ids"])[0]  # not in MFU


def test_hardware_flops_count_the_recomputed_layers_of_the_heads_own_stacks():
    """memory=full wraps every Block, the target and count heads' transformers' too (2 + 2 layers)."""
    heads = {"target_head": "transformer", "target_layers": 2, "count_head": True, "count_layers": 2}
    model = AAM(max_asvs=16, dropout=0.1, **SIZES[0], **heads)
    apply_checkpointing(model, OmegaConf.create({"checkpointing": "full", "recompute_every": 1}))
    assert model.checkpointed_layers() == (1, 1, 1, 4)
    batch = make_batch(4, 12)
    _, hardware_flops = model.batch_flops(batch["tokens"], batch["asv_ids"])
    assert abs(hardware_flops / counted_flops(model, 4, 12, batch) - 1) < 0.001


def test_model_flops_are_the_same_whatever_rows_are_encoded_and_however_wide_the_padding():
    """The same 4 samples padded to 8 or to 12 slots, encoded as all / real / distinct rows: one model
    count; the hardware counts are torch's and differ as the work does."""
    model = AAM(max_asvs=16, dropout=0.1, **SIZES[0])
    narrow, wide = make_batch(4, 8, real=[8] * 4), make_batch(4, 12, real=[8] * 4)
    model_counts, hardware = set(), {}
    for width, batch in (("narrow", narrow), ("wide", wide)):
        for rows in ("all", "real", "unique"):
            model.asv_rows = rows
            model_flops, hardware[width, rows] = model.batch_flops(batch["tokens"], batch["asv_ids"])
            model_counts.add(model_flops)
            assert abs(hardware[width, rows] / counted_flops(model, 4, width, batch) - 1) < 0.001
    assert len(model_counts) == 1
    (model_flops,) = model_counts
    assert model_flops == hardware["narrow", "real"]  # no padding slot, every real slot encoded
    assert hardware["wide", "all"] > hardware["wide", "real"] > hardware["narrow", "real"]
    assert hardware["narrow", "unique"] < model_flops  # repeated ASVs encoded once: less than the math


@pytest.mark.parametrize(("hidden", "residual"), [([], False), ([16, 8], False), ([16, 8], True)])
def test_the_target_head_s_flops_match_the_flop_counter_on_the_head_alone(hidden, residual):
    """The head on given embeddings (forward and backward, the embeddings' gradient too: 3 x forward):
    its Linear, or every Linear of its MLP."""
    model = AAM(
        max_asvs=16,
        dropout=0.0,
        **SIZES[0],
        target_dim=3,
        target_hidden_dims=hidden,
        target_residual=residual,
    )
    embedding = torch.randn(5, 32, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        model(sample_embedding=embedding)["target"].sum().backward()
    assert counter.get_total_flops() == 3 * model.target_head_flops([7] * 5)


def test_a_cached_step_s_hardware_flops_are_the_head_s_on_the_padded_states():
    """On cached states (a frozen encoder's), padded to the batch's width: the transformer head's matmuls
    as torch dispatches them (hardware), the real ASVs' for the model FLOPs."""
    from aamperf.trainer.cached import head_flops

    model = AAM(max_asvs=16, dropout=0.0, **SIZES[0], target_head="transformer", target_layers=2)
    batch = make_batch(4, 12)  # 8 real ASVs of 12 slots each
    model.keep_states = True
    out = model(batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"])
    states = out["asv_states"].detach().requires_grad_()  # the input's gradient too: 3 x forward's matmuls
    embedding = out["sample_embedding"].detach().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        target = model(sample_embedding=embedding, asv_states=states, asv_real=out["asv_real"])["target"]
        target.sum().backward()
    model_flops, hardware_flops = head_flops(model, [batch])
    assert hardware_flops == counter.get_total_flops()
    assert model_flops == 3 * model.target_head_flops([8] * 4) < hardware_flops
