"""A real multirun as a user starts it: the comparison callback's report and the W&B offline runs."""

import json
import os
from pathlib import Path

import pytest
from conftest import launch_run, read_metrics, read_wandb

from aamperf.compare import main
from aamperf.loggers import sweep_group
from aamperf.report import find_runs
from aamperf.report.wandb_report import make_report


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("sweep")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(root)  # no ~/.netrc: W&B has no key and must go offline by itself
    proc, sweep_dir = launch_run(
        "optim=baseline,ultra",
        "seed=0,1",
        "logger=wandb",
        cache_dir=cache_dir,
        run_dir=root / "multirun" / "study",
        multirun=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir, proc


def test_sweep_ends_with_the_report_of_its_own_runs(sweep):
    sweep_dir, proc = sweep
    for name in ("comparison.json", "comparison.csv", "comparison.md", "comparison.png"):
        assert (sweep_dir / name).stat().st_size > 0
    assert "| `optim=ultra` |" in proc.stdout  # the table is printed at the end of the sweep
    result = json.loads((sweep_dir / "comparison.json").read_text())
    summaries = [run.summary for run in find_runs([sweep_dir])]
    speed = {(s["optim"], s["seed"]): s["samples_per_s"] for s in summaries}
    rows = {r["config"]: r for r in result["rows"]}
    assert result["baseline"] == "optim=baseline" and set(rows) == {"optim=baseline", "optim=ultra"}
    ultra = rows["optim=ultra"]
    assert ultra["seeds"] == ultra["paired_seeds"] == [0, 1]
    # the geometric mean of the two seeds' speed-ups; two pairs give no interval and no verdict
    ratios = [speed["ultra", seed] / speed["baseline", seed] for seed in (0, 1)]
    assert ultra["speedup"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    assert ultra["speedup_lo"] is None and ultra["verdict"].startswith("undecided: 2 seed(s) paired")
    # both configurations trained on the same data: the same data.seed in every job
    assert {s["config"]["data"]["seed"] for s in summaries} == {0}
    # every job's clock starts with it: the first does not carry the sweep's start (imports, set-up)
    assert [s["clock_origin"] for s in summaries] == ["job_start"] * 4
    # Hydra's basic launcher runs one job after the other: no two shared the machine's time
    assert all(s["ended_at"] for s in summaries) and result["overlaps"] == []
    assert "at the same time" not in (sweep_dir / "comparison.md").read_text()


@pytest.mark.slow  # ~9 s on a 2-core AMD EPYC: the default suite stays near 10 minutes
def test_the_baseline_a_refused_sweep_names_is_the_one_its_report_compares_with(tmp_path, cache_dir):
    """The fix a sweep of two values is refused with (tests/test_bad_input.py), as the user types it."""
    args = ["trainer.max_steps=1", "trainer.lr=0.001,0.0001", "compare.baseline='trainer.lr=0.0001'"]
    proc, sweep_dir = launch_run(*args, cache_dir=cache_dir, run_dir=tmp_path / "sweep", multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((sweep_dir / "comparison.json").read_text())
    assert result["baseline"] == "trainer.lr=0.0001"
    assert [r["config"] for r in result["rows"]] == ["trainer.lr=0.0001", "trainer.lr=0.001"]  # its own first


@pytest.mark.slow  # over 15 s on a 2-core AVX2-only EPYC: the default suite stays near 10 minutes
def test_jobs_that_ran_at_once_are_named_and_their_verdicts_left_undecided(tmp_path, cache_dir):
    # submitit's local launcher starts every job at once, on this machine's two cores
    proc, sweep_dir = launch_run(
        "hydra/launcher=submitit_local",
        "optim=baseline,basic",
        cache_dir=cache_dir,
        run_dir=tmp_path / "at_once",
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((sweep_dir / "comparison.json").read_text())
    runs = {run.path: run for run in find_runs([sweep_dir])}
    assert len(runs) == 2 and {str(path) for o in result["overlaps"] for path in o["runs"]} == set(
        map(str, runs)
    )
    for o in result["overlaps"]:  # what each pair of runs shared, from their own summaries
        (a, b), shared = (runs[Path(path)].window for path in o["runs"]), o["shared_s"]
        assert shared == pytest.approx(min(a[1], b[1]) - max(a[0], b[0])) and shared > 1
    basic = next(r for r in result["rows"] if r["config"] == "optim=basic")
    assert basic["overlapped_pairs"] == 1 and basic["verdict"].startswith(
        "undecided: 1 of 1 pairs ran at the same time"
    )
    assert "runs ran at the same time as another run on one machine**" in proc.stdout


def test_each_job_is_an_offline_wandb_run_with_group_job_type_config_and_metrics(sweep):
    sweep_dir, _ = sweep
    jobs = find_runs([sweep_dir])
    assert len(jobs) == 4
    for run in jobs:
        job, summary = run.path, run.summary
        assert summary["logger"][0]["mode"] == "offline"
        records = read_wandb(job / "wandb" / "latest-run")
        run = next(r["run"] for r in records if r["type"] == "run")
        assert run["run_group"] == sweep_group(sweep_dir) == "study"
        assert run["job_type"] == summary["optim"]
        assert f"seed={summary['seed']}" in run["display_name"].split()
        config = run["config"]["update"]
        assert config["trainer"]["max_steps"] == 3 and config["optim"] == summary["optim"]
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        steps = read_metrics(job)
        assert [h["train/loss"] for h in history] == pytest.approx([s["loss"] for s in steps])
        assert {"perf/samples_per_s", "mem/rss_bytes", "sys/cpu_percent", "train/lr"} <= set(history[-1])
        final = {}
        for r in records:
            if r["type"] == "summary":
                final.update(r["summary"].get("update", {}))
        assert final["samples_per_s"] == pytest.approx(summary["samples_per_s"])
        assert final["status"] == "completed"


def test_the_comparison_is_a_wandb_table_in_the_same_group(sweep):
    sweep_dir, _ = sweep
    records = read_wandb(sweep_dir / "wandb" / "latest-run")
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["job_type"] == "comparison" and run["run_group"] == "study"
    logged = {}
    for r in records:
        if r["type"] == "history":
            logged.update(r["history"]["item"])
    assert logged["comparison._type"] == "table-file" and logged["comparison_plot._type"] == "image-file"
    table_path = next((sweep_dir / "wandb" / "latest-run" / "files").rglob("comparison_*.table.json"))
    table = json.loads(table_path.read_text())
    report = json.loads((sweep_dir / "comparison.json").read_text())
    config_col = table["columns"].index("config")
    speedup_col = table["columns"].index("speedup")
    assert {row[config_col]: row[speedup_col] for row in table["data"]} == {
        row["config"]: pytest.approx(row["speedup"]) for row in report["rows"]
    }


def test_wandb_report_offline_says_so_and_keeps_the_local_report(sweep, tmp_path, monkeypatch, capsys):
    sweep_dir, _ = sweep
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    main([str(sweep_dir), "--wandb-report", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.startswith("W&B is offline here") and f"wandb sync '{sweep_dir}'/*/wandb/offline-run-*" in err
    assert (tmp_path / "comparison.md").exists()


def test_the_wandb_report_holds_the_verdicts_and_panels_of_the_group(sweep):
    sweep_dir, _ = sweep
    result = json.loads((sweep_dir / "comparison.json").read_text())
    report = make_report(result, {"project": "aamperf", "entity": "team"}, "study")
    heading, verdicts, grid = report.blocks
    assert "`optim=ultra`: " + result["rows"][1]["verdict"] in verdicts.text
    assert grid.runsets[0].filters == "Group = 'study'" and grid.runsets[0].project == "aamperf"
    assert [p.title for p in grid.panels][:2] == ["throughput (samples/s)", "step time (s)"]
