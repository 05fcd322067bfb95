"""model.categorical_output_scaling (the original AAM's --conditional-output-scaling): the target output x a
scale + a bias per category of each data.categorical column, the identity at first, by hand against the
model's output with both target heads and packed, trained in a real run, fresh in a fine-tune, refused
without data.categorical."""

import pytest
import torch
from hydra.utils import instantiate
from test_categorical import FAST

from aamperf.checks import check_config
from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.errors import UserError
from aamperf.run import train
from aamperf.weights import load_model

CPU = torch.device("cpu")
SCALED = ["data.target=target", "data.categorical=[environment]", "model.categorical_output_scaling=true"]


def models_and_batch(make_cfg, *overrides: str):
    """(a tiny AAM conditioned on environment with output scaling, the same without, a batch)."""
    cfg = make_cfg(*SCALED, *overrides)
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader)
    cfg.model.categorical_sizes = [len(v) for v in data.categorical["vocabularies"].values()]
    torch.manual_seed(0)
    scaled = instantiate(cfg.model).eval()
    cfg.model.categorical_output_scaling = False
    plain = instantiate(cfg.model).eval()
    plain.load_state_dict({k: v for k, v in scaled.state_dict().items() if not k.startswith("output_")})
    return scaled, plain, to_device(next(iter(data.train_loader)), CPU)


def target_of(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(
            batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"], categorical=batch["categorical"]
        )
    return out["target"]


@pytest.mark.parametrize("head", ["linear", "transformer"])
def test_the_scale_and_bias_of_each_sample_s_category_multiply_and_shift_its_output(make_cfg, head):
    scaled, plain, batch = models_and_batch(make_cfg, f"model.target_head={head}")
    base = target_of(plain, batch)
    torch.testing.assert_close(target_of(scaled, batch), base)  # at first the identity
    with torch.no_grad():
        scaled.output_scales[0].weight.copy_(torch.tensor([[0.5], [2.0], [-1.0], [3.0], [0.25]]))
        scaled.output_biases[0].weight.copy_(torch.tensor([[0.0], [1.0], [-2.0], [0.5], [4.0]]))
    slot = batch["categorical"][:, 0]
    scale = scaled.output_scales[0].weight[slot].detach()
    bias = scaled.output_biases[0].weight[slot].detach()
    torch.testing.assert_close(target_of(scaled, batch), base * scale + bias)
    assert len(set(slot.tolist())) > 1  # several categories in the batch: several scales read
    scaled.pack_samples = plain.pack_samples = True  # the packed sample level: the same outputs
    torch.testing.assert_close(target_of(scaled, batch), base * scale + bias, rtol=1e-4, atol=1e-5)


def test_a_run_learns_the_scales_and_a_fine_tune_starts_them_fresh(make_cfg, tmp_path):
    summary = train(make_cfg(*FAST, *SCALED[1:], "loss.unifrac_weight=0"), tmp_path / "run")
    assert summary["status"] == "completed", summary.get("error")
    model, _ = load_model(tmp_path / "run")
    assert not torch.allclose(model.output_scales[0].weight, torch.ones_like(model.output_scales[0].weight))
    tuned = train(
        make_cfg(*FAST, *SCALED[1:], f"init.from_run={tmp_path / 'run'}", "finetune.freeze=encoder"),
        tmp_path / "tuned",
    )
    assert tuned["status"] == "completed", tuned.get("error")
    fresh = [name for name in tuned["finetune"]["fresh"] if name.startswith("output_")]
    assert fresh, tuned["finetune"]


def test_scaling_without_categorical_columns_and_a_non_boolean_are_refused(make_cfg):
    with pytest.raises(UserError, match=r"scales the target per category of data\.categorical's columns"):
        check_config(make_cfg("data.target=target", "model.categorical_output_scaling=true"))
    with pytest.raises(UserError, match=r"model\.categorical_output_scaling=sometimes must be true or false"):
        check_config(make_cfg(*SCALED[:2], "model.categorical_output_scaling=sometimes"))
