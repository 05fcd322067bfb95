"""Transformer building blocks: swappable attention, pre-LN blocks and stacks, attention pooling.

Where a stack takes `real` (its positions' mask) it also takes None (every position real: no mask, so
SDPA may use its fused kernels) or a `Packing` (samples packed along one axis, x [T, D]: each attends
and pools over its own positions)."""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aamperf.model.packed import Packing


def key_padding_mask(real: Tensor) -> Tensor:
    """[N, L] bool (True = real position) -> [N, 1, 1, L] bool mask for `attend` (True = may attend).

    A row with no real position (a padding ASV, which the baseline still encodes) is left fully
    unmasked, so every attention implementation (math or SDPA) stays finite on it; the caller
    zeroes that row's output afterwards.
    """
    keep = real | ~real.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm, or with `in_autocast_dtype` set (`precision.residual=autocast`) and autocast on: in
    the autocast dtype, bf16 or fp16 in and out (the kernels accumulate in fp32), where autocast itself
    would run it in fp32 and the next Linear cast its output back. Its parameters stay fp32."""

    in_autocast_dtype = False

    def forward(self, x: Tensor) -> Tensor:
        if not (self.in_autocast_dtype and torch.is_autocast_enabled(x.device.type)):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            weight, bias = self.weight.to(dtype), self.bias.to(dtype)
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


class MathAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v, written out. The attention phase swaps this module.

    Takes q, k, v as [N, heads, L, head_dim] and a bool mask broadcastable to [N, heads, L, L]
    (True = may attend), the convention of `F.scaled_dot_product_attention`.
    """

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout_p = dropout  # read by replacements (e.g. SDPA's dropout_p)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        if mask is not None:
            # a large finite negative, not -inf: a fully masked row gives a uniform softmax, not NaN
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = self.dropout(F.softmax(scores, dim=-1))
        return weights @ v


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused qkv projection, `self.attend`, one output projection."""

    def __init__(self, dim: int, num_heads: int, dropout: float):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embedding_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.attend = MathAttention(dropout)

    def forward(self, x: Tensor, mask: Tensor | Packing | None) -> Tensor:
        if isinstance(mask, Packing):  # x [T, D]: varlen attention, with the swapped module's dropout
            dropout_p = self.attend.dropout_p if self.training else 0.0
            return self.out(mask.attend(self.qkv(x), self.num_heads, dropout_p))
        n, length, dim = x.shape
        # [N, L, 3D] -> three [N, heads, L, head_dim]
        q, k, v = self.qkv(x).view(n, length, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v, mask)
        return self.out(y.transpose(1, 2).reshape(n, length, dim))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + FFN(LN(x)) with a GELU FFN; dropout on the
    attention weights, after the GELU and on both residual branches, as torch's TransformerEncoderLayer
    (norm_first) that the original AAM uses."""

    def __init__(self, dim: int, num_heads: int, ffn_mult: int, dropout: float):
        super().__init__()
        self.ln_attn = LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads, dropout)
        self.ln_ffn = LayerNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_mult * dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(ffn_mult * dim, dim),
            nn.Dropout(dropout),
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | Packing | None) -> Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x), mask))
        return x + self.ffn(self.ln_ffn(x))


class Transformer(nn.Module):
    """A stack of pre-LN blocks and a final LayerNorm. `blocks` is where checkpointing wraps. With
    `autocast_stream` set (`precision.residual=autocast`) and autocast on, the residual stream is carried
    in the autocast dtype (2 bytes an element) instead of fp32."""

    autocast_stream = False

    def __init__(self, dim: int, num_heads: int, num_layers: int, ffn_mult: int, dropout: float):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, num_heads, ffn_mult, dropout) for _ in range(num_layers))
        self.ln_f = LayerNorm(dim)

    def forward(self, x: Tensor, real: Tensor | Packing | None) -> Tensor:
        """x: [N, L, D]; real: [N, L] bool, False on padding positions (masked as keys), or None (no
        padding: no mask); or x [T, D] packed as `real` says."""
        mask = key_padding_mask(real) if isinstance(real, Tensor) else real
        if self.autocast_stream and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x)


class AttentionPooling(nn.Module):
    """Softmax over real positions of a learned score (Linear(D, 1) / sqrt(D)), weighted sum, LayerNorm."""

    def __init__(self, dim: int):
        super().__init__()
        self.score = nn.Linear(dim, 1)
        self.norm = LayerNorm(dim)

    def forward(self, x: Tensor, real: Tensor | Packing | None) -> Tensor:
        """x: [N, L, D]; real: [N, L] bool or None (every position real) -> [N, D]; or x [T, D] packed
        as `real` says -> [B, D]. A row with no real position gives a finite (meaningless) vector; the
        caller zeroes it."""
        scores = self.score(x).squeeze(-1) / math.sqrt(x.size(-1))
        if isinstance(real, Packing):
            return self.norm(real.pool(scores, x))
        if real is not None:
            scores = scores.masked_fill(~real, torch.finfo(scores.dtype).min)
        weights = F.softmax(scores, dim=-1)
        return self.norm((weights.unsqueeze(1) @ x).squeeze(1))


class MLP(nn.Module):
    """Linear(dim, hidden[0]), ReLU (and Dropout where `dropout` > 0), ... then Linear(hidden[-1], out): the
    original AAM's regressor head (--regressor-hidden-dims, --regressor-dropout); `residual` adds a
    Linear(dim, out) of the input to it (its --residual-regression-head: output = Linear(x) + MLP(x))."""

    def __init__(
        self, dim: int, out: int, hidden: Sequence[int], dropout: float = 0.0, residual: bool = False
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(), *([nn.Dropout(dropout)] if dropout > 0 else [])]
            width = size
        self.mlp = nn.Sequential(*layers, nn.Linear(width, out))
        self.skip = nn.Linear(dim, out) if residual else None

    def forward(self, x: Tensor) -> Tensor:
        y = self.mlp(x)
        return y if self.skip is None else y + self.skip(x)
