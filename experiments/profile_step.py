"""Profile training steps of any composed config: step times, then a torch.profiler table of one step.

    python experiments/profile_step.py experiment=headline optim=advanced
    python experiments/profile_step.py experiment=headline optim=advanced dropout=standard

The per-step figures quoted in experiments/headline/README.md come from this script.
"""

import itertools
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.profiler import ProfilerActivity, profile

from aamperf.config import register_configs
from aamperf.data import build_data
from aamperf.distributed import World
from aamperf.phases import apply_phases, setup_phases
from aamperf.run import warmup_step

CONF = Path(__file__).resolve().parents[1] / "conf"


def main(overrides: list[str]) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=["device=cpu", *overrides])
    device = torch.device("cpu")
    setup = setup_phases(cfg, device)
    data = build_data(
        cfg.data, batch_size=cfg.trainer.batch_size, seed=cfg.seed, loader=setup.loader, pad_to=setup.pad_to
    )
    torch.manual_seed(cfg.seed)
    model, loss_fn = instantiate(cfg.model), instantiate(cfg.loss)
    batches = list(itertools.islice(data.train_loader, 4))
    plan = apply_phases(model, cfg, device, warmup_step(loss_fn, batches[0]), setup.records, World())

    def step(batch: dict) -> None:
        with plan.autocast():
            loss, _ = loss_fn(model, batch, 1)
        plan.scaler.scale(loss).backward()
        plan.scaler.step(plan.optimizer)
        plan.scaler.update()
        plan.optimizer.zero_grad(set_to_none=True)

    step(batches[0])  # warm-up
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    print(" ".join(overrides), "| step times (s):", [round(t, 2) for t in times])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batches[1])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main(sys.argv[1:])
