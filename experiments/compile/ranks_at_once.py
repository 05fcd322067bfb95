"""Time to the first step of a 2-rank `optim=ultra` job told to compile by a cached compile=auto decision:
do the ranks compile at once, or one after the other?

    python experiments/compile/ranks_at_once.py OUT_DIR [CHECKOUT ...] [--repeats N]

Each CHECKOUT (default: this one; e.g. a `git worktree` of c94d835 for the ranks compiling one after the
other) runs `python -m aamperf.launch --nproc_per_node=2 -m aamperf.train distributed=ddp optim=ultra
model=aam_tiny` with a new inductor cache, interleaved with the others, N times. The probe cache holds a
trial that says compiling pays (what an earlier run here would have left), so no rank runs a trial. Each
run is stopped with SIGTERM after its first logged line and its summary.json gives `time_to_first_step_s`.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from aamperf.cgroups import usable_cores
from aamperf.config import CONF_DIR, register_configs
from aamperf.phases.auto import apply_decisions, measure_decisions
from aamperf.phases.compile import trial_context
from aamperf.probe import Probe

RANKS = 2
OVERRIDES = ["distributed=ddp", "optim=ultra", "model=aam_tiny", "trainer.max_steps=100000"]


def cached_decision_to_compile(probe_cache: Path) -> None:
    """The trial figures a rank would find for this job (its threads: aamperf.launch's share of cores)."""
    torch.set_num_threads(max(1, len(usable_cores()) // RANKS))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*OVERRIDES, f"probe.cache={probe_cache}"])
    micro_batch = cfg.trainer.batch_size // cfg.trainer.grad_accum_steps
    apply_decisions(cfg, measure_decisions(cfg, torch.device("cpu"), micro_batch))
    pays = {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 1.0, "graphs": 1, "under_load": None}
    context = {"context": trial_context(cfg, micro_batch)}
    Probe(torch.device("cpu"), probe_cache).answer("compile_trial", context, lambda: pays)


def first_step_s(checkout: Path, run_dir: Path, probe_cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(run_dir) + ".inductor", "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "aamperf.launch", f"--nproc_per_node={RANKS}", "-m", "aamperf.train"]
    cmd += [*OVERRIDES, "trainer.progress=false", f"probe.cache={probe_cache}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None:
            raise RuntimeError(f"{run_dir}: the job ended before its first line")
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # to the launcher alone: it passes it on to the ranks
    proc.wait(timeout=300)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"checkout": str(checkout), "first_step_s": summary["time_to_first_step_s"],
            "compile": summary["phases"]["compile"]["status"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("checkouts", type=Path, nargs="*", default=[Path(__file__).resolve().parents[2]])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    probe_cache = args.out / "probe.json"
    cached_decision_to_compile(probe_cache)
    subprocess.run(["lscpu"], check=False)
    rows = []
    for repeat in range(args.repeats):
        for i, checkout in enumerate(args.checkouts):
            row = first_step_s(checkout.resolve(), args.out / f"checkout{i}_run{repeat}", probe_cache)
            print(json.dumps(row), flush=True)
            rows.append(row)
    (args.out / "first_steps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
