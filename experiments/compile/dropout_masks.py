"""Where a compiled model's CPU dropout masks are drawn: the figures behind `FastDropout.EAGER_IN_GRAPHS`
(aamperf/phases/dropout.py). Forward + backward of one fused dropout on a [64, 151, 128] bf16 activation
(the headline's ASV level), timed in turn: eager; compiled with the mask drawn eagerly between the graphs
(what the compile phase does); compiled with the mask drawn in the graph (uniform int16 from
`torch.randint`, the same keep probability).
    python experiments/compile/dropout_masks.py [TRIALS=20]
"""

import statistics
import sys

import torch

from aamperf.metrics.host import cpu_description
from aamperf.phases.compile import run_eagerly_in_graphs
from aamperf.phases.dropout import FastDropout, kept_from, multiplier_of
from aamperf.probe_measures import timed_in_turn


class InGraphDropout(FastDropout):
    EAGER_IN_GRAPHS = ()

    def bits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.randint(-(2**15), 2**15, x.shape, dtype=torch.int16, device=x.device)

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        return self.bits(x) >= kept_from(self.p)

    def multiplier(self, x: torch.Tensor) -> torch.Tensor:  # a 2-byte dtype's (bf16 here)
        return multiplier_of(self.bits(x), self.p, x.dtype)


trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20
x = torch.randn(64, 151, 128, dtype=torch.bfloat16, requires_grad=True)
eager = FastDropout(0.1)
run_eagerly_in_graphs(eager)  # as the compile phase does: FastDropout's mask, eager between graphs
between = torch.compile(FastDropout(0.1), dynamic=True)
in_graph = torch.compile(InGraphDropout(0.1), dynamic=True)


def step(module):
    def run():
        module(x).float().sum().backward()
        x.grad = None

    run()  # warm-up (and the compile)
    return run


seconds = timed_in_turn(step(eager), step(between), step(in_graph), device=torch.device("cpu"), trials=trials)
print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
names = ("eager", "compiled, mask between graphs", "compiled, mask in graph")
for name, times in zip(names, seconds, strict=True):
    print(f"{name}: median {1e3 * statistics.median(times):.1f} ms over {len(times)} calls")
