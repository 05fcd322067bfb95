"""What compiling a model's blocks costs when they share a graph: four transformer blocks of the
headline's width (two of an ASV stack's shapes, two of another stack's), each compiled as
`compile=auto` compiles them (regional, dynamic=True), the first forward + backward of each timed.
The figures behind compile=auto's least cost of one block's compile (aamperf/phases/compile.py).
    python experiments/compile/block_reuse.py [--inductor-cache DIR]   (a new DIR: a first compile)
"""

import argparse
import os
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--inductor-cache", help="TORCHINDUCTOR_CACHE_DIR for this run (default: torch's)")
args = parser.parse_args()
if args.inductor_cache:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache

from aamperf.metrics.host import cpu_description  # noqa: E402 (after the cache directory is set)
from aamperf.model.layers import Block  # noqa: E402
from aamperf.phases.compile import compiled_graphs  # noqa: E402

torch.manual_seed(0)
asv = torch.randn(64, 151, 128, requires_grad=True)  # [ASV rows, bases, D]
sample = torch.randn(8, 65, 128, requires_grad=True)  # [samples, ASVs + 1, D]
print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
for i, (name, x) in enumerate([("ASV 1", asv), ("ASV 2", asv), ("sample 1", sample), ("sample 2", sample)]):
    block = Block(128, 4, 4, 0.1)
    block.compile(dynamic=True)
    start = time.perf_counter()
    block(x, None).sum().backward()
    print(
        f"block {i + 1} ({name} shapes {list(x.shape)}): {time.perf_counter() - start:.1f} s, "
        f"graphs compiled so far {compiled_graphs()}"
    )
