"""AAM.flops_per_step against torch's FlopCounterMode on a real training step."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aamperf.model import AAM, AAMLoss


def counted_flops(model: AAM, batch_size: int, n_asvs: int) -> int:
    """FLOPs torch counts in forward + backward of the loss; a third of the ASVs are padding rows,
    and samples 2k and 2k + 1 hold the same ASVs (so dedup halves the real rows)."""
    tokens = torch.randint(1, 5, (batch_size, n_asvs, 151), generator=torch.Generator().manual_seed(0))
    tokens[..., 0] = 5
    tokens[:, 2 * n_asvs // 3 :] = 0
    tokens[1::2] = tokens[0::2]
    asv_ids = torch.arange(batch_size * n_asvs).view(batch_size, n_asvs)
    asv_ids[1::2] = asv_ids[0::2]
    asv_ids[:, 2 * n_asvs // 3 :] = -1
    batch = {
        "tokens": tokens,
        "counts": torch.ones(batch_size, n_asvs, 1),
        "sample_idx": torch.arange(batch_size),
        "asv_ids": asv_ids,
        "unifrac": torch.rand(batch_size, batch_size),
        "target": torch.zeros(batch_size, model.target_dim),
    }
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
