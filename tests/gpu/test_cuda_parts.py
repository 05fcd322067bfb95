"""The CUDA parts under a run, each on a real GPU: TF32, every SDPA kernel with AAM's padding masks
against the written-out math, the allocator's settings, the GPU monitor (pynvml). `pytest -m gpu`;
skipped, with the reason, where torch sees no CUDA device (tests/conftest.py)."""

import time

import pytest
import torch

from aamperf.device import resolve_device
from aamperf.errors import UserError
from aamperf.metrics.flops import matmul_dtype
from aamperf.metrics.monitor import _GPU, SystemMonitor
from aamperf.metrics.snapshot import RECORDING, RECORDING_UNDER_RECOMPUTE
from aamperf.model.layers import MathAttention, key_padding_mask
from aamperf.phases.attention import SDPAttention, check_attention
from aamperf.phases.memory import apply_cuda_memory
from aamperf.phases.precision import apply_precision
from aamperf.phases.system import apply_system
from aamperf.probe_measures import measure_attention

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_the_runs_gpu_becomes_the_current_one_and_a_missing_one_is_refused_in_one_line():
    last = torch.cuda.device_count() - 1
    assert (
        resolve_device(f"cuda:{last}")
        == torch.device(f"cuda:{last}")
        == torch.device("cuda", torch.cuda.current_device())
    )
    assert resolve_device("auto") == torch.device("cuda:0") and torch.cuda.current_device() == 0
    with pytest.raises(UserError, match=rf"device=cuda:{last + 1} but this machine shows {last + 1} CUDA"):
        resolve_device(f"cuda:{last + 1}")


def test_fp32_matmuls_run_in_tf32_with_matmul_precision_high(make_cfg):
    before = torch.get_float32_matmul_precision()
    a, b = (torch.randn(1024, 1024, device=CUDA) for _ in range(2))
    exact = a.double() @ b.double()

    def error() -> float:
        return ((a @ b).double() - exact).abs().max().item() / exact.abs().max().item()

    try:
        record = apply_precision(make_cfg("precision.matmul_precision=high").precision, CUDA)[2]
        assert record["matmul_precision"] == "high" and torch.get_float32_matmul_precision() == "high"
        fast = error()
        torch.set_float32_matmul_precision("highest")
        full = error()
    finally:
        torch.set_float32_matmul_precision(before)
    if torch.cuda.get_device_capability(CUDA)[0] >= 8:  # Ampere on: TF32's 10-bit mantissa shows
        assert fast > 10 * full, (fast, full)
        assert matmul_dtype(CUDA, "fp32", "high") == "tf32"
    else:  # no TF32: the same fp32 matmul, and MFU against the fp32 peak
        assert fast == pytest.approx(full, rel=0.5)
        assert matmul_dtype(CUDA, "fp32", "high") == "fp32"
    assert matmul_dtype(CUDA, "fp32", "highest") == "fp32"


def test_cudnn_benchmark_is_switched_as_asked(make_cfg):
    before = torch.backends.cudnn.benchmark
    try:
        for on in (True, False):
            records = apply_system(make_cfg(f"system.cudnn_benchmark={on}").system, CUDA)
            assert torch.backends.cudnn.benchmark is on and records["cudnn_benchmark"]["enabled"] is on
    finally:
        torch.backends.cudnn.benchmark = before


# ---- attention: every SDPA kernel with AAM's masks --------------------------------------------------

N, HEADS, L, HEAD_DIM = 6, 4, 40, 32


