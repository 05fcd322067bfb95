"""A bf16 dropout's multiplier: the figures behind `keep_multiplier` and `kept_times` (phases/dropout.py).
At the headline's largest mask, [320, 151, 512] (the feed-forward GELU of the ASV level: 320 ASVs of 151
tokens), timed in turn: a bool mask cast to bf16 and to fp32, as bool and viewed as uint8 (the same 0 / 1
bytes); then a whole bf16 dropout forward (the random words drawn, the multiplier made, x times it) three
ways: the bool mask cast to bf16 (FastDropout before 2026-12-06), the mask viewed as uint8 and cast, and
the multiplier made from the random int16 in place (`keep_multiplier`, FastDropout now). All three give
the same output from the same seed (checked here).
    python experiments/headline/mask_cast.py [TRIALS=20]
"""

import statistics
import sys
import time

import torch

from aamperf.metrics.host import cpu_description
from aamperf.phases.dropout import keep_mask, keep_multiplier, keep_scale

trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20
shape, p, cpu = torch.Size([320, 151, 512]), 0.1, torch.device("cpu")
keep = keep_mask(shape, p, cpu)
x = torch.randn(shape, dtype=torch.bfloat16)
scale = keep_scale(p, x)


def seeded(fn):
    def run():
        torch.manual_seed(0)
        return fn()

    return run


cases = {
    "bool -> bf16": lambda: keep.to(torch.bfloat16),
    "uint8 -> bf16": lambda: keep.view(torch.uint8).to(torch.bfloat16),
    "bool -> fp32": lambda: keep.to(torch.float32),
    "uint8 -> fp32": lambda: keep.view(torch.uint8).to(torch.float32),
    "bf16 dropout, bool mask cast": seeded(lambda: x * keep_mask(shape, p, cpu).to(x.dtype).mul_(scale)),
    "bf16 dropout, uint8 mask cast": seeded(
        lambda: x * keep_mask(shape, p, cpu).view(torch.uint8).to(x.dtype).mul_(scale)
    ),
    "bf16 dropout, multiplier from the bits": seeded(lambda: x * keep_multiplier(shape, p, x.dtype, cpu)),
}
outputs = [fn() for fn in list(cases.values())[4:]]  # and a warm-up of every case below
assert all(torch.equal(outputs[0], out) for out in outputs[1:]), "the three dropouts differ"
for fn in cases.values():
    fn()
times = {name: [] for name in cases}
for _ in range(trials):  # in turn: a slow spell of the machine falls on every case alike
    for name, fn in cases.items():
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
for name, seconds in times.items():
    spread = f"{1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f}"
    print(f"{name}: median {1e3 * statistics.median(seconds):.1f} ms ({spread}) over {trials} calls")
