"""Dropout masks from a cheaper random source. On CPU, drawing one Bernoulli sample per element is
the largest single cost of an AAM training step (the attention weights alone are rows x heads x
151 x 151 per layer); this phase cuts each mask from 64-bit random words instead: 16 random bits per
element, one generator call per four elements, the same keep probability (to 1/65536). torch draws
a CPU tensor's random numbers one after another from one generator (its random_ kernel is serial),
so the words are drawn in fixed blocks, each from a generator of its own, on several threads."""

import os
from concurrent.futures import ThreadPoolExecutor

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from aamperf.phases.record import applied, skipped

# Words per block: each block's generator is seeded by one draw from the default generator, so the
# words depend on the seed alone, never on the threads drawing them (2 MiB: 1M mask elements).
BLOCK_WORDS = 2**18
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (its threads, the pool)


def _threads_pool(threads: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] != threads:
        if _pool is not None:
            _pool[1].shutdown(wait=False)
        _pool = threads, ThreadPoolExecutor(threads, thread_name_prefix="aamperf-masks")
    return _pool[1]


def _forget_pool() -> None:  # a forked child (a loader worker) has none of the parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def random_words(n: int, device: torch.device, threads: int | None = None) -> Tensor:
    """n full-range int64 words from the default (seeded) generator's stream: on CPU in blocks of
    BLOCK_WORDS, each from its own generator seeded from that stream, drawn on `threads` threads
    (None: torch's thread count); the same words on any number of threads. On a GPU, one call to the
    default generator."""
    words = torch.empty(n, dtype=torch.int64, device=device)
    if device.type != "cpu":
        return words.random_(-(2**63), None)
    blocks = list(words.split(BLOCK_WORDS))
    seeds = torch.empty(len(blocks), dtype=torch.int64).random_(0, 2**62).tolist()

    def draw(i: int) -> None:
        blocks[i].random_(-(2**63), None, generator=torch.Generator().manual_seed(seeds[i]))

    threads = threads or torch.get_num_threads()
    if threads == 1 or len(blocks) == 1:
        for i in range(len(blocks)):
            draw(i)
    else:  # random_ releases the GIL: the blocks are drawn at once
        list(_threads_pool(threads).map(draw, range(len(blocks))))
    return words


