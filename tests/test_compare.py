"""The comparison report's arithmetic, on runs with known figures."""

import json

import pytest

from aamperf.compare import compare, find_runs, main


def make_run(root, name, overrides, **summary):
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    defaults = {
        "status": "completed",
        "peak_rss_bytes": 2**30,
        "step_time_s": 1.0,
        "mfu": 0.1,
        "train_loss": 2.0,
    }
    (run / "summary.json").write_text(json.dumps({**defaults, **summary}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")


@pytest.fixture
def sweep(tmp_path):
    # optim level -> (samples/s per seed, val loss, extra summary fields)
    levels = {
        "baseline": ((10.0, 11.0, 12.0), 2.00, {}),
        "ultra": (
            (50.0, 55.0, 60.0),
            2.01,
            {"peak_rss_bytes": 2**29, "step_time_s": 0.25, "train_loss": 2.1},
        ),
        "basic": ((11.0, 12.5), 2.10, {}),
        "lucky": ((30.0,), 1.90, {}),
    }
    for level, (speeds, val_loss, extra) in levels.items():
        for seed, sps in enumerate(speeds):
            make_run(
                tmp_path,
                f"{level}{seed}",
                ["experiment=headline", f"optim={level}", f"seed={seed}"],
                optim=level,
                seed=seed,
                samples_per_s=sps,
                val_loss=val_loss,
                **extra,
            )
    make_run(
        tmp_path,
        "failed0",
        ["experiment=headline", "optim=advanced", "seed=0"],
        optim="advanced",
        seed=0,
        status="failed",
        error="trainer.batch_size=1 must be >= 2",
    )
    return tmp_path


def test_speedup_interval_quality_and_verdicts(sweep):
    result = compare(find_runs([sweep]))
    rows = {r["config"]: r for r in result["rows"]}
    assert result["baseline"] == "optim=baseline" and list(rows)[0] == "optim=baseline"
    ultra = rows["optim=ultra"]
    assert ultra["seeds"] == [0, 1, 2]
    assert ultra["speedup"] == pytest.approx(55 / 11)
    assert (ultra["speedup_lo"], ultra["speedup_hi"]) == (pytest.approx(50 / 12), pytest.approx(60 / 10))
    assert ultra["peak_rss_ratio"] == pytest.approx(0.5)
    assert ultra["val_loss_delta"] == pytest.approx(0.005)
    assert ultra["train_loss_delta"] == pytest.approx(0.05) and ultra["step_time_speedup"] == pytest.approx(
        4.0
    )
    assert ultra["verdict"] == "faster at equal quality"
    basic = rows["optim=basic"]  # interval [11/12, 12.5/10] straddles 1, and val loss is 5% worse
    assert "not above 1" in basic["verdict"] and "+5.0% worse" in basic["verdict"]
    assert rows["optim=lucky"]["verdict"].startswith("faster, val loss -5.0% (better by more than 2%")
    failed = rows["optim=advanced"]
    assert failed["seeds"] == [] and "batch_size=1" in failed["verdict"]


def test_cli_writes_every_report_file(sweep, capsys):
    main([str(sweep)])
    for name in ("comparison.json", "comparison.csv", "comparison.md", "comparison.png"):
        assert (sweep / name).stat().st_size > 0
    saved = json.loads((sweep / "comparison.json").read_text())
    assert {
        "config",
        "optim",
        "seeds",
        "samples_per_s",
        "speedup",
        "speedup_lo",
        "speedup_hi",
        "peak_rss_ratio",
        "val_loss_delta",
        "verdict",
    } <= saved["rows"][0].keys()
    assert "| `optim=ultra` | 3 | 55 | 5.00x [4.17, 6.00]" in (sweep / "comparison.md").read_text()


def test_unknown_baseline_is_a_one_line_error(sweep, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--baseline", "optim=nothing"])
    assert exit_.value.code == 2
    assert "compare.baseline='optim=nothing' matches 0 configurations" in capsys.readouterr().err


def test_regression_check_fails_only_beyond_the_bound(sweep, tmp_path, capsys):
    main([str(sweep)])
    stored = sweep / "comparison.json"
    saved = json.loads(stored.read_text())
    for row in saved["rows"]:  # pretend the stored sweep was faster: ultra 11 -> 10% slower now
        if row["config"] == "optim=ultra":
            row["samples_per_s"] = 55 / 0.90
        if row["config"] == "optim=baseline":
            row["samples_per_s"] = 11 / 0.97  # 3% slower now: inside a 5% bound
    (tmp_path / "stored.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--against", str(tmp_path / "stored.json"), "--max-regression", "5%"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    assert "| `optim=ultra` | 61.1 | 55 | -10.0% | REGRESSED |" in out
    assert "| `optim=baseline` | 11.3 | 11 | -3.0% | ok |" in out
    assert "optim=ultra" in err and "optim=baseline" not in err
    main([str(sweep), "--against", str(tmp_path / "stored.json"), "--max-regression", "0.12"])  # exit 0


def test_regression_check_refuses_a_file_that_is_not_a_report(sweep, tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps({"samples_per_s": 3.0}))
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--against", str(tmp_path / "summary.json")])
    assert exit_.value.code == 2
    assert "not a comparison.json" in capsys.readouterr().err
