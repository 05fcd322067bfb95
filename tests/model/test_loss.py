"""AAMLoss: the deterministic nucleotide mask and each loss part against hand-computed values."""

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aamperf.model import AAMLoss, nucleotide_mask
from aamperf.model.masking import MASK_STRATEGIES

CONF = Path(__file__).parents[2] / "conf"


def random_tokens(batch: int, n_asvs: int, seed: int) -> torch.Tensor:
    """Real ASVs (START + bases) with the last ASV of every sample and the tail of every ASV padded."""
    tokens = torch.randint(1, 5, (batch, n_asvs, 151), generator=torch.Generator().manual_seed(seed))
    tokens[..., 0] = 5
    tokens[..., 140:] = 0
    tokens[:, -1] = 0
    return tokens


def asv_ids(tokens: torch.Tensor, first: int) -> torch.Tensor:
    """Distinct ids first, first + 1, ... for the real slots of `tokens`, -1 on padding."""
    real = tokens[..., 0] != 0
    ids = torch.full(real.shape, -1)
    ids[real] = torch.arange(first, first + int(real.sum()))
    return ids


@pytest.mark.parametrize("strategy", MASK_STRATEGIES)
def test_mask_of_an_asv_depends_only_on_seed_step_and_asv_id(strategy):
    a = random_tokens(3, 8, seed=0)
    b = random_tokens(4, 16, seed=1)
    ids_a, ids_b = asv_ids(a, 100), asv_ids(b, 200)
    # ASV 7: slot (0, 2) and (2, 5) of batch a, slot (3, 9) of batch b (another batch, more padding)
    a[2, 5], b[3, 9] = a[0, 2], a[0, 2]
    ids_a[0, 2] = ids_a[2, 5] = ids_b[3, 9] = 7
    mask_a = nucleotide_mask(a, ids_a, step=3, seed=0, fraction=0.15, strategy=strategy)
    mask_b = nucleotide_mask(b, ids_b, step=3, seed=0, fraction=0.15, strategy=strategy)
    assert mask_a[0, 2].sum() > 5  # ~0.15 * 139 bases
    assert torch.equal(mask_a[2, 5], mask_a[0, 2]) and torch.equal(mask_b[3, 9], mask_a[0, 2])
    assert not torch.equal(mask_a[0, 3], mask_a[0, 2])  # another ASV, another draw
    assert not mask_b[:, -1].any()  # padding slots
    # another step, seed or ASV id draws another mask
    assert not torch.equal(nucleotide_mask(a, ids_a, 4, 0, 0.15, strategy)[0, 2], mask_a[0, 2])
    assert not torch.equal(nucleotide_mask(a, ids_a, 3, 1, 0.15, strategy)[0, 2], mask_a[0, 2])
    assert not torch.equal(nucleotide_mask(a, ids_a + 1, 3, 0, 0.15, strategy)[0, 2], mask_a[0, 2])


@pytest.mark.parametrize("strategy", MASK_STRATEGIES)
def test_mask_hides_the_fraction_of_real_bases_and_nothing_else(strategy):
    tokens = random_tokens(8, 32, seed=2)
    mask = nucleotide_mask(tokens, asv_ids(tokens, 0), step=0, seed=0, fraction=0.15, strategy=strategy)
    real_bases = (tokens >= 1) & (tokens <= 4)
    assert not (mask & ~real_bases).any()  # never START, never padding
    # 34k bases: sd of the fraction ~0.002 each on its own, ~0.005 in spans (a few bases cut by the ends)
    assert abs(mask.sum() / real_bases.sum() - 0.15) < 0.015
    assert nucleotide_mask(tokens, asv_ids(tokens, 0), 0, 0, 0.0, strategy).sum() == 0


