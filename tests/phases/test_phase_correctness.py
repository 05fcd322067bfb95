"""Each fp32 phase gives the baseline's loss and gradients; bf16 stays close over several steps."""

import copy
import multiprocessing

import pytest
import torch
from hydra.utils import instantiate
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from aamperf.data import build_data
from aamperf.device import to_device
from aamperf.model.layers import Block
from aamperf.phases.attention import SDPAttention, apply_attention
from aamperf.phases.compile import apply_compile
from aamperf.phases.memory import apply_checkpointing
from aamperf.phases.precision import apply_precision


@pytest.fixture
def tiny(make_cfg):
    """aam_tiny without dropout (so two runs draw no random numbers), one real batch."""
    cfg = make_cfg("model.dropout=0")
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    loss_fn = instantiate(cfg.loss)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    return cfg, model, loss_fn, to_device(next(iter(data.train_loader)), torch.device("cpu"))


def loss_and_grads(model, loss_fn, batch, autocast=None):
    model.zero_grad(set_to_none=True)
    with autocast() if autocast else torch.autocast("cpu", enabled=False):
        loss, _ = loss_fn(model, batch, 1)
    loss.backward()
    # parameter names as in the state_dict: wrappers (checkpointing) add a prefix to named_parameters()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()
    }
    return loss.detach(), grads


def assert_same(reference, other, rtol=1e-5, atol=1e-6):
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    torch.testing.assert_close(loss_b, loss_a, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=rtol, atol=atol, msg=name)


def test_sdpa_gives_the_math_results(tiny, make_cfg):
    cfg, model, loss_fn, batch = tiny
    reference = loss_and_grads(model, loss_fn, batch)
    for option in ("sdpa", "sdpa_math"):
        other = copy.deepcopy(model)
        record = apply_attention(other, make_cfg(f"attention={option}").attention)
        assert record["status"] == "applied" and record["modules"] == 3  # one per stack of aam_tiny
        assert sum(isinstance(m, SDPAttention) for m in other.modules()) == 3
        assert_same(reference, loss_and_grads(other, loss_fn, batch))


@pytest.mark.parametrize(
    ("impl", "dtype", "heads", "pad"),
    [
        ("standard", torch.float32, 4, 32),  # fp32 rows are never padded
        ("fast", torch.bfloat16, 2, 1),
        ("fast", torch.bfloat16, 2, 32),  # the softmax's rows padded from 151 keys to 160
    ],
)  # head_dim 8 (its sqrt not a power of two) and 16
def test_sdpa_training_with_dropout_on_cpu_gives_the_math_results_in_chunks(
    make_cfg, monkeypatch, impl, dtype, heads, pad
):
    """No CPU SDPA kernel has dropout: SDPAttention runs the math a few rows at a time, drawing the same
    keep mask from the same random stream, so loss and gradients equal the math's with that dropout: the
    same bits, but where a bf16 softmax's rows are padded (PAD_KEYS_TO), which rounds a few weights the
    other way: then within bf16's rounding."""
    from aamperf.phases import attention
    from aamperf.phases.dropout import apply_dropout

    monkeypatch.setattr(attention, "PAD_KEYS_TO", pad)

    cfg = make_cfg("model.dropout=0.3", f"model.num_heads={heads}", f"dropout={impl}")
    torch.manual_seed(0)
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    data = build_data(cfg.data, batch_size=4, seed=0, loader=cfg.dataloader)
    batch = to_device(next(iter(data.train_loader)), torch.device("cpu"))
    chunked = copy.deepcopy(model)
    apply_attention(chunked, make_cfg("attention=sdpa").attention)
    for m in (model, chunked):
        apply_dropout(m, cfg.dropout, torch.device("cpu"))
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)  # one row a chunk: every chunk boundary is crossed
    autocast = lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731
    results = []
    for m in (model, chunked):
        torch.manual_seed(1)
        results.append(loss_and_grads(m, loss_fn, batch, autocast))
    if dtype == torch.bfloat16 and pad > 1:  # the weights' rounding, carried through the model
        assert_same(*results, rtol=0.02, atol=1e-4)
        assert any(not torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])  # padded
    else:
        assert_same(*results)  # the same ops on the same rows (dk as d_scores^T q: rounding may differ)
    torch.manual_seed(2)  # another keep mask: another loss (the dropout is there)
    assert loss_and_grads(chunked, loss_fn, batch, autocast)[0] != results[1][0]


