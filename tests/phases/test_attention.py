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


@pytest.mark.parametrize("phase", ["attention", "dropout"])
def test_a_module_swapped_into_an_evaluated_model_stays_in_eval_mode(make_cfg, phase):
    """Prediction swaps attention into a model already in eval mode: the new modules must not drop out.
    The same samples twice give the same outputs, those of the model before the swap (fp32)."""
    from aamperf.phases.dropout import FastDropout, apply_dropout

    cfg = make_cfg("attention=sdpa", "dropout=fast", "model.dropout=0.1")
    model = instantiate(cfg.model).eval()
    tokens = torch.randint(1, 5, (3, 6, model.seq_len))
    counts = torch.ones(3, 6, 1)
    with torch.no_grad():
        want = model(tokens, counts)["sample_embedding"]
    if phase == "attention":
        apply_attention(model, cfg.attention)
    else:
        apply_dropout(model, cfg.dropout, torch.device("cpu"))
    swapped = [m for m in model.modules() if isinstance(m, SDPAttention | FastDropout)]
    assert swapped and not any(m.training for m in swapped)
    with torch.no_grad():
        first, again = (model(tokens, counts)["sample_embedding"] for _ in range(2))
    assert torch.equal(first, again)
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6)
    model.train()  # and a model trained afterwards drops out again
    assert all(m.training for m in swapped)


def test_a_compiled_block_training_on_a_cpu_with_attention_dropout_compiles_once_for_every_batch_size(
    make_cfg, monkeypatch
):
    """The compile phase has the chunked attention with dropout run eagerly between a compiled block's
    graphs: traced, its loop over chunks of rows was unrolled into the graph and guarded on the batch's
    rows, so every new batch shape compiled again (10-13 recompiles in a 30-step headline run). Masks
    drawn eagerly too."""
    from torch._dynamo.testing import CompileCounter

    from aamperf.model.layers import Block
    from aamperf.phases import attention
    from aamperf.phases.compile import run_eagerly_in_graphs
    from aamperf.phases.dropout import apply_dropout

    monkeypatch.setattr(attention, "CHUNK_BYTES", 2 * 4 * 17 * 17 * 4)  # 2 rows a chunk: several chunks
    cfg = make_cfg("attention=sdpa", "dropout=fast")
    block = Block(32, 4, 2, 0.1).train()
    apply_attention(block, cfg.attention, torch.device("cpu"))
    apply_dropout(block, cfg.dropout, torch.device("cpu"))
    run_eagerly_in_graphs(block)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter, dynamic=True)
    frames = []
    for n in (5, 7, 11):
        mask = torch.rand(n, 1, 1, 17) > 0.2
        mask[..., 0] = True
        compiled(torch.randn(n, 17, 32), mask).sum().backward()
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[1:] == [frames[0]] * 2