def padded(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [N, heads, L, head_dim] and AAM's key-padding mask: rows of 40, 23, 7, 1 and 0 real
    positions (the empty row is a padding ASV the baseline still encodes: left unmasked), and one full."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = (torch.randn(N, HEADS, L, HEAD_DIM, device=CUDA, generator=gen).to(dtype) for _ in range(3))
    lengths = torch.tensor([40, 23, 7, 1, 0, 40], device=CUDA)
    real = torch.arange(L, device=CUDA)[None, :] < lengths[:, None]
    return q, k, v, key_padding_mask(real)


def forward_backward(attend: torch.nn.Module, q, k, v, mask) -> list[torch.Tensor]:
    """The output and the gradients of q, k, v for a fixed projection of it, in fp32."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, mask)
    weights = torch.linspace(-1, 1, out.numel(), device=CUDA).view_as(out)
    (out.float() * weights).sum().backward()
    return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True))


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "math"])
def test_each_sdpa_kernel_with_aams_masks_matches_the_math_or_is_refused_before_the_run(
    make_cfg, backend, dtype
):
    q, k, v, mask = padded(dtype)
    want = forward_backward(MathAttention(0.0), q.float(), k.float(), v.float(), mask)  # the reference
    cfg = make_cfg("attention=sdpa", f"attention.backends=[{backend}]").attention
    problems = check_attention(cfg, CUDA, dtype)
    if backend == "flash" or (backend == "cudnn" and problems):
        # FlashAttention takes no attention mask (and no fp32); cuDNN's kernel some masks and dtypes
        # only, by torch version: either way the run is refused at its start, in one line, naming it
        assert len(problems) == 1 and f"attention.backends=['{backend}'] cannot run on cuda" in problems[0]
        assert "use attention=sdpa" in problems[0] and "\n" not in problems[0]
        if backend == "flash" and dtype != torch.float32:  # without a mask it runs, and matches
            unmasked = forward_backward(MathAttention(0.0), q.float(), k.float(), v.float(), None)
            got = forward_backward(SDPAttention(0.0, ["flash"]).eval(), q, k, v, None)
            assert relative_error(got, unmasked) < TOLERANCE[dtype]
        return
    assert problems == []
    got = forward_backward(SDPAttention(0.0, [backend]).eval(), q, k, v, mask)
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_the_attention_probe_times_each_candidate_at_row_counts_it_has_not_run():
    """attention=auto's evidence on a GPU: SDPA's steady and new-shape seconds, and where cuDNN's kernel
    runs, SDPA without it (cuDNN builds a plan per shape: AAM's rows change from batch to batch)."""
    record = measure_attention(CUDA, torch.bfloat16, (64, 4, 151, 32), True, (0.1, "standard"))
    candidates = {"math", "sdpa", "sdpa_no_cudnn"} if "sdpa_no_cudnn_s" in record else {"math", "sdpa"}
    assert set(record["new_shape_s"]) == candidates and all(s > 0 for s in record["new_shape_s"].values())
    if "cudnn" in record["backends"] and {"flash", "efficient"} & set(record["backends"]):
        assert "cudnn" not in record["no_cudnn_backends"] and record["no_cudnn_backends"][-1] == "math"
        assert record["sdpa_no_cudnn_s"] > 0


def test_sdpa_on_cuda_drops_attention_in_training_with_the_kernels_own_dropout():
    q, k, v, mask = padded(torch.bfloat16)
    attend = SDPAttention(0.5, []).train()
    torch.manual_seed(0)
    first = attend(q, k, v, mask)
    torch.manual_seed(1)
    second = attend(q, k, v, mask)
    evaluated = attend.eval()(q, k, v, mask)
    assert not torch.equal(first, second) and not torch.equal(first, evaluated)  # random masks, on CUDA
    assert torch.isfinite(first).all()


# ---- the allocator's settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recording",
    [
        RECORDING_UNDER_RECOMPUTE,
        {"context": "state", "stacks": "python"},
        pytest.param(RECORDING, marks=pytest.mark.xfail(reason="fails on torch 2.11, H200 (snapshot.py)")),
    ],
    ids=["under-recompute", "state-stacks", "aamperf"],
)
def test_a_snapshot_recording_survives_a_recompute_with_dropout_in_backward(recording):
    """metrics.memory_snapshot's recording of a model that recomputes, over a checkpointed block with dropout
    (stacks for the allocations alone: passed on an H200, 2026-11-28). The others: stacks for the live blocks
    only, its fallback (passed there too, and names no allocating line); aamperf's for other models, which
    failed here on torch 2.11 on three H200s."""
    block = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Dropout(0.1)).to(CUDA)
    x = torch.randn(64, 151, 128, device=CUDA, requires_grad=True)
    torch.cuda.memory._record_memory_history(**recording, max_entries=10_000)
    try:
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
        traces = torch.cuda.memory._snapshot()["device_traces"]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert x.grad is not None and any(e["action"] == "alloc" for device in traces for e in device)


