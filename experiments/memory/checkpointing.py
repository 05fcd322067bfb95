"""Peak memory and step time of memory=none / full / selective / ops on the default model (aam_small, batch
8, fp32, the default config's other phases off), each in its own process (its own RSS high-water mark),
the options interleaved and rotated per repeat so that their ratios share the machine's state. With
--compiled: compile=default (each block) under memory=none and memory=budget at activation budgets 0.5 and
0.2, with the bytes forward saved for backward (autograd's saved-tensor hooks see the compiled graphs').

    python experiments/memory/checkpointing.py [REPEATS] [STEPS] [--compiled]   # a markdown table on stdout
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
# --compiled: the overrides of each row, compile=default added
COMPILED = {
    "none": ["memory=none"],
    "budget 0.5": ["memory=budget", "memory.activation_budget=0.5"],
    "budget 0.2": ["memory=budget", "memory.activation_budget=0.2"],
}
REPO = Path(__file__).resolve().parents[2]


def one(option: str, steps: int) -> dict:
    """One process: the default model with memory=<option> (or a COMPILED row's overrides, compiled), a
    warm-up step (the compile's), then `steps` timed ones."""
    import psutil
    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from aamperf.config import CONF_DIR, register_configs
    from aamperf.data import build_data
    from aamperf.device import to_device
    from aamperf.phases.compile import apply_compile
    from aamperf.phases.memory import apply_checkpointing

    register_configs()
    overrides = [*COMPILED[option], "compile=default"] if option in COMPILED else [f"memory={option}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["device=cpu", *overrides])
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    apply_checkpointing(model, cfg.memory)
    loss_fn = instantiate(cfg.loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = build_data(cfg.data, batch_size=cfg.trainer.batch_size, seed=0, loader=cfg.dataloader)
    batches = iter(data.train_loader)
    batch = to_device(next(batches), torch.device("cpu"))
    times, rss_before, saved = [], psutil.Process().memory_info().rss, {}
    compiled = option in COMPILED and apply_compile(model, cfg.compile, lambda: None)["status"] == "applied"

    def keep(t):  # the bytes of each storage forward saves for backward
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    for i in range(steps + 1):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss, _ = loss_fn(model, batch, i)
        if i == 0:
            saved_bytes = sum(saved.values())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "option": option,
        "step_s": statistics.median(times[1:]),
        "peak_rss": peak,
        "rss_before": rss_before,
        "saved_bytes": saved_bytes,
        "compiled": compiled,
    }


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(repeats: int, steps: int, compiled: bool = False) -> None:
    options = tuple(COMPILED) if compiled else OPTIONS
    rows = {o: [] for o in options}
    n = len(options)
    for r in range(repeats):
        for option in options[r % n :] + options[: r % n]:  # rotated: no option always first or last
            cmd = [sys.executable, __file__, "--one", option, str(steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
            rows[option].append(json.loads(out.strip().splitlines()[-1]))
    import torch

    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; ", end="")
    print(f"{repeats} repeats x {steps} timed steps (median each), medians of the repeats", end="")
    if compiled:  # saved for backward: the first step's forward
        every = all(x["compiled"] for o in options for x in rows[o])
        print(f"; compile=default (each block), every run compiled: {every}", end="")
    print("\n")
    saved_head = ("| saved for backward MiB | vs none ", "|---|---") if compiled else ("", "")
    print("| memory= | step s | vs none | peak RSS GiB | vs none | step's RSS growth GiB | vs none ", end="")
    print(f"{saved_head[0]}|\n|---|---|---|---|---|---|---{saved_head[1]}|")
    keys = ("step_s", "peak_rss", "saved_bytes")
    med = {o: {k: statistics.median(x[k] for x in rows[o]) for k in keys} for o in options}
    for o in options:
        med[o]["growth"] = statistics.median(x["peak_rss"] - x["rss_before"] for x in rows[o])
    for o in options:
        m, n = med[o], med["none"]
        saved = f" {m['saved_bytes'] / 2**20:.1f} | {m['saved_bytes'] / n['saved_bytes']:.2f} |"
        print(
            f"| {o} | {m['step_s']:.3f} | {m['step_s'] / n['step_s']:.2f} | {m['peak_rss'] / 2**30:.2f} | "
            f"{m['peak_rss'] / n['peak_rss']:.2f} | {m['growth'] / 2**30:.3f} | "
            f"{m['growth'] / n['growth']:.2f} |{saved if compiled else ''}"
        )
    print("\nper repeat (step s, peak RSS GiB):")
    for o in options:
        print(f"- {o}: " + ", ".join(f"{x['step_s']:.3f} / {x['peak_rss'] / 2**30:.2f}" for x in rows[o]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        sys.path.insert(0, str(REPO))
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]))))
    else:
        args = [a for a in sys.argv[1:] if a != "--compiled"]
        main(int(args[0]) if args else 3, int(args[1]) if len(args) > 1 else 3, "--compiled" in sys.argv)
