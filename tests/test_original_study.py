"""experiments/original/summarize.py: each level paired with the original's run of the same seed, from run
directories written as run.sh, /usr/bin/time and the two programs write them (records of known figures)."""

import importlib.util
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments/original/summarize.py"
spec = importlib.util.spec_from_file_location("original_summarize", SCRIPT)
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)

GNU_TIME = (  # the two lines of /usr/bin/time -v that summarize reads
    "\tElapsed (wall clock) time (h:mm:ss or m:ss): {clock}\n\tMaximum resident set size (kbytes): {kib}\n"
)


def write_run(out: Path, seed: int, cfg: str, steps: list[float], wall: str, val_loss: float, exit_status=0):
    run = out / "runs" / f"seed{seed}" / cfg
    run.mkdir(parents=True)
    (run / "time.txt").write_text(GNU_TIME.format(clock=wall, kib=2**20) + f"\tExit status: {exit_status}\n")
    (run / "loadavg").write_text("1.00 0.9 0.8 2/100 1\n1.50 1.0 0.8 2/100 2\n")
    if cfg.startswith("original"):  # experiments/gpu_scale/time_original.py's record
        record = {"step_times_s": steps, "val_losses": [val_loss]}
        (run / "steps.json").write_text(json.dumps(record))
    else:  # metrics.log_every=1: a line per step, then the summary
        lines = [{"step": i + 1, "step_time_s": s} for i, s in enumerate(steps)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (run / "summary.json").write_text(json.dumps({"val_loss": val_loss}))


def test_levels_are_paired_with_the_original_of_their_seed(tmp_path):
    # the first SKIP steps (compile, warm-up) do not count: counted, they would move each median
    for seed, (orig_step, level_step) in enumerate([(10.0, 2.0), (12.0, 3.0), (9.0, 2.25)]):
        write_run(tmp_path, seed, "original-default", [100] * 3 + [orig_step] * 3, "2:00.00", 2.4)
        val_loss = 2.4 * (1 - 0.05 * seed)  # 0, -5% and -10% against the original's
        write_run(tmp_path, seed, "advanced", [100] * 3 + [level_step] * 3, "0:30.00", val_loss)
        best = [100] * 3 + [orig_step / 2] * 3  # the original's fastest flags with tcmalloc: half its step
        write_run(tmp_path, seed, "original-fastest-tcmalloc", best, "1:00.00", 2.4)
        write_run(tmp_path, seed, "basic", [orig_step] * 6, "1:00.00", 2.4 * (1.1 + 0.01 * seed))  # +10-12%
    write_run(tmp_path, 0, "ultra", [1.0] * 10, "0:20.00", 2.0, exit_status=1)  # failed: not a figure

    runs = summarize.read_runs(tmp_path)
    assert set(runs) == {
        "original-default",
        "original-fastest-tcmalloc",
        "advanced",
        "basic",
    }  # not ultra: failed
    assert [runs["advanced"][s]["step_s"] for s in range(3)] == [2.0, 3.0, 2.25]
    assert runs["original-default"][0]["wall_s"] == 120.0
    assert math.isclose(runs["advanced"][0]["rss_gib"], 1.0)

    table = summarize.to_markdown(runs).splitlines()
    basic = next(line for line in table if line.startswith("| basic"))
    assert basic.rstrip(" |").endswith(": worse"), basic  # its whole interval beyond +2%
    row = next(line for line in table if line.startswith("| advanced"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # speed: 5x, 4x and 4x by seed (paired), not the 10.33 / 2.42 of the medians
    speed = math.exp(sum(map(math.log, [5.0, 4.0, 4.0])) / 3)
    assert cells[3].startswith(f"{speed:.2f}x [4.00, 5.00]"), cells[3]
    best = math.exp(sum(map(math.log, [2.5, 2.0, 2.0])) / 3)  # against the original at its best
    assert cells[5].startswith(f"{best:.2f}x [2.00, 2.50]"), cells[5]
    assert cells[7] == "4.00x [4.00, 4.00]"  # end to end: 120 s against 30 s
    assert cells[8] == "2.00x [2.00, 2.00]"  # and 60 s against 30 s
    assert cells[11].startswith("-5.0% [") and cells[11].endswith(": equal or better"), cells[11]


def test_fewer_seeds_than_an_interval_needs_are_shown_as_they_are(tmp_path):
    write_run(tmp_path, 0, "original-default", [10.0] * 10, "2:00.00", 2.0)
    write_run(tmp_path, 0, "baseline", [8.0] * 10, "1:40.00", 2.1)
    row = summarize.to_markdown(summarize.read_runs(tmp_path)).splitlines()[3]
    assert "| 1.25x (1 seed) |" in row and "+5.0% (undecided: 1 seed)" in row


def test_a_directory_without_runs_is_a_usage_error(tmp_path, capsys):
    assert summarize.main([str(tmp_path)]) == 2
    (tmp_path / "runs").mkdir()
    assert summarize.main([str(tmp_path)]) == 2
    assert "no finished run" in capsys.readouterr().err