def segment_of(tensor: torch.Tensor) -> dict:
    """The CUDA allocator's segment that holds `tensor` (torch.cuda.memory_snapshot())."""
    at = tensor.data_ptr()
    return next(
        s for s in torch.cuda.memory_snapshot() if s["address"] <= at < s["address"] + s["total_size"]
    )


def test_memory_fraction_and_expandable_segments_are_applied_and_put_back(make_cfg):
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.empty_cache()
    try:
        cfg = make_cfg("memory.cuda_memory_fraction=0.05", "memory.expandable_segments=true").memory
        record = apply_cuda_memory(cfg, CUDA)
        assert record["status"] == "applied" and record["memory_fraction"] == 0.05
        assert record["expandable_segments"] is True
        inside = torch.empty(int(0.02 * total), dtype=torch.uint8, device=CUDA)
        assert segment_of(inside)["is_expandable"]
        del inside
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(0.1 * total), dtype=torch.uint8, device=CUDA)  # twice the fraction
    finally:
        # the next job's defaults: the whole device, segments that do not expand
        record = apply_cuda_memory(make_cfg().memory, CUDA)
        torch.cuda.empty_cache()
    assert record["status"] == "skipped"
    fits_again = torch.empty(int(0.1 * total), dtype=torch.uint8, device=CUDA)
    assert not segment_of(fits_again)["is_expandable"]
    del fits_again
    torch.cuda.empty_cache()


# ---- the GPU monitor ----------------------------------------------------------------------------------


def test_the_monitor_reads_this_gpus_utilisation_and_memory_through_pynvml():
    import pynvml

    gpu = _GPU(torch.cuda.current_device())
    try:  # NVML's device is torch's (by UUID, whatever CUDA_VISIBLE_DEVICES numbers)
        name = pynvml.nvmlDeviceGetName(gpu.handle)
        assert (name.decode() if isinstance(name, bytes) else name) == torch.cuda.get_device_name(CUDA)
    finally:
        gpu.close()
    torch.cuda.reset_peak_memory_stats(CUDA)
    probe = torch.empty(8192, 8192, device=CUDA)  # a probe's transient before the first step: 256 MiB
    del probe
    with SystemMonitor(CUDA, interval_s=0.05) as monitor:
        x = torch.randn(4096, 4096, device=CUDA)
        end = time.perf_counter() + 1.5
        while time.perf_counter() < end:
            x = torch.tanh(x @ x)
            torch.cuda.synchronize()
    summary = monitor.summary()
    assert summary["peak_device_bytes"] == torch.cuda.max_memory_allocated(CUDA) >= 4096 * 4096 * 4
    assert summary["setup_peak_device_bytes"] >= 8192 * 8192 * 4 > summary["peak_device_bytes"]  # kept apart
    assert summary["gpu_util_percent"] > 10 and summary["peak_gpu_used_bytes"] >= summary["peak_device_bytes"]


def test_a_trials_draws_on_the_gpu_leave_the_runs_cuda_stream_as_it_was():
    """forked_rng (compile, loader and probe trials): dropout on the GPU draws from its CUDA generator,
    which torch's fork_rng(devices=[]) would leave advanced."""
    from aamperf.rng import forked_rng

    torch.cuda.manual_seed(0)
    expected = torch.rand(4, device=CUDA)
    torch.cuda.manual_seed(0)
    with forked_rng(CUDA):
        torch.nn.functional.dropout(torch.ones(1024, device=CUDA), 0.5)
    torch.testing.assert_close(torch.rand(4, device=CUDA), expected)


# ---- AAM's packed sample level and unmasked ASV encoder on CUDA (aam_ops.pack_samples / unmask_full_length)


