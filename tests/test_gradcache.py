"""Gradient caching (aamperf/trainer/gradcache.py): a step of k micro-batches trains as its whole batch."""

import pytest
import torch
import torch.nn.functional as F
from conftest import read_metrics
from hydra.utils import instantiate

from aamperf.data import build_data
from aamperf.data.loaders import split_batch
from aamperf.device import to_device
from aamperf.distributed import World
from aamperf.metrics import count_flops
from aamperf.model.loss import unifrac_loss
from aamperf.model.masking import masked_nucleotide_sums, nucleotide_mask
from aamperf.phases import apply_phases, setup_phases
from aamperf.run import train
from aamperf.tokens import MASK
from aamperf.trainer.gradcache import accumulation
from aamperf.trainer.stream import BatchStream

STEP = 1


def first_step(cfg, micro_batches: int):
    """(plan, loss_fn, the first step's batch) of a run of global batch 8 in `micro_batches` micro-batches,
    drawn as the training loop draws it."""
    device = torch.device("cpu")
    setup = setup_phases(cfg, device)
    torch.manual_seed(cfg.seed)
    data = build_data(
        cfg.data, batch_size=8 // micro_batches, seed=cfg.seed, loader=setup.loader, pad_to=setup.pad_to
    )
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    plan = apply_phases(model, cfg, device, lambda *a: None, setup.records, World(), 8 // micro_batches)
    stream = BatchStream(data.train_loader)
    stream.regroup(micro_batches)
    return plan, loss_fn, to_device(next(stream), device)


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def in_one_graph(plan, loss_fn, batch, micro_batches: int):
    """The reference: the whole batch's loss, written out, on the micro-batches' forwards (each drawing
    its dropout from where the last left the generator, as the cached step's first pass does), all in
    one graph; backward once. (loss, parts, gradients)"""
    rows = batch["tokens"].size(0) // micro_batches
    outs, hidden = [], []
    for m in range(micro_batches):
        mine = slice(m * rows, (m + 1) * rows)
        tokens, asv_ids = batch["tokens"][mine], batch["asv_ids"][mine]
        hidden.append(nucleotide_mask(tokens, asv_ids, STEP, loss_fn.seed, loss_fn.mask_fraction))
        outs.append(plan.model(tokens.masked_fill(hidden[-1], MASK), batch["counts"][mine], asv_ids=asv_ids))
    embedding = torch.cat([o["sample_embedding"] for o in outs])
    ce = sum(
        masked_nucleotide_sums(o["nuc_logits"], batch["tokens"][m * rows : (m + 1) * rows], h)[0]
        for m, (o, h) in enumerate(zip(outs, hidden, strict=True))
    )
    standard = (batch["target"] - loss_fn.target_mean) / loss_fn.target_std
    parts = {
        "unifrac": unifrac_loss(embedding, batch["unifrac"]),
        "nucleotide": ce / sum(h.sum() for h in hidden),
        "target": F.mse_loss(torch.cat([o["target"] for o in outs]), standard),
    }
    if "count" in outs[0]:  # the squared errors of every micro-batch's real ASVs over their number
        counts = batch["counts"].split(rows)
        squares = sum(loss_fn.count_sums(o["count"], c)[0] for o, c in zip(outs, counts, strict=True))
        parts["count"] = squares / (batch["counts"] > 0).sum()
    loss = sum(loss_fn.weights[k] * v for k, v in parts.items())
    loss.backward()
    return loss.detach(), {k: v.detach() for k, v in parts.items()}, gradients(plan.model)


def cached_step(plan, loss_fn, batch, micro_batches: int):
    """(loss, parts, gradients) of the training loop's step."""
    loss, parts = accumulation(loss_fn, micro_batches, torch.device("cpu"))(plan, batch, STEP)
    return loss, parts, gradients(plan.model)


def assert_same(got, want) -> None:
    (loss, parts, grads), (ref_loss, ref_parts, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    for name, value in ref_parts.items():
        torch.testing.assert_close(parts[name], value, rtol=1e-5, atol=1e-7, msg=name)
    assert grads.keys() == ref_grads.keys() and len(ref_grads) > 20
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_cached_micro_batches_with_dropout_give_the_whole_batch_s_loss_and_gradients(make_cfg, micro_batches):
    cfg = make_cfg("model.dropout=0.3")
    plan, loss_fn, batch = first_step(cfg, micro_batches)
    torch.manual_seed(7)
    got = cached_step(plan, loss_fn, batch, micro_batches)
    after = torch.get_rng_state()
    plan.optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    want = in_one_graph(plan, loss_fn, batch, micro_batches)
    assert_same(got, want)
    # the second pass redrew the first pass's dropout: the generator ends where one forward each leaves it
    assert torch.equal(after, torch.get_rng_state())


def test_without_dropout_the_cached_step_is_one_forward_of_the_whole_batch(make_cfg):
    cfg = make_cfg("model.dropout=0")
    plan, loss_fn, batch = first_step(cfg, 2)
    got = cached_step(plan, loss_fn, batch, 2)
    plan.optimizer.zero_grad(set_to_none=True)
    loss, parts = loss_fn(plan.model, batch, STEP)  # the batch of 8 in one forward
    loss.backward()
    assert_same(got, (loss.detach(), parts, gradients(plan.model)))


def test_cached_micro_batches_with_a_count_head_give_the_whole_batch_s_count_part(make_cfg):
    """The count part's shares over the step's real ASVs, with dropout (so the step is two passes)."""
    plan, loss_fn, batch = first_step(make_cfg("model.dropout=0.3", "model.count_head=true"), 2)
    loss_fn.set_counts(1, 60)
    torch.manual_seed(7)
    got = cached_step(plan, loss_fn, batch, 2)
    plan.optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    want = in_one_graph(plan, loss_fn, batch, 2)
    assert want[1]["count"] > 0 and any(name.startswith("count_head.") for name in want[2])
    assert_same(got, want)


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_a_cached_step_s_hardware_flops_are_those_torch_dispatches_in_it(make_cfg, micro_batches):
    """Gradient caching forwards each micro-batch twice: the hardware count is 4 forwards a micro-batch (and
    the recomputed layers), what torch's FlopCounterMode counts in the training loop's step; 3 missed one."""
    plan, loss_fn, batch = first_step(make_cfg(), micro_batches)
    step = accumulation(loss_fn, micro_batches, torch.device("cpu"))
    counted = count_flops(lambda: step(plan, batch, STEP))
    micro = split_batch(batch, micro_batches, 1)
    counts = {n: sum(plan.model.batch_flops(m["tokens"], m["asv_ids"], n)[1] for m in micro) for n in (3, 4)}
    assert counts[4] == pytest.approx(counted, rel=0.01)
    assert counts[3] < 0.9 * counted


def test_a_plug_in_model_s_cached_step_counts_its_second_forward(make_cfg, tmp_path):
    """Another model (`model._target_`) is counted by torch once, eager; gradient caching adds its forward."""
    plugin = ["~model", "+model._target_=plugin_model.EmbeddingModel", "+model.dim=8", "data.max_asvs=16"]
    plugin += ["data.target=null", "trainer.batch_size=8", "trainer.max_steps=2"]
    whole = train(make_cfg(*plugin), tmp_path / "whole")
    cached = train(make_cfg(*plugin, "trainer.grad_accum_steps=2"), tmp_path / "cached")
    assert whole["hardware_flops_per_step"] == whole["model_flops_per_step"] > 0
    # its forward is a third of forward + backward: 4/3 of the model's count (the projection, all of it)
    assert cached["hardware_flops_per_step"] == pytest.approx(4 / 3 * cached["model_flops_per_step"])


def test_accumulated_steps_train_as_the_whole_batch(make_cfg, tmp_path):
    """The issue's figures: with micro-batches taken on their own, step 1's UniFrac part was 0.39 against
    the whole batch's 0.49 (the pairs inside each micro-batch only). Without dropout (drawn otherwise for
    a micro-batch), every step of 8 in 2 or 4 micro-batches is the step of 8: its loss, parts and norm; and
    validated in batches of 8 (trainer.val_batch_size), its val loss is the step of 8's too."""
    # flop_batches=1: the FLOP count's batches take one permutation of the sampler's whatever the micro-batch
    # (more, and a pass of 8's batches ends inside them, one of 2's does not: the next permutation differs)
    same = ["model.dropout=0", "trainer.batch_size=8", "trainer.max_steps=4", "metrics.flop_batches=1"]
    whole_summary = train(make_cfg(*same), tmp_path / "whole")
    whole = read_metrics(tmp_path / "whole")
    for k in (2, 4):
        summary = train(
            make_cfg(*same, f"trainer.grad_accum_steps={k}", "trainer.val_batch_size=8"), tmp_path / f"in_{k}"
        )
        rows = read_metrics(tmp_path / f"in_{k}")
        assert [r["step"] for r in rows] == [r["step"] for r in whole] == [1, 2, 3, 4]
        for key in ("loss", "loss_unifrac", "loss_nucleotide", "loss_target", "grad_norm"):
            got, want = [r[key] for r in rows], [r[key] for r in whole]
            assert got == pytest.approx(want, rel=1e-4), (k, key)
        assert [r["samples_per_s"] * r["step_time_s"] for r in rows] == pytest.approx([8] * 4)
        assert summary["val_batch_size"] == whole_summary["val_batch_size"] == min(8, summary["n_val"])
        assert summary["val_loss"] == pytest.approx(whole_summary["val_loss"], rel=1e-4)
        # executed per model FLOP: each micro-batch's forward once more (gradient caching); baseline's
        # recomputation of every layer is a fourth forward: 5 against 4 (the FLOP batches' samples differ)
        executed = [
            s["hardware_flops_per_step"] / s["model_flops_per_step"] for s in (summary, whole_summary)
        ]
        assert executed[0] > 1.15 * executed[1]
    # left to the micro-batch, a validation batch holds 4 samples (its UniFrac part their pairs): another loss
    summary = train(make_cfg(*same, "trainer.grad_accum_steps=2"), tmp_path / "micro")
    assert summary["val_batch_size"] == 4 and summary["val_loss"] != pytest.approx(whole_summary["val_loss"])


def test_a_resumed_stream_of_whole_steps_goes_on_at_the_step_it_stopped_at(make_cfg):
    """fit loads a checkpoint's stream position, then TrainStep regroups the stream into whole steps: the
    position, counted in steps by the run that saved it, is replayed in steps."""
    cfg = make_cfg()
    setup = setup_phases(cfg, torch.device("cpu"))

    def stream() -> BatchStream:
        data = build_data(cfg.data, batch_size=2, seed=cfg.seed, loader=setup.loader, pad_to=setup.pad_to)
        return BatchStream(data.train_loader)

    first = stream()
    first.regroup(4)
    taken = [next(first)["sample_idx"].tolist() for _ in range(5)]  # 2 passes of 20 samples: 2 steps each
    again = stream()
    again.load_state_dict(first.state_dict())
    again.regroup(4)
    assert len(taken[4]) == 8 and next(again)["sample_idx"].tolist() == next(first)["sample_idx"].tolist()
    assert taken[0] != taken[2]  # a new pass, a new order: the replay is of the pass it stopped in


def test_a_step_larger_than_the_training_set_is_one_line_and_exit_2(launch_here):
    """Drawn whole, a step of more samples than the training set has would never come (the loader drops
    partial batches): refused before the first step, naming the fix."""
    proc, _ = launch_here("trainer.batch_size=64", "trainer.grad_accum_steps=8", "data.n_samples=60")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "a step of 64 samples" in proc.stderr and "training samples" in proc.stderr
