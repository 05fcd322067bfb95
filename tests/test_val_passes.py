"""trainer.val_passes (the original AAM's --val-prediction-passes): each validation reads its samples that
many times, pass k their ASVs' draw k and the bases the loss hides at step k; the loss is the mean over every
pass, the target's figures those of each sample's mean output in the target's own units."""

import pytest
import torch
from hydra.utils import instantiate

from aamperf.checks import check_config
from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.errors import UserError
from aamperf.phases import setup_phases
from aamperf.run import target_line, train
from aamperf.trainer import validate
from aamperf.weights import load_model

CPU = torch.device("cpu")


def test_a_validation_of_three_passes_averages_each_samples_outputs_over_three_draws(make_cfg, tmp_path):
    cfg = make_cfg("data.target=target", "data.asv_sampling=random", "trainer.val_passes=3")
    summary = train(cfg, tmp_path)
    assert target_line(summary).endswith("(trainer.val_batches=1), each its mean over 3 passes")
    model, _ = load_model(tmp_path)
    setup = setup_phases(cfg, CPU)
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=setup.loader, pad_to=setup.pad_to)
    loss_fn = instantiate(cfg.loss)
    loss_fn.set_target(data.target)
    detail: dict = {}
    val = validate(model, loss_fn, data.val_loader, 1, CPU, False, detail, passes=3)
    assert val["val_target_mae"] == pytest.approx(summary["val"]["val_target_mae"], rel=1e-5)

    # by hand: the first batch of the validation samples, as draws 0, 1 and 2 of their ASVs
    model.eval()
    losses, values = [], []
    with torch.no_grad():
        for draw in range(3):
            data.val_loader.sampler.draw = draw
            batch = to_device(next(iter(data.val_loader)), CPU)  # batch UniFrac from its branch sets
            losses.append(loss_fn(model, batch, draw)[0])
            out = loss_fn.outputs(model, batch, draw)[0]
            values.append(loss_fn.target.inverse(out["target"][:, 0]))
    data.val_loader.sampler.draw = 0
    assert not torch.allclose(values[0], values[1])  # each pass read other ASVs
    assert val["val_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    assert val["val_samples"] == len(batch["sample_idx"])  # the samples, not their passes
    assert detail["sample_idx"] == batch["sample_idx"].tolist()
    assert torch.allclose(
        torch.from_numpy(detail["predicted"]), torch.stack(values).mean(0).double(), atol=1e-5
    )
    one = validate(model, loss_fn, data.val_loader, 1, CPU, False)
    assert one["val_loss"] == pytest.approx(losses[0].item(), rel=1e-5)  # one pass: draw 0 alone


def test_val_passes_that_would_read_the_same_input_each_time_are_refused(make_cfg):
    with pytest.raises(UserError, match=r"trainer.val_passes=0 must be >= 1"):
        check_config(make_cfg("trainer.val_passes=0"))
    fixed = "neither data.asv_sampling=abundance nor the loss .it hides no bases. does: the same input"
    with pytest.raises(UserError, match=fixed + r".*set data.asv_sampling=random, or trainer.val_passes=1"):
        check_config(make_cfg("trainer.val_passes=2", "loss.nucleotide_weight=0"))
    check_config(make_cfg("trainer.val_passes=2"))  # each pass hides other bases
    check_config(make_cfg("trainer.val_passes=2", "loss.nucleotide_weight=0", "data.asv_sampling=random"))


def test_a_classifications_passes_average_their_probabilities():
    from types import SimpleNamespace

    from aamperf.metrics.target import validation_figures

    loss_fn = SimpleNamespace(target=SimpleNamespace(is_classification=True, classes=["a", "b"]))
    # sample 0: two passes sure of class 0, one much surer of class 1 (a mean of logits would pick 1)
    logits = torch.tensor([[[4.0, 0.0], [4.0, 0.0], [0.0, 12.0]], [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    figures, detail = validation_figures(loss_fn, torch.tensor([0, 1]).numpy(), logits.double().numpy())
    chances = torch.softmax(logits.double(), dim=-1).mean(dim=1)
    assert torch.allclose(torch.from_numpy(detail["probabilities"]), chances)
    assert detail["probabilities"].argmax(axis=1).tolist() == [0, 1] and figures["val_accuracy"] == 1.0


@pytest.mark.slow  # a process and two torchrun ranks: ~15 s on 2 cores
def test_two_ranks_validate_their_passes_as_one_process_does(launch):
    """Each rank reads its share of every pass's draws: the gathered outputs' means give one process's
    figures, and the val loss over the passes is the same."""
    from conftest import torchrun
    from test_distributed import trained

    passes = ["data.asv_sampling=random", "trainer.val_passes=3"]
    one, one_summary, _ = trained(launch, "one", *passes)
    two, summary, _ = trained(launch, "two", "distributed=ddp", *passes, launcher=torchrun(2))
    for key in ("val_loss", "val_target_mae", "val_target_r2"):
        expected = [r[key] for r in one if key in r]
        assert expected and [r[key] for r in two if key in r] == pytest.approx(expected, rel=1e-4), key
    assert summary["val"]["val_samples"] == one_summary["val"]["val_samples"] == 8
