"""aam_ops: every option gives the plain model's embeddings, loss and gradients, on fewer encoded rows."""

import copy
from dataclasses import replace

import pytest
import torch
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.model.slots import bucket_size
from aamperf.phases.aam_ops import apply_aam_ops, collate_pad_to, set_full_length

MAX_ASVS = 32  # above the tiny data's mean richness (20): the batch has padding rows
OPTIONS = {"plain": "real", "padding_aware": "real", "dedup": "unique", "fast": "unique"}


@pytest.fixture
def tiny(make_cfg):
    """aam_tiny without dropout, its loss, and one real batch of 8 samples padded both ways."""
    cfg = make_cfg("model.dropout=0", f"model.max_asvs={MAX_ASVS}")
    torch.manual_seed(0)
    model = instantiate(cfg.model).eval()
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader)
    items = [data.dataset[i] for i in next(iter(data.train_loader))["sample_idx"].tolist()]
    cpu = torch.device("cpu")  # where each batch gets its UniFrac (batch mode)
    fixed = to_device(data.collate(items), cpu)  # [8, max_asvs, 151]
    longest = to_device(replace(data.collate, pad_to=None)(items), cpu)
    bucketed = to_device(replace(data.collate, pad_to=None, bucket_cap=MAX_ASVS)(items), cpu)
    real = fixed["asv_ids"] >= 0
    # the batch this test needs: padding rows, and ASVs held by more than one sample
    assert longest["tokens"].shape[1] < MAX_ASVS and real.sum() < real.numel()
    assert fixed["asv_ids"][real].unique().numel() < real.sum()
    assert bucketed["tokens"].shape[1] == bucket_size(longest["tokens"].shape[1])
    return cfg, model, instantiate(cfg.loss), fixed, longest, bucketed