@pytest.mark.parametrize("masked", [False, True])
def test_a_bf16_softmax_over_padded_keys_is_the_unpadded_one_within_a_unit_in_its_last_place(
    monkeypatch, masked
):
    """PAD_KEYS_TO: the chunked attention's bf16 scores padded from 7 keys to 32 (-inf: weight 0) give the
    unpadded outputs and gradients within bf16's rounding, a row whose keys are all masked included (its
    weight spread over its 7 keys, not over the padding); the weights themselves differ in few elements,
    by one unit in the last place, and are no farther from the exact softmax (fp64)."""
    from aamperf.phases import attention

    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(5, 2, 7, 4, generator=gen).bfloat16() for _ in range(3)]
    mask = torch.rand(5, 1, 7, 7, generator=gen) < 0.6 if masked else None
    if masked:
        mask[1, :, 3] = False  # query 3 of row 1 may attend nowhere
    results = []
    for pad in (1, 32):
        monkeypatch.setattr(attention, "PAD_KEYS_TO", pad)
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        torch.manual_seed(3)
        out = SDPAttention(0.25, [])(q, k, v, mask)
        (out.float() * torch.arange(out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=0.02, atol=1e-2)
    # the weights of AAM's 151 keys, padded to 160 and not
    queries = torch.randn(64, 4, 151, 32, generator=gen).bfloat16()
    keys = torch.randn(64, 4, 151, 32, generator=gen).bfloat16()
    ctx = type("Ctx", (), {"sqrt_d": 32**0.5, "keys": 151, "hidden": None})()
    padded = torch.cat([keys, keys.new_zeros(64, 4, 9, 32)], dim=-2)
    plain, with_pad = (
        attention.ChunkedDropoutAttention._weights(ctx, queries, k, slice(0, 64)) for k in (keys, padded)
    )
    exact = torch.softmax((queries.double() @ keys.double().transpose(-2, -1)) / 32**0.5, -1)
    differ = plain != with_pad
    assert 0 < differ.sum() < 1e-3 * plain.numel()
    ulp = (plain.float() - with_pad.float()).abs()[differ] / plain.float().abs()[differ]
    assert ulp.max() <= 2**-7  # bf16 keeps 8 significant bits: one unit in the last place
    assert (with_pad.double() - exact).abs().sum() <= 1.01 * (plain.double() - exact).abs().sum()


def test_chunked_attention_with_dropout_matches_the_math_on_fully_masked_rows_too(monkeypatch):
    """A row whose keys are all masked gets a uniform softmax in the math, and no gradient through the
    masked scores: the chunked path must agree there too (key_padding_mask never makes one; a user's
    mask may)."""
    from aamperf.model.layers import MathAttention
    from aamperf.phases import attention

    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(5, 2, 7, 4, generator=gen) for _ in range(3)]
    mask = torch.rand(5, 1, 7, 7, generator=gen) < 0.6
    mask[1, :, 3] = False  # query 3 of row 1 may attend nowhere
    results = []
    for module in (MathAttention(0.25), SDPAttention(0.25, [])):
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        torch.manual_seed(3)
        out = module(q, k, v, mask)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("option", ["full", "selective"])
def test_checkpointing_gives_the_same_loss_and_gradients(tiny, make_cfg, option):
    cfg, model, loss_fn, batch = tiny
    reference = loss_and_grads(model, loss_fn, batch)
    other = copy.deepcopy(model)
    record = apply_checkpointing(other, make_cfg(f"memory={option}").memory)
    assert record["status"] == "applied" and record["layers"] == 3
    assert other.state_dict().keys() == model.state_dict().keys()  # checkpoints stay interchangeable
    assert_same(reference, loss_and_grads(other, loss_fn, batch))


