"""torch's CPU softmax by row length: the figures behind `PAD_KEYS_TO` (aamperf/phases/attention.py).
Softmax over the last dimension of one chunk of the chunked dropout attention's scores at the headline's
ASV level ([11, 4, 151, W]: 11 ASVs, 4 heads, 151 queries, W keys), in bf16 and fp32, for W = 151 (AAM's
keys), 152, 160, 176 and 192, timed in turn; the rate counts every element of the row, padding included,
and `per real key` counts 151 of them (what a row padded to W does for 151 keys).
    python experiments/headline/softmax_rows.py [TRIALS=20]
    ATEN_CPU_CAPABILITY=avx2 python experiments/headline/softmax_rows.py   # torch's AVX2 kernels
"""

import statistics
import sys
import time

import torch

from aamperf.metrics.host import cpu_description

trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20
widths = (151, 152, 160, 176, 192)
torch.manual_seed(0)
scores = {
    (dtype, width): torch.randn(11, 4, 151, width, dtype=dtype)
    for dtype in (torch.bfloat16, torch.float32)
    for width in widths
}
for s in scores.values():
    torch.softmax(s, -1)  # warm-up
times = {key: [] for key in scores}
for _ in range(trials):  # in turn: a slow spell of the machine falls on every case alike
    for key, s in scores.items():
        start = time.perf_counter()
        torch.softmax(s, -1)
        times[key].append(time.perf_counter() - start)
print(
    f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}, kernels "
    f"{torch.backends.cpu.get_cpu_capability()}"
)
for (dtype, width), seconds in times.items():
    median = statistics.median(seconds)
    rate, real = scores[dtype, width].numel() / median / 1e9, 11 * 4 * 151 * 151 / median / 1e9
    print(
        f"{str(dtype)[6:]} rows of {width}: median {1e3 * median:.3f} ms, {rate:.2f} G elements/s, "
        f"{real:.2f} G per real key"
    )
