"""AAM model: shapes, padding invariance, batch independence, the attention swap point, presets."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from aamperf.model import AAM, AAMLoss, MathAttention

CONF = Path(__file__).parents[2] / "conf"


def tiny(**kwargs) -> AAM:
    torch.manual_seed(0)
    sizes = {"embedding_dim": 32, "num_heads": 2, "asv_layers": 1, "sample_layers": 1, "encoder_layers": 1}
    return AAM(**{**sizes, "max_asvs": 16, **kwargs})


def asvs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n real ASVs of varying length (START + bases + trailing pad) and their counts."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 5, (n, 151), generator=g)
    tokens[:, 0] = 5
    for row, length in enumerate(torch.randint(100, 151, (n,), generator=g).tolist()):
        tokens[row, length:] = 0
    return tokens, torch.randint(1, 50, (n, 1), generator=g).float()


def pad_to(tokens: torch.Tensor, counts: torch.Tensor, n_asvs: int) -> tuple[torch.Tensor, torch.Tensor]:
    extra = n_asvs - tokens.size(0)
    return F.pad(tokens, (0, 0, 0, extra)), F.pad(counts, (0, 0, 0, extra))


def test_outputs_have_the_documented_shapes_and_padding_asvs_are_zero():
    model = tiny(target_dim=3)
    tokens, counts = pad_to(*asvs(5, seed=1), 8)
    out = model(tokens[None].repeat(2, 1, 1), counts[None].repeat(2, 1, 1))
    assert out["sample_embedding"].shape == (2, 32)
    assert out["asv_embedding"].shape == (2, 8, 32)
    assert out["nuc_logits"].shape == (2, 8, 151, 7)
    assert out["target"].shape == (2, 3)
    assert all(torch.isfinite(v).all() for v in out.values())
    assert (out["asv_embedding"][:, 5:] == 0).all()  # padding ASVs
    assert (out["asv_embedding"][:, :5].abs().sum(-1) > 0).all()  # real ASVs


def test_no_target_head_when_target_dim_is_zero():
    out = tiny(target_dim=0)(*(t[None] for t in pad_to(*asvs(3, seed=1), 4)))
    assert "target" not in out


def test_sample_embedding_does_not_change_when_padding_asvs_are_added():
    model = tiny().eval()
    tokens, counts = asvs(6, seed=2)
    short = model(*(t[None] for t in pad_to(tokens, counts, 8)))["sample_embedding"]
    long = model(*(t[None] for t in pad_to(tokens, counts, 16)))["sample_embedding"]
    torch.testing.assert_close(long, short, atol=1e-5, rtol=1e-5)
    # and the embedding does depend on the real ASVs, so the equality above is not vacuous
    tokens[0, 10] = 1 + tokens[0, 10] % 4
    changed = model(*(t[None] for t in pad_to(tokens, counts, 8)))["sample_embedding"]
    assert (changed - short).abs().max() > 1e-4


def test_sample_embedding_does_not_depend_on_the_other_samples():
    model = tiny().eval()
    samples = [pad_to(*asvs(n, seed=s), 8) for s, n in [(3, 4), (4, 8), (5, 1)]]
    alone = model(samples[0][0][None], samples[0][1][None])["sample_embedding"][0]
    together = model(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))
    torch.testing.assert_close(together["sample_embedding"][0], alone, atol=1e-5, rtol=1e-5)


def test_counts_enter_only_through_the_count_embedding():
    tokens, counts = pad_to(*asvs(4, seed=6), 8)
    for enabled in (True, False):
        model = tiny(count_embedding=enabled).eval()
        a = model(tokens[None], counts[None])["sample_embedding"]
        b = model(tokens[None], 3 * counts[None])["sample_embedding"]
        assert ((a - b).abs().max() > 1e-4) == enabled


class SDPA(torch.nn.Module):
    """The replacement an attention phase would install."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_attention_is_one_swappable_module_and_sdpa_matches_it():
    model = tiny(asv_layers=2).eval()
    tokens, counts = pad_to(*asvs(5, seed=7), 8)
    batch = tokens[None].repeat(2, 1, 1), counts[None].repeat(2, 1, 1)
    expected = model(*batch)
    swapped = 0
    for module in model.modules():
        if isinstance(getattr(module, "attend", None), MathAttention):
            module.attend = SDPA()
            swapped += 1
    assert swapped == 2 + 1 + 1  # asv_layers + sample_layers + encoder_layers
    got = model(*batch)
    for key in ("sample_embedding", "asv_embedding", "nuc_logits"):
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-4)


