"""Does building the sample store in worker processes pay on this machine? Builds the store of a
simulated table (data=simulated at its defaults but data.n_samples) with one worker per core and
in this process, alternating, REPEATS times, and checks the two stores are byte-identical.
    python experiments/data_scale/store_workers.py [N_SAMPLES] [REPEATS] [CACHE_DIR]"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

from omegaconf import OmegaConf

import aamperf.data.store as store
from aamperf.config import DataConfig
from aamperf.data.tables import resolve_files


def main(n_samples: int, repeats: int, cache: Path) -> None:
    cfg = OmegaConf.merge(
        OmegaConf.structured(DataConfig),
        {"n_samples": n_samples, "cache_dir": str(cache), "max_asvs": 64, "target": "target"},
    )
    files = resolve_files(cfg)  # simulated first if missing (not timed)
    cores = len(os.sched_getaffinity(0))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    print(f"CPU: {model}, {cores} cores; {n_samples} samples, chunks of {store.CHUNK_SAMPLES}")
    times: dict[str, list[float]] = {"workers": [], "in-process": []}
    for _ in range(repeats):
        for name, threshold in (("workers", 1), ("in-process", 10**9)):
            out = cache / "store_workers" / name
            shutil.rmtree(out, ignore_errors=True)
            with mock.patch.object(store, "PARALLEL_FROM_CHUNKS", threshold):
                start = time.perf_counter()
                store.build_store(cfg, files, True, out)
                times[name].append(round(time.perf_counter() - start, 1))
    same = all(
        (cache / "store_workers/workers" / f).read_bytes()
        == (cache / "store_workers/in-process" / f).read_bytes()
        for f in ("rows", "reads", "branches")
    )
    print(f"build s: {times}; stores byte-identical: {same}")


if __name__ == "__main__":  # the workers import this module: nothing runs on import
    args = sys.argv[1:]
    main(
        int(args[0]) if args else 100_000,
        int(args[1]) if len(args) > 1 else 2,
        Path(args[2]) if len(args) > 2 else Path("outputs/data_scale/cache"),
    )