def aam_on_cuda(dropout: float = 0.0):
    """An AAM at small shapes on the GPU, SDPA swapped in, and a batch of 4 samples of 3 to 60 real ASVs
    (one after a padding slot) of full-length ASVs (no PAD inside), padded to 64."""
    from omegaconf import OmegaConf

    from aamperf.model import AAM
    from aamperf.phases.attention import apply_attention

    torch.manual_seed(0)
    sizes = {"embedding_dim": 64, "num_heads": 4, "asv_layers": 1, "sample_layers": 2, "encoder_layers": 1}
    model = AAM(**sizes, max_asvs=64, dropout=dropout).to(CUDA)
    apply_attention(model, OmegaConf.create({"impl": "sdpa", "backends": []}))
    g = torch.Generator().manual_seed(1)
    tokens = torch.zeros(4, 64, 151, dtype=torch.long)
    for sample, slots in enumerate([range(3), range(60), [1], range(17)]):
        for slot in slots:
            tokens[sample, slot] = torch.randint(1, 5, (151,), generator=g)
            tokens[sample, slot, 0] = 5  # START
    counts = torch.randint(1, 50, (4, 64, 1), generator=g).float() * (tokens[..., :1] > 0)
    return model, tokens.to(CUDA), counts.to(CUDA)


