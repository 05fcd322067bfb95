"""Attention implementation: the written-out math baseline, or F.scaled_dot_product_attention (with,
on CPU in training, attention dropout in cache-sized chunks: no SDPA kernel there has dropout)."""

import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aamperf.model.layers import MathAttention
from aamperf.phases.dropout import draw_keep, keep_bits, keep_scale, zero_unkept_
from aamperf.phases.record import applied, skipped

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


# Scores of one chunk of rows: about this many bytes ([rows, heads, L, L]), so that the chunk's scores,
# softmax and dropout stay in the CPU's cache between ops. The probe's training measurement
# (`aamperf.probe_measures.measure_attention(cpu, float32, (256, 4, 151, 32), True, (0.1, "fast"))`, 2-core
# AVX-512 EPYC, L2 1 MiB a core, L3 32 MiB): chunks of 0.5 / 2 / 8 / 32 MiB 413 / 321 / 303 / 355 ms
# forward + backward, the whole tensor at once (the math) 477-577 ms. On a family 26 (Zen 5) EPYC (the
# same caches) chunks of 0.5, 1 and 8 MiB ran 1.00-1.04x 2 MiB's time in training steps
# (`experiments/in_turn.py chunk-bytes`, experiments/ablation/README.md).
CHUNK_BYTES = 2 * 2**20

# Keys a 2-byte dtype's scores are padded to a multiple of (-inf: a softmax weight of exactly 0). torch's
# CPU softmax over a bf16 row is fast only where the row is a whole number of its vectors (32 elements with
# AVX-512, 16 with AVX2): a chunk's rows of AAM's 151 keys took 1.281 ms, padded to 160 0.495 ms with
# torch's AVX-512 kernels, 0.857 against 0.723 with its AVX2 ones (fp32 0.498 at 151;
# `experiments/headline/softmax_rows.py`, 2-core AMD EPYC family 25 model 17, 2026-12-06). The padded
# softmax rounds a few elements the other way in bf16, by one unit in the last place and no farther from the
# exact value (tests/phases/test_phase_correctness.py). 1: no padding.
PAD_KEYS_TO = 32


class ChunkedDropoutAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + mask) with dropout, times v, a few rows at a time; backward recomputes
    each chunk's softmax (as flash attention does) instead of keeping [N, heads, L, L] floats.

    The same values as MathAttention followed by the same dropout (`draw_keep`: the same keep mask
    from the same random stream), computed in q's dtype as CPU autocast computes the math; in bf16 and
    fp16 with the softmax's rows padded (PAD_KEYS_TO), which rounds a few elements otherwise."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: nn.Dropout) -> Tensor:
        n, heads, length, _ = q.shape
        # q, k, v are permuted views of the qkv projection: copied once here, not by every chunk's matmuls
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        keys = k.size(-2)
        keep = draw_keep(dropout, torch.Size((n, heads, length, keys)), q.dtype, q.device)
        # a 2-byte dtype's scores [.., length, keys] padded to `width` keys: zero keys, their scores -inf
        # (below a masked key's: a row whose keys are all masked still spreads its weight over them alone)
        width = -(-keys // PAD_KEYS_TO) * PAD_KEYS_TO if q.element_size() == 2 else keys
        ctx.keys = keys
        if width > keys:
            k = torch.cat([k, k.new_zeros(n, heads, width - keys, k.size(-1))], dim=-2)
        # keys a query may not see: the math's large finite negative added to their scores (score + min
        # rounds to min for any score below 1e31 in fp32), and an integer mask for their gradient
        ctx.hidden = ctx.visible = None
        if mask is not None:
            mask = mask.expand(n, *mask.shape[1:])
            ctx.hidden = torch.full((*mask.shape[:-1], width), -math.inf, dtype=q.dtype, device=q.device)
            ctx.hidden[..., :keys] = 0.0
            ctx.hidden[..., :keys].masked_fill_(~mask, torch.finfo(q.dtype).min)
            ctx.visible = keep_bits(mask, q.dtype)
        rows = max(1, CHUNK_BYTES // (heads * length * k.size(-2) * q.element_size()))
        ctx.chunks = [slice(i, min(i + rows, n)) for i in range(0, n, rows)]
        # both as the math has them: scores divided by sqrt(d), kept weights times 1/(1-p) in q's dtype
        ctx.sqrt_d = math.sqrt(q.size(-1))
        ctx.keep_scale = keep_scale(dropout.p, q)
        ctx.save_for_backward(q, k, v, keep)
        out = torch.empty_like(q)
        with torch.autocast(q.device.type, enabled=False):  # q's dtype throughout, as said above
            for rows in ctx.chunks:
                # the kept weights scaled out of place: a padded softmax's rows made contiguous in that pass
                weights = ChunkedDropoutAttention._weights(ctx, q, k, rows, contiguous=False)
                kept = zero_unkept_(weights.mul(ctx.keep_scale), keep_bits(keep[rows], q.dtype))
                torch.matmul(kept, v[rows], out=out[rows])
        return out

    @staticmethod
    def _weights(ctx, q: Tensor, k: Tensor, rows: slice, contiguous: bool = True) -> Tensor:
        """The chunk's softmax weights over its `ctx.keys` keys (`k` may hold padding keys after them);
        not `contiguous`: a view of the padded rows."""
        scores = torch.matmul(q[rows], k[rows].transpose(-2, -1)).div_(ctx.sqrt_d)
        if ctx.hidden is not None:  # (padded as the keys are: -inf on the padding keys)
            scores.add_(ctx.hidden[rows])
        elif k.size(-2) > ctx.keys:
            scores[..., ctx.keys :] = -math.inf
        weights = torch.softmax(scores, dim=-1)
        if k.size(-2) == ctx.keys:
            return weights
        return weights[..., : ctx.keys].contiguous() if contiguous else weights[..., : ctx.keys]

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, padded_k, v, keep = ctx.saved_tensors
        k = padded_k[..., : ctx.keys, :]  # the keys without the padding of a 2-byte dtype's scores
        grad = grad.contiguous()  # the gradient of a transposed view: copied once, not by each chunk
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        with torch.autocast(q.device.type, enabled=False):
            for rows in ctx.chunks:
                weights = ChunkedDropoutAttention._weights(ctx, q, padded_k, rows)
                bits = keep_bits(keep[rows], q.dtype)
                kept = zero_unkept_(weights.mul(ctx.keep_scale), bits)  # scaled out of place: no clone
                torch.matmul(kept.transpose(-2, -1), grad[rows], out=dv[rows])
                d_kept = torch.matmul(grad[rows], v[rows].transpose(-2, -1))
                d_weights = zero_unkept_(d_kept, bits).mul_(ctx.keep_scale)
                d_scores = torch._softmax_backward_data(d_weights, weights, -1, weights.dtype).div_(
                    ctx.sqrt_d
                )
                if ctx.visible is not None:  # masked scores are constants: no gradient to q or k through them
                    zero_unkept_(d_scores, ctx.visible[rows])
                torch.matmul(d_scores, k[rows], out=dq[rows])
                torch.matmul(d_scores.transpose(-2, -1), q[rows], out=dk[rows])
        return dq, dk, dv, None, None


class SDPAttention(nn.Module):
    """Drop-in for MathAttention: same inputs (q, k, v [N, H, L, d], bool mask: True = may attend)."""

    # run eagerly between torch.compile's graphs (the compile phase's `run_eagerly_in_graphs`): traced,
    # the chunked attention's loop over chunks of rows was unrolled into the graph and guarded on the
    # batch's rows, so every new batch shape compiled again (10-13 recompiles in a 30-step headline run)
    EAGER_IN_GRAPHS = ("chunked",)

    def __init__(self, dropout_p: float, backends: list[str]):
        super().__init__()
        self.dropout_p = dropout_p
        self.backends = [BACKENDS[b] for b in backends]
        # No CPU kernel of SDPA has dropout: in training it would fall back to the math over the whole
        # [N, heads, L, L]. ChunkedDropoutAttention does that math a few cached rows at a time, with
        # this module's dropout (which the dropout phase can make cheaper) drawing the keep mask.
        self.dropout = nn.Dropout(dropout_p)

    def chunked(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return ChunkedDropoutAttention.apply(q, k, v, mask, self.dropout)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.training and self.dropout_p > 0 and q.device.type == "cpu":
            return self.chunked(q, k, v, mask)
        dropout_p = self.dropout_p if self.training else 0.0
        if not self.backends:  # torch picks the fastest kernel that supports the inputs
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def check_attention(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> list[str]:
    """A restricted backend must run on this device and dtype: try it once on a tiny masked input."""
    if cfg.impl == "math" or not cfg.backends:
        return []
    q = torch.randn(2, 2, 8, 16, device=device, dtype=dtype)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool, device=device)
    try:
        SDPAttention(0.0, list(cfg.backends))(q, q, q, mask)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        return [
            f"attention.backends={[str(b) for b in cfg.backends]} cannot run on {device.type} with {dtype} "
            f"({first}); use attention=sdpa to let torch choose"
        ]
    return []


def apply_attention(model: nn.Module, cfg: DictConfig, device: torch.device | None = None) -> dict:
    """Replace every MathAttention module of `model` by SDPAttention with the same dropout. The record
    says what training runs on `device` (None: nothing trains here, prediction): on a CPU, attention
    dropout makes it the chunked math, and the backends serve validation only."""
    if cfg.impl == "math":
        return skipped("attention=math (the written-out baseline)")
    swapped = []
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, MathAttention):
                # in the mode of the module it replaces: an evaluated model's attention has no dropout
                swapped.append(SDPAttention(child.dropout_p, list(cfg.backends)).train(child.training))
                setattr(parent, name, swapped[-1])
    if not swapped:
        return skipped("the model has no MathAttention module to replace")
    backends = [str(b) for b in cfg.backends] or "auto"
    if device is None:
        return applied(impl="sdpa", backends=backends, modules=len(swapped))
    if device.type == "cpu" and any(m.dropout_p > 0 for m in swapped):  # as SDPAttention.forward decides
        note = (
            "training runs the math in cache-sized chunks with the attention dropout (no CPU SDPA kernel has "
            "dropout); the backends run only where there is no dropout: validation, evaluation"
        )
        return applied(
            impl="sdpa", training="chunked_math", backends=backends, modules=len(swapped), note=note
        )
    return applied(impl="sdpa", training="sdpa", backends=backends, modules=len(swapped))
