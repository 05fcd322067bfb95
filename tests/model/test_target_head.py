"""The transformer target head (model.target_head=transformer, the original AAM's): a fresh transformer
and attention pooling over the sample encoder's per-ASV states. Its outputs from the tokens, from cached
states, padded and packed, are one; the option is checked before a run and fine-tuned into fresh."""

import pandas as pd
import pytest
import torch
from conftest import weights_of
from hydra.utils import instantiate
from test_packed import assert_same, batch, model, run
from test_predict_targets import model_outputs, predicted_here

from aamperf.checks import check_config
from aamperf.errors import UserError
from aamperf.finetune import load_pretrained
from aamperf.model import AAM
from aamperf.rng import seed_everything
from aamperf.run import train


def transformer_head(**kwargs) -> AAM:
    return model(**{"target_head": "transformer", "target_layers": 2, **kwargs})


def test_the_head_reads_the_per_asv_states_and_is_the_same_from_them():
    data = batch(full_length=False)
    net = transformer_head().eval()
    assert "asv_states" not in net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])  # a step: none
    net.keep_states = True  # as the cache of a frozen encoder sets it while embedding
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])
    real = out["asv_real"]
    assert out["asv_states"].shape == (4, data["tokens"].size(1), 32)
    assert out["asv_states"][~real].abs().max() == 0 and out["asv_states"][real].abs().max() > 0.1
    cached = net(sample_embedding=out["sample_embedding"], asv_states=out["asv_states"], asv_real=real)
    torch.testing.assert_close(cached["target"], out["target"], atol=1e-6, rtol=1e-6)
    # the states it reads are not only the pooled embedding's: moving one sample's ASV states moves its target
    moved = out["asv_states"].clone()
    moved[0, 0] = torch.randn(
        32, generator=torch.Generator().manual_seed(0)
    )  # not a shift: LayerNorm drops those
    again = net(sample_embedding=out["sample_embedding"], asv_states=moved, asv_real=real)["target"]
    assert not torch.allclose(again[0], out["target"][0]) and torch.allclose(again[1:], out["target"][1:])
    with pytest.raises(ValueError, match="model.target_head=transformer reads the per-ASV states"):
        net(sample_embedding=out["sample_embedding"])


def test_packed_the_head_gives_the_padded_outputs_and_gradients():
    data = batch(full_length=False)
    net = transformer_head()
    padded = run(net, data)
    net.pack_samples = True
    assert_same(run(net, data), padded)
    net.eval()  # and from cached states, packed by the model as the sample level is
    net.keep_states = True
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])
    cached = net(
        sample_embedding=out["sample_embedding"], asv_states=out["asv_states"], asv_real=out["asv_real"]
    )
    torch.testing.assert_close(cached["target"], out["target"], atol=1e-6, rtol=1e-6)


def test_an_unknown_head_is_refused_with_the_choices(make_cfg):
    with pytest.raises(ValueError, match="target_head=mlp must be one of linear, transformer"):
        transformer_head(target_head="mlp")
    with pytest.raises(UserError, match="model.target_head=mlp must be one of linear, transformer"):
        check_config(make_cfg("model.target_head=mlp"))
    with pytest.raises(UserError, match=r"model.target_layers=-1 must be an integer >= 0"):
        check_config(make_cfg("model.target_layers=-1"))


def test_a_linear_pretraining_fine_tunes_into_a_fresh_transformer_head(make_cfg, pretrained):
    """The pretrained run (target_head=linear) holds no target transformer: it starts fresh, the encoder
    loaded whole."""
    cfg = make_cfg(f"init.from_run={pretrained}", "data.target=target", "model.target_head=transformer")
    seed_everything(cfg.seed)
    net, summary, saved = instantiate(cfg.model), {}, weights_of(pretrained)
    load_pretrained(net, cfg, summary)
    ours = net.state_dict()
    heads = [n for n in ours if n.split(".")[0] in ("target_head", "target_encoder", "target_pool")]
    assert summary["finetune"]["fresh"] == heads and any(n.startswith("target_encoder.") for n in heads)
    assert all(torch.equal(ours[n], saved[n]) for n in saved if n not in heads)
    assert summary["finetune"]["tensors_loaded"] == len([n for n in saved if n not in heads])


def test_a_frozen_fine_tune_with_the_head_trains_on_cached_states_and_predicts_its_outputs(
    make_cfg, pretrained, tmp_path
):
    frozen = ["finetune.freeze=encoder", "loss.unifrac_weight=0", "loss.nucleotide_weight=0"]
    cfg = make_cfg(
        f"init.from_run={pretrained}", "data.target=target", *frozen, "model.target_head=transformer"
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["finetune"]["cached_embeddings"]["cached"] == "sample embeddings and per-ASV states"
    table, _ = predicted_here(tmp_path / "run", tmp_path / "out")
    ids, outputs, payload = model_outputs(tmp_path / "run")  # the saved model on the tokens, by hand
    own = outputs.squeeze(1) * payload["target"]["scale"] + payload["target"]["shift"]
    assert list(table.index) == ids
    torch.testing.assert_close(torch.tensor(table["predicted"].to_numpy()), own, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("head", ["linear", "transformer"])
def test_a_target_activation_is_that_function_of_the_plain_head_s_output(head):
    data = batch(full_length=False)
    outputs, shift = {}, None
    for activation in ("none", "sigmoid", "relu", "softplus", "exp"):
        net = model(target_head=head, target_layers=1, target_activation=activation).eval()
        with torch.no_grad():  # the same weights each time, the outputs centred: some below 0, some above
            if shift is None:
                shift = -net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])["target"].median()
            net.target_head.bias += shift
        outputs[activation] = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])["target"]
    plain = outputs["none"]
    assert plain.min() < 0 < plain.max()  # something for relu to cut
    for activation, function in (
        ("sigmoid", torch.sigmoid),
        ("relu", torch.relu),
        ("softplus", torch.nn.functional.softplus),
        ("exp", torch.exp),
    ):
        torch.testing.assert_close(outputs[activation], function(plain))
    with pytest.raises(ValueError, match="target_activation=tanh must be one of none, sigmoid, relu"):
        model(target_activation="tanh")