def aam_step(model, tokens, counts, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """Sample embeddings and every parameter's gradient of one forward + backward under autocast(dtype)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = model(tokens, counts)
        loss = out["sample_embedding"].float().square().sum() + out["target"].float().sum()
        loss = loss + out["nuc_logits"].float().square().mean()
    loss.backward()
    return out["sample_embedding"].float().detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_sample_level_on_cuda_gives_the_padded_embeddings_and_gradients(dtype):
    """fp32: nested jagged SDPA (torch's memory-efficient varlen kernel); bf16, no dropout: varlen_attn.
    Each against the padded path in fp32: in bf16 no further from it than the padded path in bf16 (on a
    CPU its gradients are ~20% off fp32 there, the packed path's 0.3%) or 3%."""
    model, tokens, counts = aam_on_cuda()
    reference, reference_grads = aam_step(model, tokens, counts, torch.float32)
    padded, padded_grads = aam_step(model, tokens, counts, dtype)
    seen = []
    model.sample_transformer.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    model.pack_samples = True
    packed, packed_grads = aam_step(model, tokens, counts, dtype)
    assert seen == [(3 + 60 + 1 + 17, 64)]  # the real ASVs, packed
    floor = 1e-4 if dtype == torch.float32 else 3e-2
    assert relative(packed, reference) <= max(2 * relative(padded, reference), floor)
    assert reference_grads.keys() == packed_grads.keys()
    for name, want in reference_grads.items():
        bound = max(2 * relative(padded_grads[name], want), 3 * floor)
        assert relative(packed_grads[name], want) <= bound, name


def test_the_packed_sample_level_on_cuda_trains_with_dropout_and_checkpointing(make_cfg):
    """Dropout in bf16: nested jagged SDPA with the kernel's own dropout, under activation checkpointing."""
    from aamperf.phases.memory import apply_checkpointing

    model, tokens, counts = aam_on_cuda(dropout=0.1)
    apply_checkpointing(model, make_cfg("memory=full").memory)
    model.pack_samples = True
    first, grads = aam_step(model.train(), tokens, counts, torch.bfloat16)
    second, _ = aam_step(model, tokens, counts, torch.bfloat16)
    assert all(torch.isfinite(g).all() for g in grads.values()) and torch.isfinite(first).all()
    assert (first - second).abs().max() > 1e-3  # dropout drew anew


def test_memory_budget_on_cuda_keeps_less_at_the_peak_with_dropouts_gradients(make_cfg):
    """memory=budget compiled on the GPU (a whole stack, dropout on, bf16 as ultra trains): the peak of
    forward + backward lower than without a budget, the gradients those of the same compiled stack
    (inductor's Philox masks, drawn again from the seeds aamperf/phases/recompute.py saves)."""
    import copy

    from aamperf.model.layers import Transformer
    from aamperf.phases.compile import apply_compile
    from aamperf.phases.memory import UNBUDGETED, apply_checkpointing, set_compiled_recompute

    torch.manual_seed(0)
    stack = Transformer(dim=128, num_heads=4, num_layers=4, ffn_mult=4, dropout=0.1).to(CUDA)
    x = torch.randn(512, 151, 128, device=CUDA)

    def step(model) -> tuple[dict, int]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        torch.cuda.reset_peak_memory_stats(CUDA)
        start = torch.cuda.memory_allocated(CUDA)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(x, None).float().square().mean()
        loss.backward()
        peak = torch.cuda.max_memory_allocated(CUDA) - start
        return {n: p.grad.float().clone() for n, p in model.named_parameters()}, peak

    runs = {}
    try:
        for memory in ("none", "budget"):
            model = copy.deepcopy(stack)
            apply_checkpointing(model, make_cfg(f"memory={memory}", "memory.activation_budget=0.3").memory)
            options = make_cfg("compile=default", "compile.per_block=false").compile
            assert apply_compile(model, options, lambda m=model: step(m))["status"] == "applied"
            runs[memory] = step(model)
    finally:
        set_compiled_recompute(False, UNBUDGETED)
    (plain, plain_peak), (budget, budget_peak) = runs["none"], runs["budget"]
    assert budget_peak < 0.8 * plain_peak, (budget_peak, plain_peak)
    for name, want in plain.items():  # bf16: the two graphs fuse, and round, apart; other masks: ~100%
        assert (budget[name] - want).abs().max() <= 0.02 * want.abs().max(), name


def test_the_unmasked_asv_encoder_runs_on_the_flash_kernel_and_gives_the_masked_outputs():
    """Full-length ASVs, no mask: SDPA's flash kernel applies (it takes no mask: refused with one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, tokens, counts = aam_on_cuda()
    masked, masked_grads = aam_step(model, tokens, counts, torch.bfloat16)
    rows = tokens[0, :3]
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError):  # masked: no flash kernel takes the mask
            model._encode_rows_as_given(rows)
        model.unmasked_asvs = True
        assert all(torch.isfinite(t).all() for t in model._encode_rows_as_given(rows))
    unmasked, unmasked_grads = aam_step(model, tokens, counts, torch.bfloat16)
    assert (unmasked - masked).abs().max().item() <= 3e-2 * masked.abs().max().item()
    for name, want in masked_grads.items():
        assert (unmasked_grads[name] - want).abs().max().item() <= 1e-1 * max(want.abs().max().item(), 1e-3)


# ---- no host sync inside a training step (issue 41: the original has about 40 a step) ------------------


def test_a_training_step_of_aam_ops_fast_on_cuda_waits_for_the_gpu_nowhere(make_cfg):
    """Forward, loss and backward of AAM with aam_ops=fast under CUDA's sync debug mode ("error": a call
    that waits for the GPU raises): none, with the slots the collate finds on the host; without them,
    forward's nonzero waits (what the mode catches: the test can fail)."""
    from hydra.utils import instantiate

    from aamperf.data import build_data
    from aamperf.device import to_device
    from aamperf.model.slots import SLOT_KEYS
    from aamperf.phases.aam_ops import apply_aam_ops, collate_pad_to
    from aamperf.phases.attention import apply_attention

    cfg = make_cfg("aam_ops=fast", "attention=sdpa")
    torch.manual_seed(0)
    model = instantiate(cfg.model).to(CUDA).train()
    apply_aam_ops(model, cfg.aam_ops)
    apply_attention(model, cfg.attention, CUDA)
    pad_to = collate_pad_to(cfg.aam_ops, cfg.data.max_asvs)
    data = build_data(cfg.data, batch_size=8, seed=0, loader=cfg.dataloader, pad_to=pad_to)
    batch = to_device(next(iter(data.train_loader)), CUDA)
    loss_fn = instantiate(cfg.loss)
    loss_fn(model, batch, 1)[0].backward()  # first calls: cuBLAS handles, lazy module state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_fn(model, batch, 2)[0].backward()
        without = {k: v for k, v in batch.items() if k not in SLOT_KEYS}
        with pytest.raises(RuntimeError, match="synchroniz"):
            loss_fn(model, without, 3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