def test_training_step_gives_finite_gradients_with_padding_rows():
    model = tiny().train()
    samples = [pad_to(*asvs(n, seed=s), 8) for s, n in [(8, 3), (9, 8)]]
    batch = {
        "tokens": torch.stack([s[0] for s in samples]),
        "counts": torch.stack([s[1] for s in samples]),
        "unifrac": torch.tensor([[0.0, 0.6], [0.6, 0.0]]),
        "sample_idx": torch.tensor([0, 1]),
        "asv_ids": torch.tensor([[0, 1, 2, -1, -1, -1, -1, -1], list(range(3, 11))]),
        "target": torch.tensor([[1.0], [2.0]]),
    }
    total, parts = AAMLoss()(model, batch, step=0)
    total.backward()
    assert set(parts) == {
        "unifrac",
        "nucleotide",
        "target",
        "target_mae",
    }  # the MAE: reported, not trained on
    assert total.item() == pytest.approx(float(parts["unifrac"] + parts["nucleotide"] + parts["target"]))
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["token_embedding.weight"].abs().sum() > 0
    assert grads["target_head.weight"].abs().sum() > 0


def test_asv_row_modes_give_the_same_outputs_and_unique_needs_asv_ids():
    model = tiny().eval()
    tokens, counts = pad_to(*asvs(5, seed=11), 8)
    tokens, counts = torch.stack([tokens, tokens.roll(2, 0)]), torch.stack([counts, counts.roll(2, 0)])
    ids = torch.tensor([[0, 1, 2, 3, 4, -1, -1, -1], [-1, -1, 0, 1, 2, 3, 4, -1]])  # the same 5 ASVs
    assert model.asv_rows == "real"  # the original AAM's default: padding rows are not encoded
    model.asv_rows = "all"
    expected = model(tokens, counts)
    assert (expected["nuc_logits"][ids < 0] == 0).all()  # padding rows, also when all rows are encoded
    for mode in ("real", "unique"):
        model.asv_rows = mode
        got = model(tokens, counts, asv_ids=ids)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5)
    assert model.count_encoded_rows(tokens, ids) == 5
    model.asv_rows = "real"
    assert model.count_encoded_rows(tokens, ids) == 10
    model.asv_rows = "unique"
    with pytest.raises(ValueError, match=r"aam_ops\.dedup"):
        model(tokens, counts)
    model.asv_rows = "some"
    with pytest.raises(ValueError, match=r"asv_rows='some' is not one of"):
        model(tokens, counts)


def test_more_asvs_than_max_asvs_is_refused_with_the_fix():
    tokens, counts = asvs(17, seed=10)
    with pytest.raises(ValueError, match="model.max_asvs"):
        tiny()(tokens[None], counts[None])


@pytest.mark.parametrize(
    ("preset", "dim", "max_asvs"), [("aam_tiny", 32, 16), ("aam_small", 48, 16), ("aam_base", 128, 1024)]
)
def test_model_presets_instantiate(preset, dim, max_asvs):
    model = instantiate(OmegaConf.load(CONF / "model" / f"{preset}.yaml"))
    assert isinstance(model, AAM)
    assert model.asv_position.num_embeddings == max_asvs
    assert model.token_embedding.embedding_dim == dim
    assert model.asv_encoder.blocks[0].attn.attend.dropout_p == 0.1
