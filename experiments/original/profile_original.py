"""torch.profiler over steps FIRST+1..LAST of the original AAM's `aam pretrain` (jbk708/aam), unmodified: the
operators' self CPU time per step, to set beside aamperf's `metrics.profile_steps` table of the same job.
Run in the original's venv, with run.sh's options (its ORIG array):
  python profile_original.py TABLE.txt -- <aam pretrain options>   (env: FIRST=3 LAST=6)
The profiler starts after optimizer step FIRST and stops after step LAST (an optimizer step hook, as
../gpu_scale/time_original.py stamps its clock); TABLE.txt gets key_averages by self CPU time, per step.
"""

import os
import sys

import torch
from aam.cli.pretrain import pretrain
from torch.optim.optimizer import register_optimizer_step_post_hook

table_path, args = sys.argv[1], sys.argv[3:]
first, last = int(os.environ.get("FIRST", 3)), int(os.environ.get("LAST", 6))
profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
steps = [0]


def around_steps(optimizer, *_):
    steps[0] += 1
    if steps[0] == first:
        profiler.start()
    elif steps[0] == last:
        profiler.stop()
        averages = profiler.key_averages()
        total_us = sum(e.self_cpu_time_total for e in averages)
        n = last - first
        lines = [f"steps {first + 1}-{last} of the original: {total_us / n / 1e6:.3f} s of self CPU a step"]
        lines.append(f"{'operator':<60} {'self ms/step':>12} {'calls/step':>10}")
        for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:40]:
            lines.append(f"{e.key[:60]:<60} {e.self_cpu_time_total / n / 1e3:>12.1f} {e.count / n:>10.0f}")
        with open(table_path, "w") as f:
            f.write("\n".join(lines) + "\n")


register_optimizer_step_post_hook(around_steps)
pretrain.main(args, standalone_mode=False)
