"""Which bases the masked-nucleotide part hides (a deterministic, counter-based draw: the same on every
rank, worker and resume) and the part's sums over them."""

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from aamperf.tokens import real_bases

_M32 = 0xFFFFFFFF


def _hash32(x):
    """A 32-bit integer mix (two xor-shift-multiply rounds). Works on Python ints and int64 tensors;
    operands stay below 2**59, so int64 never overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


MASK_STRATEGIES = ("random", "span")
SPAN_BASES = (3, 4, 5)  # a span's length, each as likely: the original AAM's --nuc-mask-strategy span


def nucleotide_mask(
    tokens: Tensor, asv_ids: Tensor, step: int, seed: int, fraction: float, strategy: str = "random"
) -> Tensor:
    """Bool [B, S, L]: which real bases (A/C/G/T) to hide at this step: each on its own (`random`), or
    in spans of 3 to 5 bases in a row (`span`), `fraction` of them in expectation.

    Each position draws from a counter-based hash of (seed, step, global ASV id, base index),
    computed on the tokens' device: at a given step an ASV is masked the same way in every sample
    and every batch that holds it (so the aam_ops dedup phase can encode it once), the mask does not
    depend on how the batch is composed, padded or split across processes, and drawing it needs no
    host sync. `asv_ids` [B, S]: the batch's global ASV index of each slot (-1 on padding).
    """
    length = tokens.size(-1)
    step_key = _hash32(_hash32(seed & _M32) ^ (step & _M32))  # a Python int
    asv_key = _hash32(_hash32(asv_ids.to(torch.int64) & _M32) ^ step_key).unsqueeze(-1)  # [B, S, 1]
    position = torch.arange(length, device=tokens.device, dtype=torch.int64)
    draw = _hash32(asv_key ^ _hash32(position))
    real = real_bases(tokens)
    if strategy == "random":
        return (draw >> 8 < int(fraction * (1 << 24))) & real  # 24 uniform bits
    # a real base starts a span with the chance that covers `fraction` of the bases; its length from the
    # draw's low 8 bits; a span hides the real bases it reaches (a sequence's end or padding cuts it short)
    starts = (draw >> 8 < int(span_start_rate(fraction) * (1 << 24))) & real
    bases = SPAN_BASES[0] + (((draw & 0xFF) * len(SPAN_BASES)) >> 8)
    hidden = starts.clone()
    for back in range(1, SPAN_BASES[-1]):
        hidden[..., back:] |= (starts & (bases > back))[..., :-back]
    return hidden & real


@functools.cache
def span_start_rate(fraction: float) -> float:
    """The chance q that a base starts a span, so that `fraction` of a long sequence's bases are hidden: a
    base is covered unless no span starts on it or on the bases before it that reach it,
    1 - prod over d = 0..4 of (1 - q P(length > d)) = fraction (scipy's root finder; it grows with q)."""
    from scipy.optimize import brentq  # once per fraction (cached), and only for span masks

    reach = [sum(n > back for n in SPAN_BASES) / len(SPAN_BASES) for back in range(SPAN_BASES[-1])]
    return brentq(lambda q: 1 - math.prod(1 - q * r for r in reach) - fraction, 0.0, 1.0)


def masked_nucleotide_sums(logits: Tensor, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of the cross-entropy of the original base at the hidden positions, their number).

    Computed on every position and weighted by the mask, not gathered with a boolean index,
    which would need a host sync to size its output."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten(), reduction="none")
    weight = hidden.flatten().to(ce.dtype)
    return (ce * weight).sum(), weight.sum()