def run(model, loss_fn, batch) -> dict:
    """Sample embeddings (unmasked input), loss at step 1 and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        out = model(batch["tokens"], batch["counts"], asv_ids=batch["asv_ids"])
    loss, _ = loss_fn(model, batch, 1)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"embedding": out["sample_embedding"], "asv": out["asv_embedding"], "loss": loss.detach(), **grads}


def assert_same(got: dict, expected: dict) -> None:
    torch.testing.assert_close(got["embedding"], expected["embedding"], atol=1e-5, rtol=0)
    width = got["asv"].shape[1]  # padded to the longest sample: the plain batch's first columns
    torch.testing.assert_close(got["asv"], expected["asv"][:, :width], atol=1e-5, rtol=0)
    assert (expected["asv"][:, width:] == 0).all()
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=1e-5, atol=0)
    grads = [name for name in expected if name not in ("embedding", "asv", "loss")]
    assert len(grads) == len(got) - 3 > 20 and all(expected[n].abs().sum() > 0 for n in grads[:3])
    for name in grads:  # fp32 rounding of sums taken in another order: relative to the gradient's scale
        # (floored: a pooling score's bias has a zero gradient, softmax ignores a shift, so only ~1e-10 noise)
        scale = max(expected[name].abs().max().item(), 1e-4)
        torch.testing.assert_close(got[name], expected[name], atol=1e-5 * scale, rtol=0, msg=name)


@pytest.mark.parametrize("option", ["padding_aware", "dedup", "fast"])
def test_every_option_gives_the_plain_embeddings_loss_and_gradients(tiny, make_cfg, option):
    cfg, model, loss_fn, fixed, longest, bucketed = tiny
    expected = run(model, loss_fn, fixed)
    other = copy.deepcopy(model)
    set_full_length(other, fixed["tokens"][fixed["asv_ids"] >= 0])  # as a run does, from its data
    assert other.full_length_asvs  # the simulated ASVs: 150 bp, no PAD inside
    ops = make_cfg(f"aam_ops={option}").aam_ops
    record = apply_aam_ops(other, ops)
    bucket = option == "fast"
    want = {"status": "applied", "reason": None, "asv_rows": OPTIONS[option], "bucket": bucket}
    assert record == ({**want, "asv_masks": False} if option == "fast" else want)
    assert other.unmasked_asvs == (option == "fast")
    batch = {None: longest, "bucket": bucketed}.get(collate_pad_to(ops, MAX_ASVS), fixed)
    assert_same(run(other, loss_fn, batch), expected)
    if ops.skip_padding:  # and the same loss on the batch padded to max_asvs
        torch.testing.assert_close(run(other, loss_fn, fixed)["loss"], expected["loss"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("dedup", [True, False])
def test_bucketed_shapes_give_the_plain_embeddings_loss_and_gradients_in_fp32(tiny, make_cfg, dedup):
    """aam_ops.bucket pads the encoded rows, the batch width and the slot index to bucket sizes: the same
    results, each distinct ASV encoded once or each real slot."""
    cfg, model, loss_fn, fixed, longest, bucketed = tiny
    expected = run(model, loss_fn, fixed)
    other = copy.deepcopy(model)
    ops = make_cfg("aam_ops=fast", "aam_ops.bucket=true", f"aam_ops.dedup={dedup}").aam_ops
    assert apply_aam_ops(other, ops)["bucket"] is True and collate_pad_to(ops, MAX_ASVS) == "bucket"
    seen = []
    other.asv_encoder.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    assert_same(run(other, loss_fn, bucketed), expected)
    real = bucketed["asv_ids"] >= 0
    rows = bucketed["asv_ids"][real].unique().numel() if dedup else int(real.sum())
    assert seen[0] == bucket_size(rows) > rows  # padding rows were encoded, and dropped
    assert other.count_encoded_rows(bucketed["tokens"], bucketed["asv_ids"]) == seen[0]


def test_bucket_sizes_are_few_and_pad_by_under_a_quarter():
    sizes = [bucket_size(n) for n in range(1, 1025)]
    assert all(n <= b <= max(4, n * 1.25) for n, b in zip(range(1, 1025), sizes, strict=True))
    assert sorted(set(sizes[64:128])) == [80, 96, 112, 128]  # four per doubling
    assert all(bucket_size(b) == b for b in set(sizes))


def test_fewer_rows_are_encoded(tiny):
    _, model, loss_fn, fixed, longest, _ = tiny
    seen = []
    model.asv_encoder.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    ids = fixed["asv_ids"]
    rows = {}
    for mode, batch in (("all", fixed), ("real", longest), ("unique", longest)):
        model.asv_rows = mode
        seen.clear()
        loss_fn(model, batch, 1)
        rows[mode] = seen[0]
        assert rows[mode] == model.count_encoded_rows(batch["tokens"], batch["asv_ids"])
    assert rows["all"] == ids.numel()
    assert rows["real"] == (ids >= 0).sum() < rows["all"]
    assert rows["unique"] == ids[ids >= 0].unique().numel() < rows["real"]
    flops = [model.flops_per_step(8, MAX_ASVS, rows[mode]) for mode in ("all", "real", "unique")]
    assert flops[0] > flops[1] > flops[2]


def test_records_and_padding_of_every_option(make_cfg):
    for option, rows in OPTIONS.items():
        ops = make_cfg(f"aam_ops={option}").aam_ops
        model = instantiate(make_cfg().model)
        record = apply_aam_ops(model, ops)
        assert model.asv_rows == record["asv_rows"] == rows and model.bucket_rows == (option == "fast")
        assert record["status"] == ("skipped" if option == "plain" else "applied")
        assert record["reason"] == ("aam_ops=plain" if option == "plain" else None)
        assert collate_pad_to(ops, 16) == {"padding_aware": None, "fast": "bucket"}.get(option, 16)
    other = torch.nn.Linear(2, 2)
    assert apply_aam_ops(other, make_cfg("aam_ops=dedup").aam_ops) == {
        "status": "skipped",
        "reason": "model has no ASV encoder (not AAM)",
        "asv_rows": None,
    }
    assert not hasattr(other, "asv_rows")


def test_the_collates_slot_index_is_what_forward_would_find_on_the_device(tiny):
    """The real slots and distinct ASVs the collate finds on the host (no GPU read back in forward) are
    nonzero's and unique's of the batch, whichever way it is padded."""
    from aamperf.tokens import PAD

    *_, fixed, longest, bucketed = tiny
    for batch in (fixed, longest, bucketed):
        real = (batch["tokens"] != PAD).any(-1).reshape(-1)
        n_real = batch["n_real_slots"]  # the bucketed batch's index is padded past it (its sinks); else None
        assert torch.equal(batch["real_slots"][:n_real], real.nonzero().squeeze(1))
        ids = batch["asv_ids"].reshape(-1)[batch["real_slots"][:n_real]]
        distinct, inverse = torch.unique(ids, return_inverse=True)
        assert torch.equal(batch["unique_inverse"][:n_real], inverse)
        first = batch["unique_first"][: len(distinct)]
        assert torch.equal(ids[first], distinct)
        assert all(int(first[inverse[i]]) <= i for i in range(len(ids)))  # each ASV's first slot


class SyncingOps(TorchDispatchMode):
    """The ops dispatched that a GPU answers only by a host sync (their output's size or a value read
    back): nonzero, unique, masked_select, an item, an index by a bool mask."""

    SYNCING = {"nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}
    SYNCING |= {"_local_scalar_dense"}  # .item(), bool(), int() of a tensor

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING or (
            name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        ):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_a_training_step_of_aam_ops_fast_runs_no_op_that_waits_for_the_gpu(tiny, make_cfg):
    """With the collate's slot index, forward, loss and backward dispatch no op that syncs on a GPU (the
    CUDA run: tests/gpu/test_cuda_parts.py); without it, forward finds the slots itself (nonzero, unique)."""
    from aamperf.model.slots import SLOT_KEYS

    cfg, model, loss_fn, *_, bucketed = tiny
    apply_aam_ops(model, make_cfg("aam_ops=fast").aam_ops)
    with SyncingOps() as found:
        loss, _ = loss_fn(model.train(), bucketed, 1)
        loss.backward()
    assert found.seen == []
    without = {k: v for k, v in bucketed.items() if k not in SLOT_KEYS}
    with SyncingOps() as found:
        loss_fn(model, without, 1)[0].backward()
    assert found.seen == ["nonzero", "_unique2"]


class OpShapes(TorchDispatchMode):
    """Each op dispatched, with the shapes of its tensor outputs: what a compiled graph is specialized on."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, tuple | list) else [out]
        self.seen.append((str(func), [tuple(o.shape) for o in leaves if isinstance(o, torch.Tensor)]))
        return out


