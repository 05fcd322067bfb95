"""experiments/run_paired.sh: each seed runs every level, in reverse order on every other seed (a run right
after another may be slower: the order falls on each level both ways round), then one report. `python` is a
stand-in here that records its arguments: the order is the script's, not training's."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "run_paired.sh"


def test_the_levels_run_in_reverse_order_on_every_other_seed_and_the_report_follows(tmp_path):
    calls = tmp_path / "calls.txt"
    stand_in = tmp_path / "bin" / "python"
    stand_in.parent.mkdir()
    stand_in.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n')
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_in.parent}:{os.environ['PATH']}"}
    out = tmp_path / "out"
    run = subprocess.run(
        [str(SCRIPT), "headline", str(out), "baseline advanced ultra", "0 1 2", "--", "trainer.max_steps=5"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = calls.read_text().splitlines()
    runs = [(line.split("optim=")[1].split()[0], line.split("seed=")[1].split()[0]) for line in lines[:-1]]
    assert runs == [
        ("baseline", "0"), ("advanced", "0"), ("ultra", "0"),
        ("ultra", "1"), ("advanced", "1"), ("baseline", "1"),
        ("baseline", "2"), ("advanced", "2"), ("ultra", "2"),
    ]  # fmt: skip
    assert all(line.endswith("trainer.max_steps=5") and "experiment=headline" in line for line in lines[:-1])
    assert lines[-1] == f"-m aamperf.compare {out}"  # the report, its baseline the first level
