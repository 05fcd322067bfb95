"""What settling a slow bf16 matmul saves the precision probe: `measure_matmul` at the headline's
shapes, once as precision=auto runs it (a shape whose one warm call runs SETTLED x below fp32's rate is
not timed further) and once timing every trial. Run it where bf16 has no native instructions, or hold
torch's kernels to AVX2 as such a CPU has them:
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python experiments/precision/settled_probe.py
"""

import time

import torch

from aamperf import probe_measures
from aamperf.metrics.host import cpu_description

SHAPES = [(16384, 128, 512), (16384, 512, 128), (16384, 128, 384)]  # the headline's (its probe cache key)

isa = torch.backends.cpu.get_cpu_capability()
print(f"CPU: {cpu_description()}, torch kernels {isa}, torch {torch.__version__}")
for settled in (probe_measures.SETTLED, float("inf")):  # inf: no shape settles, every trial is timed
    probe_measures.SETTLED = settled
    start = time.perf_counter()
    answer = probe_measures.measure_matmul(torch.device("cpu"), SHAPES)
    ratio = answer["flops"]["bf16"] / answer["flops"]["fp32"]
    print(
        f"SETTLED={settled}: {time.perf_counter() - start:.1f} s, bf16 {ratio:.3f}x fp32, "
        f"settled {answer['settled']}"
    )
