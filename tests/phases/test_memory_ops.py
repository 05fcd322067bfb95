"""memory=ops: op-level selective checkpointing keeps the matmuls' outputs and recomputes the other ops,
with the gradients of no checkpointing."""

import copy
import weakref
from collections import Counter

import pytest
import torch
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.model import AAM
from aamperf.phases.attention import apply_attention
from aamperf.phases.compile import apply_compile
from aamperf.phases.memory import apply_checkpointing
from aamperf.run import train


@pytest.fixture
def tiny(make_cfg):
    """aam_tiny with its dropout on (the seed before each pass draws the same masks), one real batch."""
    cfg = make_cfg()
    assert cfg.model.dropout > 0
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    return cfg, model, instantiate(cfg.loss), to_device(next(iter(data.train_loader)), torch.device("cpu"))


class CountOps(TorchDispatchMode):
    """aten ops dispatched while it is on, by name (recomputed ones included), and the storages of
    their outputs (weakly: those alive later are what something kept)."""

    def __init__(self):
        super().__init__()
        self.ops, self.outputs = Counter(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.outputs.append(weakref.ref(t.untyped_storage()))
        return out

    def kept_bytes(self) -> int:
        alive = {id(s): s for ref in self.outputs if (s := ref()) is not None}
        return sum(s.nbytes() for s in alive.values())


def step(model, loss_fn, batch):
    """Loss, gradients (named as in the state_dict), bytes of forward's outputs kept for backward, ops
    of backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every model
    with CountOps() as forward:
        loss, _ = loss_fn(model, batch, 1)
    kept = forward.kept_bytes()
    with CountOps() as backward:
        loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()
    }
    return loss.detach(), grads, kept, backward.ops


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(b[0], a[0], rtol=rtol, atol=atol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(b[1][name], a[1][name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize(
    "attention, dropout",
    [("math", True), ("sdpa", False), ("sdpa", True)],  # sdpa with dropout on a CPU: its chunked Function
)
def test_ops_gives_the_gradients_of_no_checkpointing_and_recomputes_only_the_cheap_ops(
    tiny, make_cfg, attention, dropout
):
    cfg, model, loss_fn, batch = tiny
    if not dropout:
        model = instantiate(make_cfg("model.dropout=0").model)
    apply_attention(model, make_cfg(f"attention={attention}").attention)
    runs = {}
    for option in ("none", "full", "ops"):
        other = copy.deepcopy(model)
        record = apply_checkpointing(other, make_cfg(f"memory={option}").memory)
        assert record["status"] == ("skipped" if option == "none" else "applied")
        runs[option] = step(other, loss_fn, batch)
    assert_same(runs["none"], runs["ops"])
    (_, _, kept, ops), (_, _, kept_full, full) = runs["ops"], runs["full"]
    _, _, kept_none, none = runs["none"]
    # forward keeps fewer bytes than without checkpointing (the cheap ops' outputs go), more than full
    assert kept_full < kept < kept_none
    # backward recomputes the blocks' layer norms and GELUs (3 stacks of aam_tiny, 1 block each) ...
    assert ops["native_layer_norm"] == none["native_layer_norm"] + 2 * 3
    assert ops["gelu"] == none["gelu"] + 3
    # ... but not one projection, where full runs each block's again
    projections = ("mm", "addmm")
    assert [ops[m] for m in projections] == [none[m] for m in projections]
    assert sum(full[m] for m in projections) > sum(none[m] for m in projections)
    attention_ops = ("bmm", "_scaled_dot_product_flash_attention_for_cpu")
    if attention == "sdpa" and dropout:  # the chunked Function runs under no_grad: recomputed whole
        assert ops["bmm"] > none["bmm"]
    else:  # nor the attention's matmuls or kernel
        assert [ops[m] for m in attention_ops] == [none[m] for m in attention_ops]
        assert sum(full[m] for m in attention_ops) > sum(none[m] for m in attention_ops)


def test_ops_records_what_it_keeps_and_counts_no_recomputed_matmul_in_the_hardware_flops(make_cfg):
    """The hardware FLOPs (HFU) count a recomputed layer's matmuls again; memory=ops recomputes none."""
    sizes = {"embedding_dim": 32, "num_heads": 2, "asv_layers": 2, "sample_layers": 1, "encoder_layers": 1}
    plain, model = AAM(max_asvs=16, dropout=0.1, **sizes), AAM(max_asvs=16, dropout=0.1, **sizes)
    record = apply_checkpointing(model, make_cfg("memory=ops").memory)
    assert record["mode"] == "ops" and record["every"] == 1 and record["layers"] == 4
    assert "aten.mm" in record["saved_ops"] and "aten.gelu" not in record["saved_ops"]
    assert model.checkpointed_layers() == (0, 0, 0, 0)  # layers whose matmuls run again in backward
    tokens = torch.randint(1, 5, (4, 12, 151), generator=torch.Generator().manual_seed(0))
    tokens[:, 8:] = 0  # padding slots
    asv_ids = torch.where(tokens[..., 0] > 0, torch.arange(48).view(4, 12), -1)
    batch = {"tokens": tokens, "counts": torch.ones(4, 12, 1), "asv_ids": asv_ids}
    assert model.batch_flops(tokens, asv_ids) == plain.batch_flops(tokens, asv_ids)
    with FlopCounterMode(display=False) as counter:  # what torch dispatches: no more than without it
        out = model(batch["tokens"], batch["counts"], batch["asv_ids"])
        (out["sample_embedding"].sum() + out["nuc_logits"].sum()).backward()
    with FlopCounterMode(display=False) as plain_counter:
        out = plain(batch["tokens"], batch["counts"], batch["asv_ids"])
        (out["sample_embedding"].sum() + out["nuc_logits"].sum()).backward()
    assert counter.get_total_flops() == plain_counter.get_total_flops()


def loss_and_gradients(model, loss_fn, batch):
    """step()'s first two, with no dispatch mode on: under one (CountOps) dynamo runs nothing compiled."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss, _ = loss_fn(model, batch, 1)
    loss.backward()
    return loss.detach(), {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()
    }


@pytest.mark.slow  # compiles of 3 blocks, about a minute each on 2 cores in a new inductor cache
@pytest.mark.parametrize("dynamic", [False, True])
def test_ops_compiles_with_its_policy_and_keeps_the_gradients(tiny, make_cfg, dynamic):
    """Against the same model compiled without checkpointing (a compiled graph draws its dropout masks its
    own way, not eager's). Dynamic shapes as compile=auto compiles (compile=default too once a batch's
    shape changes): on torch 2.11 each such compile failed without aamperf's rules
    (aamperf/phases/recompute.py) and the run fell back to eager."""
    cfg, model, loss_fn, batch = tiny
    runs = {}
    for memory in ("none", "ops"):
        other = copy.deepcopy(model)
        apply_checkpointing(other, make_cfg(f"memory={memory}").memory)
        options = make_cfg("compile=default", f"compile.dynamic={dynamic}").compile
        record = apply_compile(other, options, lambda m=other: loss_and_gradients(m, loss_fn, batch))
        assert record["status"] == "applied" and record["modules"] == 3 and record["graphs"] > 0, record
        runs[memory] = loss_and_gradients(other, loss_fn, batch)
    compiled = sorted(type(m).__name__ for m in other.modules() if m._compiled_call_impl is not None)
    assert compiled == ["CheckpointWrapper"] * 3  # the policy traced into each block's graph
    assert_same(runs["none"], runs["ops"], rtol=1e-4, atol=1e-5)


def test_a_run_with_memory_ops_completes_and_records_it(make_cfg, tmp_path):
    summary = train(make_cfg("memory=ops"), tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 3
    phase = summary["phases"]["checkpointing"]
    assert phase["status"] == "applied" and phase["mode"] == "ops" and phase["layers"] == 3