def test_a_bounded_regression_predicts_within_its_bound_and_a_classification_is_refused(make_cfg, tmp_path):
    """softplus on a target of the simulated data's, half of it below 0 (no transform): every prediction
    written is >= 0; an activation over a classification's logits is refused before any step."""
    bounded = ["model.target_activation=softplus", "data.target_transform=none", "trainer.max_steps=4"]
    summary = train(make_cfg(*bounded), tmp_path / "softplus")
    assert summary["status"] == "completed"
    table = pd.read_csv(tmp_path / "softplus" / "val_predictions.tsv", sep="\t", index_col=0)
    assert (table["observed"] < 0).any() and (table["predicted"] >= 0).all()
    with pytest.raises(UserError, match=r"^model.target_activation=sigmoid bounds a regression's output; "):
        train(make_cfg("model.target_activation=sigmoid", "data.target=environment"), tmp_path / "classes")


@pytest.mark.parametrize("head", ["linear", "transformer"])
def test_hidden_widths_make_the_head_an_mlp_and_residual_adds_a_linear_of_its_input(head):
    """The original AAM's regressor head: Linear, ReLU per width, then the output Linear; with the residual,
    plus a Linear of what the head reads (what the plain Linear head would read)."""
    data = batch(full_length=False)
    seen = []
    net = model(target_head=head, target_layers=1, target_hidden_dims=[8, 4], target_residual=True).eval()
    net.target_head.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    out = net(data["tokens"], data["counts"], asv_ids=data["asv_ids"])["target"]
    widths = [(m.in_features, m.out_features) for m in net.target_head.mlp if isinstance(m, torch.nn.Linear)]
    assert widths == [(32, 8), (8, 4), (4, 2)] and net.target_head.skip.in_features == 32
    (x,) = seen
    mlp = net.target_head.mlp
    by_hand = mlp[4](torch.relu(mlp[2](torch.relu(mlp[0](x))))) + net.target_head.skip(x)
    torch.testing.assert_close(out, by_hand)
    plain = model(target_head=head, target_layers=1, target_hidden_dims=[8], target_dropout=0.5)
    assert [type(m).__name__ for m in plain.target_head.mlp] == ["Linear", "ReLU", "Dropout", "Linear"]
    assert plain.target_head.skip is None and isinstance(model().target_head, torch.nn.Linear)


def test_a_bad_mlp_head_is_refused_before_a_run(make_cfg):
    with pytest.raises(UserError, match=r"model.target_residual=true adds a Linear beside the MLP of "):
        check_config(make_cfg("model.target_residual=true"))
    with pytest.raises(
        UserError, match=r"model.target_hidden_dims=\[16, 0\] must be a list of integers >= 1"
    ):
        check_config(make_cfg("model.target_hidden_dims=[16,0]"))
    with pytest.raises(UserError, match=r"model.target_dropout=1.0 must be a number in \[0, 1\)"):
        check_config(make_cfg("model.target_dropout=1.0"))
    with pytest.raises(UserError, match=r"model.target_hidden_dims=None must be a list of integers >= 1"):
        check_config(make_cfg("model.target_hidden_dims=null"))
    with pytest.raises(UserError, match=r"model.target_dropout=0.2 is the dropout between the MLP's layers"):
        check_config(make_cfg("model.target_dropout=0.2"))


def test_a_run_with_an_mlp_head_trains_fine_tunes_fresh_and_predicts(make_cfg, pretrained, tmp_path):
    mlp = ["model.target_hidden_dims=[16,8]", "model.target_dropout=0.1", "model.target_residual=true"]
    cfg = make_cfg(f"init.from_run={pretrained}", "data.target=target", *mlp)
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] == "completed"
    fresh = summary["finetune"]["fresh"]
    assert "target_head.mlp.0.weight" in fresh and "target_head.skip.weight" in fresh
    table, _ = predicted_here(tmp_path / "run", tmp_path / "out")
    ids, outputs, payload = model_outputs(tmp_path / "run")  # the saved MLP on the tokens, by hand
    own = outputs.squeeze(1) * payload["target"]["scale"] + payload["target"]["shift"]
    torch.testing.assert_close(torch.tensor(table["predicted"].to_numpy()), own, rtol=1e-5, atol=1e-7)
