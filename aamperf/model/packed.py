"""Samples packed along one axis instead of padded: variable-length attention and pooling over each
sample's own positions (the sample level of AAM, `AAM.pack_samples`)."""

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)  # the dtypes of CUDA's flash kernel (varlen_attn)


class Packing:
    """Where each sample's positions lie in a packed [T, ...] tensor: `segment` [T] (each position's
    sample, non-decreasing), `offsets` [B + 1] (sample i holds positions offsets[i]:offsets[i+1]) and
    `max_len`, an upper bound of a sample's length known on the host (the padded width): no host sync
    to build it or to run the kernels that need it. Passed where the padded path passes a mask."""

    def __init__(self, segment: Tensor, batch: int, max_len: int):
        self.segment, self.batch, self.max_len = segment, batch, max_len
        self.offsets = torch.searchsorted(segment, torch.arange(batch + 1, device=segment.device))

    @cached_property
    def cu_seqlens(self) -> Tensor:
        """`offsets` as int32, varlen_attn's: made once per forward, not once per layer."""
        return self.offsets.to(torch.int32)

    @classmethod
    def from_slots(cls, slots: Tensor, batch: int, width: int) -> "Packing":
        """The packing of the ascending slots `slots` of a [batch, width] padded layout (its real ones)."""
        return cls(torch.div(slots, width, rounding_mode="floor"), batch, width)

    def attend(self, qkv: Tensor, num_heads: int, dropout_p: float) -> Tensor:
        """Self-attention of every sample over its own positions: qkv [T, 3 * D] -> [T, D]."""
        total = qkv.size(0)
        q, k, v = qkv.view(total, 3, num_heads, -1).unbind(1)  # each [T, heads, head_dim]
        if q.is_cuda and q.dtype in HALF and dropout_p == 0.0:
            # CUDA's flash kernel on the packed rows as they are (no dropout in it): no nested tensor
            # bookkeeping per call. max_len bounds the longest sample: the kernel's grid, no sync
            from torch.nn.attention.varlen import varlen_attn

            out = varlen_attn(q, k, v, self.cu_seqlens, self.cu_seqlens, self.max_len, self.max_len)
        elif q.is_cuda:
            out = self.jagged_attention(q, k, v, dropout_p)
        else:
            out = self.attention_by_sample(q, k, v, dropout_p)
        return out.reshape(total, -1)

    def attention_by_sample(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        """SDPA on each sample's rows in turn: [T, heads, head_dim] each -> [T, heads, head_dim]. What
        torch does with nested tensors off a GPU (its math, sample by sample), on plain tensors, which
        activation checkpointing can save (it cannot save the nested ones the CPU's math makes)."""
        bounds = self.offsets.tolist()  # not a sync: off a GPU the offsets are on the host

        def one(a: int, b: int) -> Tensor:
            heads_first = [x[a:b].transpose(0, 1) for x in (q, k, v)]  # [heads, length, head_dim]
            return F.scaled_dot_product_attention(*heads_first, dropout_p=dropout_p).transpose(0, 1)

        return torch.cat([one(a, b) for a, b in zip(bounds, bounds[1:], strict=False)])

    def jagged_attention(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> Tensor:
        """SDPA over nested jagged tensors: [T, heads, head_dim] each -> [T, heads, head_dim]. On CUDA
        torch runs its flash / memory-efficient kernels on the packed rows (dropout included); on a CPU
        its math per sample, as `attention_by_sample` (which the CPU runs: checkpointing cannot save the
        nested tensors of that math)."""

        def nested(x: Tensor) -> Tensor:  # [B, heads, j, head_dim]
            # min_seqlen=1: every sample has a real ASV (the data leaves out empty samples); given, like
            # max_seqlen, so that torch need not read the offsets back (a host sync) to pick a kernel
            # contiguous: x is a view into the qkv rows, and torch's kernels want [B, j, heads, head_dim]
            jagged = torch.nested.nested_tensor_from_jagged(
                x.contiguous(), self.offsets, min_seqlen=1, max_seqlen=self.max_len
            )
            return jagged.transpose(1, 2)

        out = F.scaled_dot_product_attention(nested(q), nested(k), nested(v), dropout_p=dropout_p)
        return out.transpose(1, 2).values()

    def pool(self, scores: Tensor, x: Tensor) -> Tensor:
        """Softmax of `scores` [T] within each sample, then the weighted sum of x [T, D] -> [B, D]; in
        fp32 (as autocast runs the padded path's softmax). A sample with no position gives 0."""
        scores = scores.float()
        # the softmax's shift: each sample's largest score (any shift gives the same softmax: detached)
        top = scores.detach().new_full((self.batch,), -torch.inf)
        top = top.scatter_reduce(0, self.segment, scores.detach(), reduce="amax")
        exp = (scores - top[self.segment]).exp()
        total = exp.new_zeros(self.batch).index_add(0, self.segment, exp)
        weights = exp / total[self.segment]
        pooled = x.new_zeros(self.batch, x.size(-1), dtype=torch.float32)
        return pooled.index_add(0, self.segment, weights[:, None] * x.float()).to(x.dtype)
