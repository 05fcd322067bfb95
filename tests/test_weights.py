"""A completed run keeps its model: model.pt holds plain-named weights, its config and target scale,
reads back with weights_only, and builds a model that gives the trained model's outputs."""

import pytest
import torch
from hydra.utils import instantiate

from aamperf.data import build_data
from aamperf.errors import UserError
from aamperf.phases import setup_phases
from aamperf.run import train
from aamperf.trainer import validate
from aamperf.weights import MODEL_FILE, load_model

CPU = torch.device("cpu")


def test_a_completed_run_keeps_a_model_that_gives_its_outputs(make_cfg, tmp_path):
    # memory=full wraps every block, aam_ops=fast changes how rows are encoded: neither may show in the file
    cfg = make_cfg("memory=full", "aam_ops=fast")
    summary = train(cfg, tmp_path)
    assert summary["model_file"] == MODEL_FILE
    payload = torch.load(tmp_path / MODEL_FILE, weights_only=True)
    assert not [
        name for name in payload["weights"] if "_checkpoint_wrapped_module" in name or "_orig_mod" in name
    ]
    assert payload["config"]["model"]["embedding_dim"] == cfg.model.embedding_dim
    assert payload["target"] == summary["target"]
    model, _ = load_model(tmp_path)
    assert sum(p.numel() for p in model.parameters()) == summary["n_params"]
    # the validation the run ended with, again on the loaded model: the same loss
    setup = setup_phases(cfg, CPU)
    data = build_data(cfg.data, batch_size=4, seed=cfg.seed, loader=setup.loader, pad_to=setup.pad_to)
    loss_fn = instantiate(cfg.loss)
    loss_fn.scale_target(payload["target"]["mean"], payload["target"]["std"])
    val = validate(model, loss_fn, data.val_loader, cfg.trainer.val_batches, CPU, False)
    assert val["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)


def test_a_run_directory_without_a_model_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"has no model.pt: only a completed run keeps its model"):
        load_model(tmp_path)
    (tmp_path / MODEL_FILE).write_bytes(b"not a torch file")
    with pytest.raises(UserError, match=r"is not a model file aamperf can read"):
        load_model(tmp_path)


def test_weights_that_do_not_fit_the_models_config_are_one_line(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=1"), tmp_path)
    payload = torch.load(tmp_path / MODEL_FILE, weights_only=True)
    payload["config"]["model"]["embedding_dim"] *= 2  # a config edited after training
    torch.save(payload, tmp_path / MODEL_FILE)
    with pytest.raises(
        UserError, match=r"its weights do not fit the model its config builds \(.*size mismatch"
    ):
        load_model(tmp_path)