def random_bits(shape: torch.Size, device: torch.device, threads: int | None = None) -> Tensor:
    """Uniform int16 of `shape`: full-range int64 words (`random_words`) viewed as four int16 each."""
    n = shape.numel()
    return random_words((n + 3) // 4, device, threads).view(torch.int16)[:n].view(shape)


def kept_from(p: float) -> int:
    """The least random int16 that keeps its element: kept with probability 1 - p (to 1/65536); 2^15, no
    int16, where p rounds to 1 (above 1 - 2^-17): none kept."""
    return -(2**15) + round(p * 2**16)


def keep_mask(shape: torch.Size, p: float, device: torch.device, threads: int | None = None) -> Tensor:
    """Bool mask, each element True with probability 1 - p (rounded to a multiple of 1/65536); its
    words drawn on `threads` threads (`random_words`)."""
    bits, least = random_bits(shape, device, threads), kept_from(p)
    return bits >= least if least < 2**15 else torch.zeros_like(bits, dtype=torch.bool)


def keep_multiplier(
    shape: torch.Size, p: float, dtype: torch.dtype, device: torch.device, threads: int | None = None
) -> Tensor:
    """What a 2-byte float dtype's dropout multiplies by: 1 / (1 - p) in `dtype` where `keep_mask` of the
    same random stream is True, +0.0 elsewhere. Made in place from the random int16 themselves: each
    clamped to the two values around the least kept one and shifted to 0 / 1, then times the bit pattern
    of 1 / (1 - p). On a CPU torch casts a bool mask to a float dtype in a loop that is not vectorized
    (a [320, 151, 512] mask to bf16: 17.0 ms, as uint8 2.2): a whole bf16 dropout of that shape, the words
    drawn, took 40.7-41.5 ms with the bool mask cast, 25.5-26.0 ms so (`experiments/headline/mask_cast.py`,
    two runs, 2-core AMD EPYC family 25 model 17, AVX-512 BF16, 2026-12-06)."""
    return multiplier_of(random_bits(shape, device, threads), p, dtype)  # drawn always: the stream moves on


def multiplier_of(bits: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    """`keep_multiplier` of the random int16 `bits`, made in them."""
    least = kept_from(p)
    scale = torch.full((), 1 / (1 - p), dtype=dtype).view(torch.int16).item()  # keep_scale's value
    if least <= -(2**15):  # p under 2^-17: every element kept
        return bits.fill_(scale).view(dtype)
    if least >= 2**15:  # none kept
        return bits.zero_().view(dtype)
    return bits.clamp_(least - 1, least).sub_(least - 1).mul_(scale).view(dtype)


def draw_keep(dropout: nn.Dropout, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The bool keep mask `dropout` would draw for an input of `shape` and `dtype`, from the same random
    stream: FastDropout's words, or the Bernoulli draw of torch's own dropout."""
    if isinstance(dropout, FastDropout):
        return keep_mask(shape, dropout.p, device, dropout.threads)
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - dropout.p).bool()


def keep_scale(p: float, x: Tensor) -> Tensor:
    """1 / (1 - p) in x's dtype (a 0-dim tensor), as torch's dropout scales the kept elements: the
    same rounding in bf16 and fp16, and no .item() for torch.compile to break its graph at."""
    return torch.full((), 1 / (1 - p), dtype=x.dtype, device=x.device)


# On CPU, masked_fill_ and where() with a bool mask run an element at a time: zeroing the dropped weights
# of a cached [5, 4, 151, 151] fp32 chunk (copied first) took 785 us with masked_fill_, 159 us as an AND of
# its bits with the mask made integer (`experiments/headline/step_parts.py`, AMD EPYC, AVX2, 2 cores).
# Over a large activation: a multiply by the mask made float (torch's own dropout arithmetic), not where().
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def keep_bits(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """The bool mask `keep` as integers the size of `dtype`'s: every bit set where True, none where False."""
    return keep.to(INT_OF_SIZE[dtype.itemsize]).neg_()


def zero_unkept_(x: Tensor, bits: Tensor) -> Tensor:
    """x, in place, with +0.0 where `bits` (from `keep_bits`, broadcastable to x) is 0: an AND of x's bits."""
    x.view(bits.dtype).bitwise_and_(bits)
    return x


def kept_times(x: Tensor, keep: Tensor, scale: Tensor) -> Tensor:
    """x times `scale` where `keep`, times 0 elsewhere: torch's dropout arithmetic (x * mask / (1 - p)).
    The mask is cast as uint8, the same 0 / 1 bytes: torch casts a bool tensor to a float dtype in a loop
    that is not vectorized, and a uint8 one in one that is (`experiments/headline/mask_cast.py`)."""
    return x * keep.view(torch.uint8).to(x.dtype).mul_(scale)


class MaskedScale(torch.autograd.Function):
    """x times `scale` where `keep`, times 0 elsewhere; backward keeps the bool mask (1 byte an element),
    not a multiplier in x's dtype (2-4 bytes) as `x * multiplier` would."""

    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return kept_times(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return kept_times(grad, keep, ctx.scale), None, None


class FastDropout(nn.Dropout):
    """nn.Dropout with its mask from `keep_mask`: same distribution, another random stream; its words
    drawn on `threads` threads (None: torch's)."""

    # the mask drawn eagerly between torch.compile's graphs (the compile phase's `run_eagerly_in_graphs`):
    # Tensor.random_ breaks a graph anyway, and a CPU mask drawn in the graph (`torch.randint`, int16) took
    # 7.9-8.3 ms against 2.3-2.5 ms drawn between the graphs (eager 1.9-2.2), forward + backward of a
    # [64, 151, 128] bf16 dropout (experiments/compile/dropout_masks.py, two runs, 2-core AMD EPYC family 25
    # model 17, AVX-512 BF16, 2026-12-06; 14.6-14.9 against 4.7 at b62a24d, before `keep_multiplier`)
    EAGER_IN_GRAPHS = ("keep", "multiplier")

    def __init__(self, p: float = 0.5, threads: int | None = None) -> None:
        super().__init__(p)
        self.threads = threads

    def keep(self, x: Tensor) -> Tensor:
        return keep_mask(x.shape, self.p, x.device, self.threads)

    def multiplier(self, x: Tensor) -> Tensor:
        return keep_multiplier(x.shape, self.p, x.dtype, x.device, self.threads)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        # fp32: 1 byte an element kept for backward instead of 4 (fp32 advanced at the headline's batch:
        # 2.59 -> 2.0 GiB peak RSS, experiments/memory/). 2-byte dtypes: a multiplier in x's dtype (2 bytes
        # kept), where where() trained slower (bf16 `optim=advanced`, default run, three paired runs on
        # the AVX-512 EPYC: 0.142 against 0.132 s a step, experiments/default/)
        if x.element_size() == 2:
            return x * self.multiplier(x)
        return MaskedScale.apply(x, self.keep(x), keep_scale(self.p, x))


def apply_dropout(model: nn.Module, cfg: DictConfig, device: torch.device) -> dict:
    """Replace every nn.Dropout of `model` (attention weights included) by FastDropout."""
    if cfg.impl == "standard":
        return skipped("dropout=standard")
    if device.type == "cuda":
        return skipped("CUDA dropout is already a fused Philox kernel: nothing to gain")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Dropout and child.p > 0:
                setattr(parent, name, FastDropout(child.p, cfg.get("threads")).train(child.training))
                replaced += 1
    if not replaced:
        return skipped("the model has no active nn.Dropout")
    return applied(modules=replaced, threads=cfg.get("threads") or torch.get_num_threads())
