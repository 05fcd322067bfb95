"""attention=auto's probe ratio (SDPA's time over the written-out math's, forward + backward with dropout 0.1,
bf16), repeated in one process: the two candidates timed one after the other (the probe before d58e474) and
in turn (since), alternating the two ways, to see how far one probe's answer moves.

Usage: LD_PRELOAD=libtcmalloc_minimal.so.4 python experiments/headline/attention_probe.py \
       ROWS,HEADS,L,HEAD_DIM [REPEATS=8] [SECONDS_PER_CANDIDATE=0.25]
The headline's shape is 256,4,151,32, the default job's 128,2,151,24. Preload tcmalloc as `system=tuned` runs
do: with glibc's allocator the written-out math's large allocations make it far slower (SDPA 0.44-0.67x its
time at the headline's shape, against 1.00-1.16x in runs, 2-core AVX-512 EPYC, 2026-11-28).
"""

import statistics
import sys

import torch
from omegaconf import OmegaConf
from torch import nn

from aamperf.model.layers import MathAttention
from aamperf.phases.attention import SDPAttention
from aamperf.phases.dropout import apply_dropout
from aamperf.probe_measures import TRIALS, timed, timed_in_turn


def main() -> None:
    shape = tuple(int(v) for v in sys.argv[1].split(","))
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    min_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    mask = torch.rand(shape[0], 1, 1, shape[2], generator=gen) < 0.8
    mask[..., 0] = True
    modules = nn.ModuleList([MathAttention(0.1), SDPAttention(0.1, [])])
    apply_dropout(modules, OmegaConf.create({"impl": "fast"}), cpu)  # as optim=advanced and ultra train

    def step(module: nn.Module):
        def run() -> None:
            module(q, k, v, mask).sum().backward()  # as aamperf.probe_measures.measure_attention times it
            q.grad = k.grad = v.grad = None

        return run

    calls = [step(m) for m in modules]
    apart, in_turn = [], []
    for i in range(repeats):
        math_s, sdpa_s = (timed(call, cpu, min_s=min_s) for call in calls)
        apart.append(statistics.median(sdpa_s) / statistics.median(math_s))
        for call in calls:
            call()
        math_s, sdpa_s = timed_in_turn(*calls, device=cpu, trials=TRIALS, min_s=min_s)
        in_turn.append(statistics.median(sdpa_s) / statistics.median(math_s))
        print(f"{i}: one after the other {apart[-1]:.3f}, in turn {in_turn[-1]:.3f}", flush=True)
    print(f"shape {list(shape)}, {min_s} s per candidate, {torch.get_num_threads()} threads")
    for name, ratios in (("one after the other", apart), ("in turn", in_turn)):
        print(
            f"{name}: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}, "
            f"stdev {statistics.stdev(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