@pytest.mark.slow  # 41-55 s in a new inductor cache (CI's): the default suite stays near 10 minutes
def test_compile_gives_the_same_loss_and_gradients_and_traces_the_recomputation_of_checkpointed_blocks(
    tiny, make_cfg
):
    """Plain blocks and one that memory= recomputes (as memory=selective leaves them: some of each), in
    one compile: each gives the eager loss and gradients, and the recomputed one is compiled with its
    checkpoint wrapper, the recomputation in the block's graph (an H100 run that compiled the block
    inside its wrapper recomputed with another graph). One compile for both: about 55 s in a new
    inductor cache on a 2-core AVX2 EPYC, against 85 s for a test of each."""
    cfg, model, loss_fn, batch = tiny
    reference = loss_and_grads(model, loss_fn, batch)
    other = copy.deepcopy(model)
    stack = next(m for m in other.modules() if isinstance(m, nn.ModuleList) and isinstance(m[0], Block))
    stack[0] = checkpoint_wrapper(stack[0])  # what apply_checkpointing does to a block it recomputes
    record = apply_compile(
        other, make_cfg("compile=default").compile, lambda: loss_and_grads(other, loss_fn, batch)
    )
    assert record["status"] == "applied" and record["modules"] == 3, record
    assert record["compile_time_s"] > 0
    compiled = sorted(type(m).__name__ for m in other.modules() if m._compiled_call_impl is not None)
    assert compiled == ["Block", "Block", "CheckpointWrapper"]  # not the block inside its wrapper
    assert_same(reference, loss_and_grads(other, loss_fn, batch), rtol=1e-4, atol=1e-5)


def test_compile_failure_falls_back_to_eager_and_says_why(tiny, make_cfg):
    cfg, model, loss_fn, batch = tiny
    other = copy.deepcopy(model)
    bad = make_cfg("compile=default", "compile.backend=no_such_backend").compile
    record = apply_compile(other, bad, lambda: loss_and_grads(other, loss_fn, batch))
    assert record["status"] == "fallback" and "no_such_backend" in record["reason"]
    assert_same(loss_and_grads(model, loss_fn, batch), loss_and_grads(other, loss_fn, batch))


def test_bf16_autocast_stays_close_to_fp32_over_steps(tiny, make_cfg):
    """Five AdamW steps on the same batches: bf16 losses within 2% of fp32 ones."""
    cfg, model, loss_fn, batch = tiny
    autocast, scaler, record = apply_precision(make_cfg("precision=bf16").precision, torch.device("cpu"))
    assert record["status"] == "applied" and not scaler.is_enabled()
    with autocast():
        assert torch.matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16

    def losses(m, ctx):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        out = []
        for _ in range(5):
            loss, _ = loss_and_grads(m, loss_fn, batch, ctx)
            opt.step()
            out.append(loss.item())
        return torch.tensor(out)

    fp32 = losses(copy.deepcopy(model), None)
    bf16 = losses(copy.deepcopy(model), autocast)
    assert fp32[-1] < fp32[0]  # it trains
    torch.testing.assert_close(bf16, fp32, rtol=0.02, atol=0)
    assert not torch.equal(bf16, fp32)  # and bf16 really ran in lower precision


def test_fast_dropout_keeps_the_distribution():
    from aamperf.phases.dropout import FastDropout, keep_mask

    torch.manual_seed(0)
    keep = keep_mask(torch.Size([1000, 1000]), 0.1, torch.device("cpu"))
    assert abs(keep.float().mean().item() - 0.9) < 0.002  # 1M draws: sd of the mean is 0.0003
    assert keep_mask(torch.Size([1000, 1000]), 0.1, torch.device("cpu")).ne(keep).any()  # fresh each call
    x = torch.ones(1000, 1000, requires_grad=True)
    drop = FastDropout(0.1)
    y = drop(x)
    assert y.unique().tolist() == [0.0, pytest.approx(1 / 0.9)]
    assert abs(y.mean().item() - 1.0) < 0.005  # expectation preserved
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())  # gradient flows through kept elements only, scaled
    assert torch.equal(drop.eval()(x), x)


