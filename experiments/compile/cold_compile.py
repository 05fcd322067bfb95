"""What a first compile costs: a short aam_tiny run with `compile=default` and the given overrides, in a
new inductor cache, its compile seconds and graphs from its run record; or (--probe) the device probe's
compile of one headline-width block. The figures behind the recomputed-block note in
aamperf/phases/compile.py (`memory=selective memory.recompute_every=2 model.asv_layers=2
model.sample_layers=2 model.encoder_layers=2 compile.dynamic=true`; the code before 0ffe7d7, which
compiled the blocks inside their wrappers: `git checkout 0ffe7d7~1 -- aamperf/phases/compile.py`), and
behind the compile-threads trial (--probe with TORCHINDUCTOR_COMPILE_THREADS=1 set or not); or
(--trivial) the least any compile costs a first run: importing dynamo and inductor, then the forward +
backward of a two-op function (one fused kernel each way).
    python experiments/compile/cold_compile.py [--probe | --trivial] [override ...]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--probe", action="store_true", help="the probe's block compile, not a run")
parser.add_argument("--trivial", action="store_true", help="a two-op function's compile, not a run")
parser.add_argument("overrides", nargs="*", help="the run's overrides (aam_tiny, 3 steps, compile=default)")
args = parser.parse_args()
work = Path(tempfile.mkdtemp(prefix="cold_compile_"))
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # a new cache: a first compile

import torch  # noqa: E402 (after the cache directory is set)

from aamperf.metrics.host import cpu_description  # noqa: E402

print(f"CPU: {cpu_description()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
print(f"TORCHINDUCTOR_COMPILE_THREADS={os.environ.get('TORCHINDUCTOR_COMPILE_THREADS', '(torch decides)')}")
if args.trivial:
    from aamperf.probe_measures import measure_compiler_import

    import_s = measure_compiler_import()["import_s"]  # what any compile loads first, as compile=auto times it
    start = time.perf_counter()
    x = torch.randn(64, 64, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).relu())(x).sum().backward()
    print(f"trivial: import {import_s:.1f} s, compile + first step {time.perf_counter() - start:.1f} s")
elif args.probe:
    from aamperf.probe_measures import measure_compile

    start = time.perf_counter()
    r = measure_compile(torch.device("cpu"), (256, 151, 128, 4, 4))
    print(
        f"probe: block compile {r['block_compile_s']:.1f} s, eager {r['eager_block_s']:.3f} s, compiled "
        f"{r['compiled_block_s']:.3f} s, {time.perf_counter() - start:.1f} s in all"
    )
else:
    from hydra import compose, initialize_config_dir

    from aamperf.config import CONF_DIR, register_configs
    from aamperf.run import train

    register_configs()
    tiny = [
        "model=aam_tiny",
        "data.n_samples=40",
        "data.n_asvs=64",
        "data.mean_richness=20",
        "data.depth=600",
    ]
    tiny += [
        "data.rarefy_depth=500",
        "trainer.batch_size=4",
        "trainer.max_steps=3",
        "model.dropout=0",
        "trainer.progress=false",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            "config", overrides=[*tiny, "compile=default", f"data.cache_dir={work}/data", *args.overrides]
        )
    summary = train(cfg, work / "run")
    record = summary["phases"]["compile"]
    print(
        f"{record['status']}: {record.get('modules')} modules, {record.get('graphs')} graphs, "
        f"{record.get('compile_time_s', 0):.1f} s of compiling"
    )
