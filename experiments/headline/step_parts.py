"""The figures behind two of advanced's and ultra's CPU choices, measured in one process, alternating:
zeroing the dropped attention weights of a cached chunk (masked_fill_ against an AND of their bits,
aamperf/phases/dropout.py), and malloc keeping freed memory for reuse (system.reuse_freed_memory,
aamperf/phases/system.py) on a product of a large activation and on forward + backward of two blocks
at the headline's width.
    python experiments/headline/step_parts.py [--pairs 8] [--rows 200]
"""

import argparse
import ctypes
import statistics
import time

import torch
from omegaconf import OmegaConf

from aamperf.metrics.host import cpu_description
from aamperf.model.layers import Block
from aamperf.phases.attention import apply_attention
from aamperf.phases.dropout import apply_dropout, keep_bits, zero_unkept_
from aamperf.phases.system import GLIBC_DEFAULT_BYTES, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, REUSE_BYTES

parser = argparse.ArgumentParser()
parser.add_argument("--pairs", type=int, default=8)
parser.add_argument("--rows", type=int, default=200, help="ASV rows of the blocks' input [rows, 151, 128]")
args = parser.parse_args()
libc = ctypes.CDLL(None)


def reuse(on: bool) -> None:
    """Thresholds raised (reuse), or where glibc's dynamic mmap threshold stops rising (32 MiB; trim 2x)."""
    libc.mallopt(M_MMAP_THRESHOLD, REUSE_BYTES if on else 256 * GLIBC_DEFAULT_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, REUSE_BYTES if on else 512 * GLIBC_DEFAULT_BYTES)
    if not on:
        libc.malloc_trim(0)


def seconds(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def paired(name: str, a, b, unit: float, repeat: int, setup=None) -> None:
    """Median time of `a` and of `b` over alternating pairs, and the median of their per-pair ratio."""
    times = {"a": [], "b": []}
    for _ in range(args.pairs):
        for key, fn in (("a", a), ("b", b)):
            if setup:
                setup(key == "b")
            fn()  # warm
            times[key].append(seconds(fn, repeat))
    ratios = sorted(x / y for x, y in zip(times["a"], times["b"], strict=True))
    print(
        f"{name}: {statistics.median(times['a']) * unit:.4g} against "
        f"{statistics.median(times['b']) * unit:.4g}; "
        f"ratio median {statistics.median(ratios):.2f}x (pairs {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
    )


print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
torch.manual_seed(0)
weights = torch.softmax(torch.randn(5, 4, 151, 151), -1)  # one ~2 MiB chunk of the chunked attention
keep = torch.rand(weights.shape) > 0.1
scratch = torch.empty_like(weights)
paired(
    "zeroing the dropped weights of a [5, 4, 151, 151] fp32 chunk, us (masked_fill_ against the AND)",
    lambda: scratch.copy_(weights).masked_fill_(~keep, 0),
    lambda: zero_unkept_(scratch.copy_(weights), keep_bits(keep, weights.dtype)),
    1e6,
    200,
)

x, scale = torch.randn(38656, 512), torch.tensor(1 / 0.9)
paired(
    "x * scale over an fp32 [38656, 512], ms (glibc's thresholds against reuse)",
    lambda: x * scale,
    lambda: x * scale,
    1e3,
    10,
    setup=reuse,
)

blocks = torch.nn.Sequential(*[Block(128, 4, 4, 0.1) for _ in range(2)])
apply_attention(blocks, OmegaConf.create({"impl": "sdpa", "backends": []}))
apply_dropout(blocks, OmegaConf.create({"impl": "fast"}), torch.device("cpu"))
inputs = torch.randn(args.rows, 151, 128, requires_grad=True)


def step() -> None:
    y = inputs
    for block in blocks:
        y = block(y, None)
    y.sum().backward()
    inputs.grad = None
    blocks.zero_grad(set_to_none=True)


paired(
    f"forward + backward of two blocks at [{args.rows}, 151, 128], s (glibc's thresholds against reuse)",
    step,
    step,
    1,
    2,
    setup=reuse,
)
