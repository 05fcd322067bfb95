"""Peak memory and step time of memory=none / full / selective / ops on the default model (aam_small, batch
8, fp32, the default config's other phases off), each in its own process (its own RSS high-water mark),
the options interleaved and rotated per repeat so that their ratios share the machine's state.

    python experiments/memory/checkpointing.py [REPEATS] [STEPS]   # a markdown table on stdout
"""

import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

OPTIONS = ("none", "full", "selective", "ops")
REPO = Path(__file__).resolve().parents[2]


def one(option: str, steps: int) -> dict:
    """One process: the default model with memory=<option>, a warm-up step, then `steps` timed ones."""
    import psutil
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from aamperf.config import CONF_DIR, register_configs
    from aamperf.data import build_data
    from aamperf.device import to_device
    from aamperf.phases.memory import apply_checkpointing

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["device=cpu", f"memory={option}"])
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    apply_checkpointing(model, cfg.memory)
    loss_fn = instantiate(cfg.loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = build_data(cfg.data, batch_size=cfg.trainer.batch_size, seed=0, loader=cfg.dataloader)
    batches = iter(data.train_loader)
    batch = to_device(next(batches), torch.device("cpu"))
    times, rss_before = [], psutil.Process().memory_info().rss
    for i in range(steps + 1):
        start = time.perf_counter()
        loss, _ = loss_fn(model, batch, i)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "option": option, "step_s": statistics.median(times[1:]),
        "peak_rss": peak, "rss_before": rss_before}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(repeats: int, steps: int) -> None:
    rows = {o: [] for o in OPTIONS}
    for r in range(repeats):
        for option in OPTIONS[r % 4 :] + OPTIONS[: r % 4]:  # rotated: no option always first or last
            cmd = [sys.executable, __file__, "--one", option, str(steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
            rows[option].append(json.loads(out.strip().splitlines()[-1]))
    import torch

    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; ", end="")
    print(f"{repeats} repeats x {steps} timed steps (median each), medians of the repeats\n")
    print("| memory= | step s | vs none | peak RSS GiB | vs none | step's RSS growth GiB | vs none |")
    print("|---|---|---|---|---|---|---|")
    med = {o: {k: statistics.median(x[k] for x in rows[o]) for k in ("step_s", "peak_rss")} for o in OPTIONS}
    for o in OPTIONS:
        med[o]["growth"] = statistics.median(x["peak_rss"] - x["rss_before"] for x in rows[o])
    for o in OPTIONS:
        m, n = med[o], med["none"]
        print(
            f"| {o} | {m['step_s']:.3f} | {m['step_s'] / n['step_s']:.2f} | {m['peak_rss'] / 2**30:.2f} | "
            f"{m['peak_rss'] / n['peak_rss']:.2f} | {m['growth'] / 2**30:.3f} | "
            f"{m['growth'] / n['growth']:.2f} |"
        )
    print("\nper repeat (step s, peak RSS GiB):")
    for o in OPTIONS:
        print(f"- {o}: " + ", ".join(f"{x['step_s']:.3f} / {x['peak_rss'] / 2**30:.2f}" for x in rows[o]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        sys.path.insert(0, str(REPO))
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]))))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