@pytest.mark.parametrize(
    "dtype, p",
    [(dtype, p) for dtype in (torch.bfloat16, torch.float16) for p in (0.1, 0.5, 0.9, 2**-18)]
    + [(torch.bfloat16, 1 - 2**-18)],  # (fp16 has no 1 / (1 - p) there: inf, and the cast's 0 * inf NaN)
)
def test_a_2_byte_dropout_multiplier_is_its_keep_mask_times_the_scale(dtype, p):
    """keep_multiplier makes, from the random int16 in place, what casting keep_mask of the same stream
    gives (FastDropout's arithmetic before it), bit for bit, and leaves the stream where keep_mask does;
    p under 2^-17 keeps every element, p above 1 - 2^-17 none."""
    from aamperf.phases.dropout import FastDropout, keep_mask, keep_multiplier, keep_scale

    shape, cpu = torch.Size([37, 1001]), torch.device("cpu")
    x = torch.randn(shape, dtype=dtype)
    torch.manual_seed(0)
    keep = keep_mask(shape, p, cpu)
    expected, after = keep.to(dtype) * keep_scale(p, x), torch.randint(2**30, (4,))
    assert keep.all() if p < 2**-17 else keep.any() if p < 1 - 2**-17 else not keep.any()
    torch.manual_seed(0)
    multiplier = keep_multiplier(shape, p, dtype, cpu)
    assert multiplier.dtype == dtype and torch.equal(multiplier, expected)
    assert torch.equal(torch.randint(2**30, (4,)), after)
    assert multiplier.view(torch.int16).ge(0).all()  # +0.0 where dropped, never -0.0
    torch.manual_seed(0)
    leaf = x.clone().requires_grad_()
    y = FastDropout(p)(leaf)
    y.float().sum().backward()
    assert torch.equal(y, x * expected) and torch.equal(leaf.grad, expected)


@pytest.mark.parametrize("threads", [2, 3])
def test_fast_dropout_masks_are_the_same_on_any_number_of_threads(threads):
    """The words are drawn in blocks, each from a generator seeded from the default stream: the seed alone
    decides the mask (a run gives the same losses with dropout.threads=1), and the stream moves on."""
    from aamperf.phases.dropout import BLOCK_WORDS, keep_mask

    shape = torch.Size([4, 3 * 4 * BLOCK_WORDS + 5])  # 4 mask elements a word: 12 blocks and a short one
    torch.manual_seed(0)
    one = keep_mask(shape, 0.1, torch.device("cpu"), threads=1)
    after_one = torch.randint(2**30, (4,))
    torch.manual_seed(0)
    many = keep_mask(shape, 0.1, torch.device("cpu"), threads=threads)
    assert torch.equal(one, many) and torch.equal(torch.randint(2**30, (4,)), after_one)
    # no block repeats another (each its own generator), and the keep share is 1 - p in each
    blocks = one.view(-1)[: 12 * 4 * BLOCK_WORDS].view(12, -1)
    assert len({tuple(b[:64].tolist()) for b in blocks}) == 12
    assert (blocks.float().mean(1) - 0.9).abs().max() < 0.002  # 1M draws a block: sd 0.0003


def _masks_in_a_forked_child(queue) -> None:
    from aamperf.phases.dropout import BLOCK_WORDS, keep_mask

    torch.set_num_threads(1)  # as a loader worker does: OpenMP's threads do not survive a fork
    keep = keep_mask(torch.Size([8 * BLOCK_WORDS]), 0.1, torch.device("cpu"), threads=2)
    queue.put(keep.float().mean().item())


def test_a_process_forked_after_masks_were_drawn_on_threads_draws_its_own():
    """A loader worker forked from a run that drew masks on threads has none of those threads: it makes
    its own pool instead of waiting on the parent's forever."""
    from aamperf.phases.dropout import BLOCK_WORDS, keep_mask

    keep_mask(torch.Size([8 * BLOCK_WORDS]), 0.1, torch.device("cpu"), threads=2)  # the pool's threads run
    fork = multiprocessing.get_context("fork")
    queue = fork.Queue()
    child = fork.Process(target=_masks_in_a_forked_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    child.kill()
    assert not alive and child.exitcode == 0 and abs(queue.get(timeout=5) - 0.9) < 0.01


def test_fast_dropout_phase_reaches_every_dropout_and_keeps_eval_exact(make_cfg):
    from aamperf.phases.dropout import FastDropout, apply_dropout

    cfg = make_cfg("attention=sdpa")
    model = instantiate(cfg.model)
    n_dropout = sum(type(m) is torch.nn.Dropout for m in model.modules())
    apply_attention(model, cfg.attention)  # SDPA on CPU keeps a math path whose dropout is a module
    record = apply_dropout(model, make_cfg("dropout=fast").dropout, torch.device("cpu"))
    assert record["modules"] == n_dropout
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert sum(isinstance(m, FastDropout) for m in model.modules()) == n_dropout