def test_the_slot_index_in_buckets_gives_every_op_of_a_step_the_same_shapes_within_a_bucket(tiny, make_cfg):
    """aam_ops.bucket: the collate pads the real slots and distinct ASVs to bucket sizes on the host
    (`aamperf.model.slots.bucketed`), so that a batch with one real ASV fewer runs the same shapes through
    forward and backward (a compiled graph or CUDA graph reused, not made again); unpadded, they differ."""
    from aamperf.model.slots import SLOT_KEYS, bucketed, slot_index
    from aamperf.tokens import PAD

    cfg, model, loss_fn, *_, batch = tiny
    apply_aam_ops(model, make_cfg("aam_ops=fast").aam_ops)
    n_slots = batch["tokens"].shape[0] * batch["tokens"].shape[1]
    fewer = dict(batch, tokens=batch["tokens"].clone(), asv_ids=batch["asv_ids"].clone())
    real = (fewer["tokens"] != PAD).any(-1)
    sample = int(real.sum(1).argmax())  # its last real slot made padding: one real ASV fewer
    slot = int(real[sample].nonzero().max())
    fewer["tokens"][sample, slot], fewer["asv_ids"][sample, slot] = PAD, -1

    def index(b: dict) -> dict:  # as the collate finds it, before the buckets
        slots = (b["tokens"] != PAD).any(-1).reshape(-1).nonzero().squeeze(1)
        return slot_index(slots, b["asv_ids"].reshape(-1)[slots])

    assert len(index(fewer)["real_slots"]) == len(index(batch)["real_slots"]) - 1
    padded = [bucketed(index(b), n_slots) for b in (batch, fewer)]
    assert all(torch.equal(padded[0][k], batch[k]) for k in SLOT_KEYS[:3])  # the collate's, as it sent it
    assert [len(padded[0][k]) for k in SLOT_KEYS[:3]] == [len(padded[1][k]) for k in SLOT_KEYS[:3]]

    def shapes(b: dict) -> list:
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)  # each backward makes its gradients anew
        with OpShapes() as seen:
            loss_fn(model.train(), b, 1)[0].backward()
        return seen.seen

    assert shapes(dict(batch, **padded[0])) == shapes(dict(fewer, **padded[1]))
    assert shapes(dict(batch, **index(batch))) != shapes(dict(fewer, **index(fewer)))  # unpadded
