"""aamperf/phases/attention.py: the attention phase's record says what training runs on the run's device."""

import pytest
import torch
from hydra.utils import instantiate

from aamperf.phases.attention import SDPAttention, apply_attention


def test_sdpa_flash_on_a_cpu_records_that_training_with_dropout_runs_the_chunked_math(make_cfg):
    cfg = make_cfg("attention=sdpa_flash", "model.dropout=0.1")
    model = instantiate(cfg.model)
    record = apply_attention(model, cfg.attention, torch.device("cpu"))
    assert record["status"] == "applied" and record["modules"] == 3  # one per stack of aam_tiny
    assert record["training"] == "chunked_math" and record["backends"] == ["flash"]
    assert record["note"].startswith(
        "training runs the math in cache-sized chunks with the attention dropout"
    )
    assert record["note"].endswith("the backends run only where there is no dropout: validation, evaluation")
    assert all(m.dropout_p == 0.1 for m in model.modules() if isinstance(m, SDPAttention))


@pytest.mark.parametrize(
    ("dropout", "device"), [("0.1", "cuda"), ("0", "cpu")]
)  # a CUDA kernel has dropout; without dropout a CPU runs the backends in training too
def test_sdpa_flash_records_its_backends_in_training_where_they_run_there(make_cfg, dropout, device):
    cfg = make_cfg("attention=sdpa_flash", f"model.dropout={dropout}")
    record = apply_attention(instantiate(cfg.model), cfg.attention, torch.device(device))
    assert record["training"] == "sdpa" and record["backends"] == ["flash"] and "note" not in record


def test_prediction_records_the_backends_and_nothing_about_training(make_cfg):
    cfg = make_cfg("attention=sdpa", "model.dropout=0.1")
    record = apply_attention(instantiate(cfg.model), cfg.attention)  # device None: nothing trains
    assert record["backends"] == "auto" and "training" not in record and "note" not in record