def hidden_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of hidden positions in every row of a bool [..., L] mask."""
    runs = []
    for row in mask.reshape(-1, mask.size(-1)).tolist():
        start = None
        for i, hidden in enumerate([*row, False]):
            if hidden and start is None:
                start = i
            elif not hidden and start is not None:
                runs.append((start, i - start))
                start = None
    return runs


def test_span_masking_hides_runs_of_three_bases_or_more_and_random_masking_does_not():
    tokens = random_tokens(4, 32, seed=3)  # bases at positions 1 to 139, padding from 140
    ids = asv_ids(tokens, 0)
    spans = hidden_runs(nucleotide_mask(tokens, ids, 0, 0, 0.15, "span"))
    inside = [length for start, length in spans if start + length < 140]  # not cut by the padding
    assert len(inside) > 500 and min(inside) >= 3
    assert sum(length <= 5 for length in inside) / len(inside) > 0.8  # most alone, some run together
    singles = hidden_runs(nucleotide_mask(tokens, ids, 0, 0, 0.15, "random"))
    assert sum(length == 1 for _, length in singles) / len(singles) > 0.7  # 0.85 ** 2 of them


class Stub(torch.nn.Module):
    """A model with fixed outputs, to check the loss by hand."""

    def __init__(self, **outputs):
        super().__init__()
        self.outputs = outputs
        self.seen_tokens = self.seen_asv_ids = None

    def forward(self, tokens, counts, asv_ids=None):
        self.seen_tokens, self.seen_asv_ids = tokens, asv_ids
        return dict(self.outputs)


def stub_batch(**extra) -> dict:
    tokens = random_tokens(3, 4, seed=3)
    return {
        "tokens": tokens,
        "counts": torch.ones(3, 4, 1),
        "sample_idx": torch.tensor([0, 1, 2]),
        "asv_ids": asv_ids(tokens, 0),
        "unifrac": torch.tensor([[0.0, 0.5, 0.7], [0.5, 0.0, 0.4], [0.7, 0.4, 0.0]]),
        **extra,
    }


def test_unifrac_loss_on_a_hand_case():
    # distances: |e0-e1| = 5, |e0-e2| = 10, |e1-e2| = 5
    stub = Stub(sample_embedding=torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]]))
    total, parts = AAMLoss(unifrac_weight=2.0)(stub, stub_batch(), step=0)
    expected = ((math.tanh(0.5) - 0.5) ** 2 + (math.tanh(1.0) - 0.7) ** 2 + (math.tanh(0.5) - 0.4) ** 2) / 3
    assert set(parts) == {"unifrac"}  # the stub has no nucleotide logits and no target
    assert parts["unifrac"].item() == pytest.approx(expected, rel=1e-6)
    assert total.item() == pytest.approx(2.0 * expected, rel=1e-6)


def test_nucleotide_loss_is_cross_entropy_on_the_hidden_bases_only():
    batch = stub_batch()
    stub = Stub()
    loss = AAMLoss(mask_fraction=0.15)
    with pytest.raises(ValueError, match="nothing to train"):
        loss(stub, batch, step=5)  # no outputs at all; the stub still records the tokens it saw
    seen = stub.seen_tokens
    assert stub.seen_asv_ids is batch["asv_ids"]
    hidden = nucleotide_mask(batch["tokens"], batch["asv_ids"], 5, 0, 0.15)
    assert torch.equal(seen == 6, hidden)
    assert torch.equal(seen[~hidden], batch["tokens"][~hidden])
    # logits 10 on the token the model sees: right where visible, "MASK" (wrong) where hidden
    stub.outputs = {"nuc_logits": 10.0 * torch.nn.functional.one_hot(seen, 7).float()}
    total, parts = loss(stub, batch, step=5)
    assert set(parts) == {"nucleotide"}
    assert parts["nucleotide"].item() == pytest.approx(math.log(math.exp(10) + 6), rel=1e-5)


def test_target_part_and_weighted_total():
    stub = Stub(
        sample_embedding=torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]]),
        target=torch.tensor([[1.0], [2.0], [4.0]]),
    )
    loss = AAMLoss(unifrac_weight=0.5, target_weight=3.0)
    total, parts = loss(stub, stub_batch(target=torch.tensor([[1.0], [0.0], [1.0]])), step=0)
    assert parts["target"].item() == pytest.approx((0 + 4 + 9) / 3)
    assert total.item() == pytest.approx(0.5 * parts["unifrac"].item() + 3.0 * 13 / 3, rel=1e-6)
    _, parts = loss(stub, stub_batch(), step=0)  # no target in the batch: no target part
    assert set(parts) == {"unifrac"}


def test_unifrac_loss_needs_two_samples():
    stub = Stub(sample_embedding=torch.zeros(1, 2))
    batch = stub_batch()
    batch = {k: v[:1] for k, v in batch.items()}
    with pytest.raises(ValueError, match="batch_size >= 2"):
        AAMLoss()(stub, batch, step=0)


def test_loss_config_instantiates_with_the_run_seed():
    cfg = OmegaConf.merge({"seed": 4}, {"loss": OmegaConf.load(CONF / "loss" / "aam.yaml")})
    loss = instantiate(cfg.loss)
    assert isinstance(loss, AAMLoss)
    assert (loss.seed, loss.mask_fraction, loss.mask_strategy) == (4, 0.15, "random")
    span = instantiate(OmegaConf.merge(cfg.loss, {"mask_strategy": "span"}))
    batch = stub_batch()
    hidden = span.hidden_bases(batch, step=5)
    assert torch.equal(hidden, nucleotide_mask(batch["tokens"], batch["asv_ids"], 5, 4, 0.15, "span"))
