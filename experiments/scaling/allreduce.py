"""Time DDP's gradient all-reduce alone: one fp32 tensor of the model's parameter count, gloo, 2 ranks.

torchrun --standalone --nproc_per_node=2 experiments/scaling/allreduce.py RUN_DIR/summary.json
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
n_params = json.load(open(sys.argv[1]))["n_params"]
grads = torch.randn(n_params)
times = []
for _ in range(20):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(grads)
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    median = statistics.median(times[3:])
    megabytes = n_params * 4 / 1e6
    print(f"all-reduce of {n_params} fp32 values ({megabytes:.1f} MB), gloo, 2 ranks: {median * 1e3:.2f} ms")
    print(f"effective bandwidth {2 * megabytes / median / 1e3:.2f} GB/s (ring: 2 (W-1)/W x bytes per rank)")
dist.destroy_process_group()
