"""dropout.threads: the fast dropout's random words drawn on one thread against torch's threads. The masks
are the same either way (the seed decides them, not the threads), so only the time can differ: a forward +
backward of the headline's model at `optim=advanced` on the same batch, in one process, the two ways in turn.

Usage: LD_PRELOAD=libtcmalloc_minimal.so.4 python experiments/headline/mask_threads.py [PAIRS=10] [overrides]
(tcmalloc preloaded as `system=tuned` runs it; the overrides go after `experiment=headline optim=advanced`).
"""

import statistics
import sys
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir

from aamperf.config import CONF_DIR, register_configs
from aamperf.device import to_device
from aamperf.job import build_job
from aamperf.metrics.flops import cpu_description
from aamperf.metrics.timing import StepMeter
from aamperf.phases.dropout import FastDropout
from aamperf.summary import Summary


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    register_configs()
    with tempfile.TemporaryDirectory() as cache, initialize_config_dir(str(CONF_DIR), version_base=None):
        overrides = ["experiment=headline", "optim=advanced", f"data.cache_dir={cache}", *sys.argv[2:]]
        cfg = compose("config", overrides=overrides)
        job = build_job(cfg, Summary(cfg, StepMeter(0), "process", []))
    model, plan = job.plan.model, job.plan
    drops = [m for m in model.modules() if isinstance(m, FastDropout)]
    batch = to_device(next(iter(job.data.train_loader)), job.device)

    def step(threads: int | None) -> float:
        for m in drops:
            m.threads = threads
        torch.manual_seed(0)  # the same masks both ways
        start = time.perf_counter()
        with plan.autocast():
            loss, _ = job.loss_fn(model, batch, 0)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(1), step(None)  # warm-up
    times = {1: [], None: []}
    for i in range(pairs):
        for threads in (1, None) if i % 2 == 0 else (None, 1):
            times[threads].append(step(threads))
    ratios = [one / many for one, many in zip(times[1], times[None], strict=True)]
    print(f"{cpu_description()}; {len(drops)} dropout modules; torch threads {torch.get_num_threads()}")
    for threads, name in ((1, "dropout.threads=1"), (None, "dropout.threads=null")):
        print(f"{name}: median {statistics.median(times[threads]):.3f} s a forward + backward")
    print(
        f"one thread's time over the threads': median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f} over {pairs} pairs"
    )


if __name__ == "__main__":
    main()
