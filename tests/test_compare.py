"""The comparison report's arithmetic, on runs with known figures."""

import datetime
import json
import math
import os
import signal
import statistics
import time

import pytest
from omegaconf import OmegaConf

from aamperf.callbacks import CompareReport
from aamperf.compare import main
from aamperf.report import compare, find_runs


def make_run(root, name, overrides, validations=(), data_seed=0, **summary):
    """A run directory as a training job leaves it; `validations`: (elapsed_s, val_loss) lines."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    defaults = {
        "status": "completed",
        "peak_rss_bytes": 2**30,
        "step_time_s": 1.0,
        "mfu": 0.1,
        "train_loss": 2.0,
        "model_flops_per_step": 1e9,
        "config": {"data": {"seed": data_seed}},
    }
    (run / "summary.json").write_text(json.dumps({**defaults, **summary}))
    lines = [{"step": 1, "loss": 2.0}] + [
        {"step": 10 * (i + 1), "loss": 2.0, "elapsed_s": t, "val_loss": v}
        for i, (t, v) in enumerate(validations)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def make_seeds(root, name: str, samples_per_s: float, config: dict, **summary) -> None:
    """Seeds 0-2 of configuration `name` (`optim=<name>`), on data seed 0, val loss 2.0; `config`: the rest of
    its summary's config."""
    for seed in range(3):
        make_run(
            root,
            f"{name}{seed}",
            [f"optim={name}", f"seed={seed}"],
            optim=name,
            seed=seed,
            samples_per_s=samples_per_s + seed * 0.1,
            val_loss=2.0,
            config={"data": {"seed": 0}, "optim": name, "seed": seed, **config},
            **summary,
        )


def make_repeats(root, name: str, speeds: tuple[float, ...], val_loss: float) -> None:
    """Seed 0 of configuration `name` run once per speed (samples/s), in that path order."""
    for repeat, speed in enumerate(speeds):
        make_run(
            root,
            f"{name}{repeat}",
            [f"optim={name}", "seed=0"],
            optim=name,
            seed=0,
            samples_per_s=speed,
            val_loss=val_loss,
            config={"data": {"seed": 0}, "optim": name, "seed": 0},
        )


BASE_VAL = (2.00, 2.02, 1.98)  # the baseline's final val loss per seed


@pytest.fixture
def sweep(tmp_path):
    # optim level -> samples/s per seed, val loss per seed, validations per seed, extra summary fields
    levels = {
        "baseline": ((10.0, 11.0, 12.0), BASE_VAL, lambda s: [(10, 2.5), (20, 2.2), (30, BASE_VAL[s])], {}),
        "ultra": (  # 5.0x, 5.2x, 4.9x; val loss +0.5%, +0.25%, +0.5%; the baseline's loss after 6 s
            (50.0, 57.2, 58.8),
            (2.01, 2.025, 1.9899),
            lambda s: [(3, 2.4), (6, BASE_VAL[s] - 0.001), (9, 2.0)],
            {
                "peak_rss_bytes": 2**29,
                "peak_device_bytes": 2**28,
                "step_time_s": 0.25,
                "train_loss": 2.1,
                "compile_time_s": 30.0,
                "recompiles": 4,
            },
        ),
        "basic": ((9.0, 12.0, 13.0), (2.0, 2.02, 1.98), lambda s: [], {}),  # 0.9x, 1.09x, 1.08x
        "worse": ((20.0, 22.0, 24.0), (2.1, 2.14, 2.06), lambda s: [(5, 2.1)], {"model_flops_per_step": 2e9}),
        "lucky": ((30.0,), (1.90,), lambda s: [], {}),
    }
    for level, (speeds, val_losses, validations, extra) in levels.items():
        for seed, (sps, val_loss) in enumerate(zip(speeds, val_losses, strict=False)):
            make_run(
                tmp_path,
                f"{level}{seed}",
                ["experiment=headline", f"optim={level}", f"seed={seed}"],
                validations=validations(seed),
                optim=level,
                seed=seed,
                samples_per_s=sps,
                val_loss=val_loss,
                auto_s=(29.0, 0.2, 0.1)[seed] if level == "ultra" else 0.0,  # seed 0's run probed the device
                **extra,
            )
    for seed in range(3):  # fast, but trained on other data: nothing to pair with
        make_run(
            tmp_path,
            f"otherdata{seed}",
            ["experiment=headline", "optim=otherdata", f"seed={seed}"],
            data_seed=1,
            optim="otherdata",
            seed=seed,
            samples_per_s=100.0,
            val_loss=2.0,
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


def test_paired_intervals_time_to_quality_and_verdicts(sweep):
    result = compare(find_runs([sweep]))
    rows = {r["config"]: r for r in result["rows"]}
    assert result["baseline"] == "optim=baseline" and list(rows)[0] == "optim=baseline"
    ultra = rows["optim=ultra"]
    assert ultra["seeds"] == ultra["paired_seeds"] == [0, 1, 2]
    assert ultra["speedup"] == pytest.approx((5.0 * 5.2 * 4.9) ** (1 / 3))  # geometric mean of seed ratios
    assert 4.9 - 1e-9 <= ultra["speedup_lo"] < ultra["speedup"] < ultra["speedup_hi"] <= 5.2 + 1e-9
    deltas = [v / b - 1 for v, b in zip((2.01, 2.025, 1.9899), BASE_VAL, strict=True)]
    assert ultra["val_loss_delta"] == pytest.approx(sum(deltas) / 3)
    assert (
        min(deltas) - 1e-12 <= ultra["val_loss_delta_lo"] < ultra["val_loss_delta_hi"] <= max(deltas) + 1e-12
    )
    assert ultra["peak_rss_ratio"] == pytest.approx(0.5)
    assert ultra["step_time_speedup"] == pytest.approx(4.0)
    # the baseline reaches its own final loss at 30 s; ultra reaches it at 6 s, for every seed
    assert ultra["time_to_quality_s"] == 6 and ultra["time_to_quality_reached"] == "3/3"
    assert ultra["time_to_quality_speedup"] == pytest.approx(5.0)
    assert rows["optim=baseline"]["time_to_quality_s"] == 30
    assert ultra["model_flops_match_baseline"] is True
    assert ultra["auto_s"] == 0.2 and ultra["auto_s_max"] == 29.0  # the median hides a first run's probes
    assert ultra["verdict"].startswith("faster at equal quality: 5.03x [")
    basic = rows["optim=basic"]  # speed-ups 0.9, 1.09, 1.08: the interval contains 1
    assert basic["verdict"].startswith("undecided: speed-up 1.02x [") and "contains 1" in basic["verdict"]
    assert basic["seeds_needed"] > 3 and f"({basic['seeds_needed'] - 3} more)" in basic["verdict"]
    assert basic["time_to_quality_reached"] == "0/3" and basic["time_to_quality_speedup"] is None
    worse = rows["optim=worse"]  # +5%, +5.9%, +4.0%
    assert worse["verdict"].startswith("worse: val loss +5.0% [") and worse["seeds_needed"] is None
    assert worse["model_flops_match_baseline"] is False
    lucky = rows["optim=lucky"]
    assert lucky["verdict"].startswith("undecided: 1 seed(s) paired") and lucky["seeds_needed"] == 3
    other = rows["optim=otherdata"]  # 10x faster, but on other data: no pair, no verdict
    assert other["paired_seeds"] == [] and other["speedup"] is None
    assert other["verdict"].startswith("undecided: 0 seed(s) paired")
    failed = rows["optim=advanced"]
    assert failed["seeds"] == [] and "batch_size=1" in failed["verdict"]


def test_unpaired_seeds_are_left_out(sweep):
    """A seed the baseline lacks counts nowhere: the interval is over pairs only."""
    for name in ("baseline1", "baseline2"):
        (sweep / name / "summary.json").unlink()
    rows = {r["config"]: r for r in compare(find_runs([sweep]))["rows"]}
    assert rows["optim=ultra"]["paired_seeds"] == [0] and rows["optim=ultra"]["speedup"] == pytest.approx(5.0)
    assert rows["optim=ultra"]["verdict"].startswith("undecided: 1 seed(s) paired")


def test_runs_validated_on_other_samples_do_not_pair(sweep):
    """data.val_samples names the validation samples: runs of another list are not on the same split."""
    for seed in (1, 2):
        summary = sweep / f"ultra{seed}" / "summary.json"
        record = json.loads(summary.read_text())
        record["config"]["data"]["val_samples"] = f"/data/split{seed}.txt"
        summary.write_text(json.dumps(record))
    rows = {r["config"]: r for r in compare(find_runs([sweep]))["rows"]}
    assert rows["optim=ultra"]["paired_seeds"] == [0]


def test_more_seeds_decide_what_few_could_not(tmp_path):
    """The 'seeds needed' estimate is a promise a test can check: give the undecided configuration
    that many seeds drawn like the first three and the verdict is decided."""
    import numpy as np

    rng = np.random.default_rng(1)  # speed-ups around 1.04x with a 6% spread, the first three given
    ratios = np.concatenate([[1.10, 0.98, 1.04], 1.04 * np.exp(rng.normal(0, 0.06, 37))])

    def write(n):
        root = tmp_path / f"n{n}"
        for seed in range(n):
            for level, sps in (("baseline", 10.0), ("basic", 10.0 * ratios[seed])):
                make_run(
                    root,
                    f"{level}{seed}",
                    [f"optim={level}", f"seed={seed}"],
                    optim=level,
                    seed=seed,
                    samples_per_s=sps,
                    val_loss=2.0,
                )
        return {r["config"]: r for r in compare(find_runs([root]))["rows"]}["optim=basic"]

    first = write(3)
    assert first["verdict"].startswith("undecided") and first["seeds_needed"] > 3
    decided = write(min(40, 2 * first["seeds_needed"]))
    assert decided["verdict"].startswith("faster at equal quality")


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
        "peak_device_bytes",
    } <= saved["rows"][0].keys()
    device_bytes = {row["config"]: row["peak_device_bytes"] for row in saved["rows"]}
    assert device_bytes["optim=ultra"] == 2**28 and device_bytes["optim=baseline"] is None  # no CUDA peak
    table = (sweep / "comparison.md").read_text()
    assert "| `optim=ultra` | 3 (3) | 57.2 | 5.03x [" in table
    assert "| 6.0 (3/3) 5.00x [5.00, 5.00] |" in table  # time to quality and its speed-up
    assert "| 0.2 (29.0) |" in table and "| 0.0 (0.0) |" in table  # auto s: median (max)
    assert "| 30.0 (4) |" in table and "| n/a (n/a) |" in table  # compile s (recompiles); none recorded


def test_the_report_goes_to_an_out_directory_that_does_not_exist_yet(sweep, tmp_path):
    out = tmp_path / "reports" / "today"
    main([str(sweep), "--out", str(out)])
    assert (out / "comparison.md").is_file() and (out / "comparison.png").stat().st_size > 0


def test_the_figure_shows_one_point_runs_and_keeps_its_labels_and_legend_clear(sweep, tmp_path):
    from aamperf.report import compare, find_runs, group_runs
    from aamperf.report.plots import plot_comparison

    runs = find_runs([sweep])
    result = compare(runs)
    fig = plot_comparison(result, group_runs(runs), tmp_path / "figure.png")
    speed_ax, _, memory_ax, train_ax, val_ax, _, _ = fig.axes
    # a run that logged one training point is drawn as a point, not an invisible line
    assert train_ax.lines and all(line.get_marker() == "o" for line in train_ax.lines)
    # no legend inside a panel: one below them all, whatever the number of configurations
    assert all(ax.get_legend() is None for ax in (train_ax, val_ax, memory_ax)) and len(fig.legends) == 1
    # each value label starts past the end of its whisker
    whisker_ends = [seg[:, 0].max() for seg in speed_ax.collections[0].get_segments()]
    label_x = [text.get_position()[0] for text in speed_ax.texts]
    assert label_x and all(x >= end - 1e-9 for x, end in zip(label_x, whisker_ends, strict=True))


def test_unknown_baseline_is_a_one_line_error(sweep, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--baseline", "optim=nothing"])
    assert exit_.value.code == 2
    assert "compare.baseline='optim=nothing' matches 0 configurations" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option", [["--quality-tolerance", "-1"], ["--quality-tolerance", "inf"], ["--max-regression", "nan"]]
)
def test_a_fraction_that_is_negative_or_not_finite_is_refused(sweep, tmp_path, capsys, option):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--out", str(out), *option])
    assert exit_.value.code == 2
    assert f"{option[1]!r} is not a fraction >= 0 like 5% or 0.05" in capsys.readouterr().err
    assert not out.exists()


def test_a_confidence_out_of_range_writes_nothing(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--out", str(out), "--confidence", "2"])
    assert exit_.value.code == 2 and "--confidence 2.0 is not between 0 and 1" in capsys.readouterr().err
    assert not out.exists()  # refused before --out was made


def test_regression_check_fails_only_beyond_the_bound(sweep, tmp_path, capsys):
    main([str(sweep)])
    stored = sweep / "comparison.json"
    saved = json.loads(stored.read_text())
    for row in saved["rows"]:  # pretend the stored sweep was faster: ultra 11 -> 10% slower now
        if row["config"] == "optim=ultra":
            row["samples_per_s"] = 57.2 / 0.90
        if row["config"] == "optim=baseline":
            row["samples_per_s"] = 11 / 0.97  # 3% slower now: inside a 5% bound
    (tmp_path / "stored.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--against", str(tmp_path / "stored.json"), "--max-regression", "5%"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    assert "| `optim=ultra` | 63.6 | 57.2 | -10.0% | REGRESSED |" in out
    assert "| `optim=baseline` | 11.3 | 11 | -3.0% | ok |" in out
    assert "optim=ultra" in err and "optim=baseline" not in err
    main([str(sweep), "--against", str(tmp_path / "stored.json"), "--max-regression", "0.12"])  # exit 0


def test_regression_check_refuses_a_file_that_is_not_a_report(sweep, tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps({"samples_per_s": 3.0}))
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--against", str(tmp_path / "summary.json")])
    assert exit_.value.code == 2
    assert "not a comparison.json" in capsys.readouterr().err


def test_a_config_whose_phases_applied_the_baselines_choices_is_called_the_same_training(tmp_path):
    """ultra whose compile=auto chose eager is advanced: its 1.1x is the machine's, not the config's.
    A different learning rate, or another dtype chosen, is another training, whatever the phases say."""
    phases = {
        "precision": {"status": "applied", "dtype": "bf16", "auto": {"chose": "bf16", "reason": "4.7x"}},
        "compile": {"status": "skipped", "reason": "compile=disabled"},
    }
    eager = {"status": "skipped", "reason": "compile=auto: cannot pay", "compile_time_s": 0.3, "auto": {}}
    configs = {
        "advanced": (phases, {"compile": {"mode": "disabled"}, "trainer": {"lr": 1e-4}}),
        "ultra": ({**phases, "compile": eager}, {"compile": {"mode": "auto"}, "trainer": {"lr": 1e-4}}),
        "ultra_lr": ({**phases, "compile": eager}, {"compile": {"mode": "auto"}, "trainer": {"lr": 1e-3}}),
        "fp32": (
            {**phases, "precision": {"status": "skipped", "dtype": "fp32"}},
            {"compile": {"mode": "disabled"}, "trainer": {"lr": 1e-4}},
        ),
    }
    for name, (run_phases, config) in configs.items():
        make_seeds(tmp_path, name, 10.0 if name == "advanced" else 11.0, config, phases=run_phases)
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=advanced")["rows"]}
    assert rows["optim=ultra"]["same_training"]
    assert rows["optim=ultra"]["verdict"].startswith("the same training as the baseline")
    assert "1.10x" in rows["optim=ultra"]["verdict"]
    for other in ("optim=ultra_lr", "optim=fp32"):
        assert not rows[other]["same_training"]
        assert rows[other]["verdict"].startswith("faster at equal quality")


def test_two_configurations_that_trained_the_same_way_are_named_as_such(tmp_path):
    """An ablation's `ultra compile=disabled` where ultra's compile=auto chose eager trains as ultra: the
    report says so, with their speed ratio (the machine's), and names no pair that trained otherwise."""
    eager = {"status": "skipped", "reason": "compile=disabled"}
    declined = {"status": "skipped", "reason": "compile=auto: cannot pay", "auto": {}}
    bf16, fp32 = {"status": "applied", "dtype": "bf16"}, {"status": "skipped", "dtype": "fp32"}
    configs = {
        "baseline": (10.0, {"precision": fp32, "compile": eager}, "disabled"),
        "ultra": (20.0, {"precision": bf16, "compile": declined}, "auto"),
        "ultra_eager": (19.0, {"precision": bf16, "compile": eager}, "disabled"),
        "ultra_fp32": (15.0, {"precision": fp32, "compile": declined}, "auto"),
    }
    for name, (speed, phases, mode) in configs.items():
        make_seeds(tmp_path, name, speed, {"compile": {"mode": mode}}, phases=phases)
    result = compare(find_runs([tmp_path]))
    (found,) = result["same_trainings"]
    assert sorted(found["configs"]) == ["optim=ultra", "optim=ultra_eager"] and found["seeds"] == 3
    first = 20.0 if found["configs"][0] == "optim=ultra" else 19.0
    second = 39.0 - first
    expected = math.exp(statistics.fmean(math.log((first + s / 10) / (second + s / 10)) for s in range(3)))
    assert found["speed_ratio"] == pytest.approx(expected)
    main([str(tmp_path), "--out", str(tmp_path / "report")])
    text = (tmp_path / "report" / "comparison.md").read_text()
    assert f"`{found['configs'][0]}` as `{found['configs'][1]}` ({expected:.2f}x its samples/s" in text
    assert "optim=ultra_fp32` as" not in text and "as `optim=ultra_fp32`" not in text


def test_runs_validated_in_batches_of_another_size_get_no_quality_verdict(tmp_path):
    """The UniFrac part of a val loss is over the pairs inside a batch: batch 32 validated in batches of 32
    does not compare with batch 8's (the fix: trainer.val_batch_size); without a UniFrac part it does."""
    configs = {  # name: (the run's val batch, its loss config)
        "b8": (8, {}),
        "b32": (32, {}),
        "b32_val8": (8, {}),
        "b32_nounifrac": (32, {"unifrac_weight": 0.0}),
    }
    for name, (val_batch, loss) in configs.items():
        make_seeds(tmp_path, name, 10.0 if name == "b8" else 20.0, {"loss": loss}, val_batch_size=val_batch)
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=b8")["rows"]}
    assert rows["optim=b32"]["val_batches_differ"] == [(32, 8)]
    assert rows["optim=b32"]["verdict"].startswith(
        "undecided: validated in batches of 32 against the baseline's 8"
    )
    assert rows["optim=b32"]["verdict"].endswith("run both with trainer.val_batch_size=8")
    for same in ("optim=b32_val8", "optim=b32_nounifrac"):
        assert not rows[same]["val_batches_differ"]
        assert rows[same]["verdict"].startswith("faster at equal quality"), rows[same]["verdict"]


def test_a_run_validated_over_other_passes_than_its_baseline_is_undecided(tmp_path):
    """trainer.val_passes: a val loss over 3 draws of each sample is not one over draw 0 alone."""
    for name, passes in {"one": 1, "three": 3, "three_too": 3}.items():
        trainer = {} if name == "one" else {"trainer": {"val_passes": passes}}  # "one": before the key
        make_seeds(tmp_path, name, 10.0 if name == "one" else 20.0, trainer)
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=one")["rows"]}
    assert rows["optim=three"]["val_passes_differ"] == [(3, 1)]
    assert rows["optim=three"]["verdict"] == (
        "undecided: validated over 3 passes against the baseline's 1, so the val losses are of other draws; "
        "run both with trainer.val_passes=1"
    )
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=three")["rows"]}
    assert not rows["optim=three_too"]["val_passes_differ"]


def test_runs_from_before_the_val_batch_was_recorded_are_judged_by_their_micro_batch(tmp_path):
    """Their validation batches were their training micro-batches: at most the validation set, a multiple
    of the ranks; where nothing says, nothing is claimed."""
    trainer = {  # name: (its config's trainer node, its summary's other fields)
        "b8": ({"batch_size": 8}, {}),
        "b32_in_4": ({"batch_size": 32, "grad_accum_steps": 4}, {}),  # micro-batches of 8: as batch 8's
        "b32": ({"batch_size": 32}, {}),
        "b16_few_val": ({"batch_size": 16}, {"n_val": 8}),  # one batch of the 8 validation samples
        "auto": ({"batch_size": "auto"}, {"batch_finder": {"micro_batch": 24}}),
        "unknown": ({"batch_size": "auto"}, {}),  # a finder's record missing: not judged
    }
    for name, (node, more) in trainer.items():
        make_seeds(tmp_path, name, 10.0 if name == "b8" else 20.0, {"trainer": node}, **{"n_val": 51, **more})
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=b8")["rows"]}
    differ = {name: rows[f"optim={name}"]["val_batches_differ"] for name in trainer}
    assert differ == {
        "b8": [],
        "b32_in_4": [],
        "b32": [(32, 8)],
        "b16_few_val": [],
        "auto": [(24, 8)],
        "unknown": [],
    }


def test_the_report_names_the_machine_and_warns_when_runs_come_from_two(tmp_path):
    from aamperf.report import to_markdown

    where = {"a": "hostA: AMD EPYC (avx512f), 2 cores", "b": "hostB: Intel Xeon (amx_bf16), 2 cores"}

    def runs(root, machines):
        for seed, machine in enumerate(machines):
            for level, speed in (("baseline", 10.0), ("ultra", 50.0)):
                options = [f"optim={level}", f"seed={seed}"]
                make_run(root, f"{level}{seed}", options, optim=level, seed=seed, samples_per_s=speed,
                         val_loss=2.0, machine=machine)  # fmt: skip

    runs(tmp_path / "one", [where["a"]] * 3)
    report = to_markdown(compare(find_runs([tmp_path / "one"])))
    assert f"Measured on {where['a']}." in report and "machines**" not in report
    runs(tmp_path / "two", [where["a"], where["b"], where["b"]])
    report = to_markdown(compare(find_runs([tmp_path / "two"])))
    assert f"**Runs from 2 machines** ({where['a']}: 2 runs; {where['b']}: 4 runs)" in report
    assert "Measured on" not in report
    runs(tmp_path / "before", [None] * 3)  # runs from before summary.json named the machine
    report = to_markdown(compare(find_runs([tmp_path / "before"])))
    assert "Measured on" not in report and "machines**" not in report


def test_runs_that_shared_a_machines_time_are_named_and_their_verdicts_left_undecided(tmp_path):
    from aamperf.report import group_runs, to_markdown
    from aamperf.report.plots import plot_comparison

    def runs(root, host_of, start_of, cores_of=lambda level: [0, 1]):
        """baseline and ultra for seeds 0-2, ultra 5x faster at the same loss; each run 100 s long"""
        for seed in range(3):
            for level, speed in (("baseline", 10.0), ("ultra", 50.0)):
                start = start_of(level, seed)
                ended = datetime.datetime.fromtimestamp(start + 100, datetime.UTC).isoformat()
                make_run(root, f"{level}{seed}", [f"optim={level}", f"seed={seed}"], optim=level, seed=seed,
                         samples_per_s=speed, val_loss=2.0, host=host_of(level), duration_s=100.0,
                         ended_at=ended, loop_load={"core_ids": cores_of(level)})  # fmt: skip
        return compare(find_runs([root]))

    one_after_another = runs(
        tmp_path / "basic",
        lambda level: "vm",
        lambda level, seed: 1e9 + 200 * seed + 100.5 * (level == "ultra"),
    )
    # each run starts 0.5 s after the one before ends, or ends 0.5 s into the next: clock round-off
    assert one_after_another["overlaps"] == []
    assert one_after_another["rows"][1]["verdict"].startswith("faster at equal quality: 5.00x")
    at_once = runs(
        tmp_path / "local", lambda level: "vm", lambda level, seed: 1e9 + 200 * seed + 30 * (level == "ultra")
    )
    ultra = at_once["rows"][1]
    assert [o["shared_s"] for o in at_once["overlaps"]] == [pytest.approx(70.0)] * 3
    assert ultra["overlapped_pairs"] == 3 and ultra["verdict"].startswith(
        "undecided: 3 of 3 pairs ran at the same time"
    )
    warning = "**6 runs ran at the same time as another run on one machine** (e.g. `baseline0` and `ultra0`"
    assert f"{warning} shared 70 s on vm)" in to_markdown(at_once)
    figure = plot_comparison(at_once, group_runs(find_runs([tmp_path / "local"])), tmp_path / "figure.png")
    assert "6 runs ran at the same time as another run" in figure.get_suptitle()
    two_hosts = runs(tmp_path / "slurm", lambda level: f"node-{level}", lambda level, seed: 1e9 + 200 * seed)
    assert two_hosts["overlaps"] == [] and two_hosts["rows"][1]["verdict"].startswith(
        "faster at equal quality"
    )
    # one node, at the same time, each job on cores of its own (Slurm packing jobs with their cpusets)
    own_cores = runs(
        tmp_path / "packed",
        lambda level: "node",
        lambda level, seed: 1e9 + 200 * seed,
        lambda level: [0, 1] if level == "baseline" else [2, 3],
    )
    assert own_cores["overlaps"] == [] and own_cores["rows"][1]["verdict"].startswith(
        "faster at equal quality"
    )


def test_runs_timed_while_other_processes_used_their_cores_are_named(tmp_path):
    from aamperf.report import to_markdown

    busy = "other processes used 0.73 of its 2 cores beside its own 1.24"
    for level, under_load in (("baseline", None), ("ultra", busy)):
        make_run(tmp_path, level, [f"optim={level}", "seed=0"], optim=level, seed=0, samples_per_s=10.0,
                 val_loss=2.0, loop_load={"under_load": under_load})  # fmt: skip
    result = compare(find_runs([tmp_path]))
    assert result["under_load"] == [{"run": str(tmp_path / "ultra"), "reason": busy}]
    assert f"**Runs timed while other processes used their cores: 1** (e.g. `ultra`: {busy})" in to_markdown(
        result
    )


def test_runs_that_stopped_early_are_named_with_their_steps(tmp_path):
    from aamperf.report import to_markdown

    best = {"monitor": "val_loss", "mode": "min", "step": 20, "value": 2.0, "stopped_early_at": 40}
    for level, stopped in (("baseline", None), ("ultra", best)):
        make_run(tmp_path, level, [f"optim={level}", "seed=0"], optim=level, seed=0, samples_per_s=10.0,
                 val_loss=2.0, best=stopped)  # fmt: skip
    result = compare(find_runs([tmp_path]))
    stops = [r["stopped_early"] for r in result["rows"]]
    assert stops == [None, "seed 0 at step 40 (best val_loss at step 20)"]
    assert (
        "Stopped early (trainer.patience), before trainer.max_steps: `optim=ultra`: seed 0 at step 40 (best "
        "val_loss at step 20)." in to_markdown(result)
    )


def test_a_stop_signal_ends_the_report_in_one_line(sweep, monkeypatch, capsys):
    def interrupted_report(*args, **kwargs):  # a report long enough to be stopped (W&B's, a big sweep)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5.0)
        raise AssertionError("the signal did not stop it")

    monkeypatch.setattr("aamperf.compare.make_report", interrupted_report)
    before = signal.getsignal(signal.SIGINT)  # pytest's, or SIG_IGN in a background job (CI)
    with pytest.raises(SystemExit) as stopped:
        main([str(sweep)])
    assert stopped.value.code == 130
    left = "stopped before the whole report was written (each file is whole or absent): run it again"
    assert capsys.readouterr().err == f"interrupted: SIGINT received; {left}\n"
    assert signal.getsignal(signal.SIGINT) is before  # given back


def test_a_sweep_whose_report_cannot_be_written_fails_in_one_line_and_keeps_its_runs(sweep, capsys):
    """Hydra turns an exception of a callback into a warning and exits 0: a sweep without its report
    looked like one that had it. Here the report cannot be written (a directory where comparison.md goes)."""
    (sweep / "comparison.md").mkdir()
    before = {path: path.read_bytes() for path in sweep.rglob("*") if path.is_file()}
    config = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep)}},
            "compare": {"baseline": "optim=baseline", "quality_tolerance": 0.02, "confidence": 0.95},
            "logger": {"backend": "none"},
        }
    )
    with pytest.raises(SystemExit) as failed:
        CompareReport().on_multirun_end(config)
    assert failed.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: the comparison report failed (IsADirectoryError: ")
    assert last.endswith(f"the runs are kept: python -m aamperf.compare {sweep}")
    assert all(path.read_bytes() == content for path, content in before.items())  # nothing lost


def test_a_summary_that_is_not_json_is_a_one_line_error_naming_it(sweep, capsys):
    damaged = sweep / "ultra0" / "summary.json"
    damaged.write_text('{"status": "completed", "samples_per')  # cut short
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {damaged} is not a run's summary")
    assert not (sweep / "comparison.json").exists()


def test_a_predictions_directory_is_not_a_row_of_the_report(sweep, capsys):
    main([str(sweep)])
    before = json.loads((sweep / "comparison.json").read_text())["rows"]
    predicted = sweep / "predictions"  # python -m aamperf.predict's output, inside the compared directory
    predicted.mkdir()
    prediction = {"status": "completed", "run": "x", "inference": "fast"}
    (predicted / "summary.json").write_text(json.dumps(prediction))
    capsys.readouterr()
    main([str(sweep)])
    assert f"note: {predicted} holds predictions" in capsys.readouterr().err
    after = json.loads((sweep / "comparison.json").read_text())["rows"]
    rows = [[(row["config"], row["seeds"]) for row in report] for report in (before, after)]
    assert rows[0] == rows[1]


def test_a_lone_configuration_is_its_own_baseline(tmp_path):
    """A sweep of seeds of one level (-m optim=ultra seed=0,1) reports its figures: nothing to compare."""
    for seed in (0, 1):
        make_run(tmp_path, f"ultra{seed}", ["optim=ultra", f"seed={seed}"], optim="ultra", seed=seed,
                 samples_per_s=50.0 + seed, val_loss=2.0)  # fmt: skip
    main([str(tmp_path)])
    report = json.loads((tmp_path / "comparison.json").read_text())
    assert [(row["config"], row["seeds"]) for row in report["rows"]] == [("optim=ultra", [0, 1])]


def test_a_run_on_several_ranks_counts_the_memory_of_them_all(tmp_path):
    """Each rank is a process tree of its own: two ranks of 1.5 GiB each hold 3 GiB of the host, not the
    first rank's 1.5 (the scaling study's 2-rank rows once read 0.71x the one process's memory)."""
    gib = 2**30
    make_seeds(tmp_path, "one", 10.0, {}, peak_tree_pss_bytes=2 * gib)
    per_rank = [{"rank": 0, "peak_tree_pss_bytes": 1.5 * gib}, {"rank": 1, "peak_tree_pss_bytes": 1.5 * gib}]
    make_seeds(
        tmp_path, "two", 15.0, {}, peak_tree_pss_bytes=1.5 * gib, peak_tree_pss_bytes_all_ranks=3 * gib,
        world_size=2, per_rank=per_rank,
    )  # fmt: skip
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=one")["rows"]}
    assert rows["optim=two"]["peak_memory_bytes"] == 3 * gib
    assert rows["optim=two"]["peak_rss_ratio"] == pytest.approx(1.5)
    assert rows["optim=one"]["peak_memory_bytes"] == 2 * gib


def test_a_seed_run_more_than_once_pairs_once(tmp_path):
    """A search's trial that Optuna repeats three times, all seed 0: one pair, not three seeds (it once read
    "3 (3)" seeds and "faster at equal quality" over three repeats of one seed, val loss [-1.06, -1.06])."""
    make_seeds(tmp_path, "base", 10.0, {})
    make_repeats(tmp_path, "again", (40.0, 44.0, 48.0), val_loss=1.9)
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=base")["rows"]}
    row = rows["optim=again"]
    assert row["seeds"] == [0, 0, 0] and row["paired_seeds"] == [0]
    assert row["verdict"].startswith("undecided: 1 seed(s) paired"), row["verdict"]


def test_an_override_of_the_value_every_run_has_sets_no_run_apart(tmp_path):
    """The search's reference is given trainer.val_batch_size=8, which its trials take from
    hparams_search=fastest: both validate in batches of 8, and the report labels the reference
    optim=baseline, not 'trainer.val_batch_size=8 optim=baseline'. Beside a run of another value it labels."""
    for name, overrides, val_batch in (
        ("ref", ["trainer.val_batch_size=8", "optim=baseline"], 8),
        ("trial", ["optim=trial"], 8),
        ("other", ["optim=other", "trainer.val_batch_size=4"], 4),
    ):
        for seed in range(3):
            make_run(
                tmp_path, f"{name}{seed}", [*overrides, f"seed={seed}"], optim=name, seed=seed,
                samples_per_s=10.0, val_loss=2.0,
                config={"data": {"seed": 0}, "seed": seed, "trainer": {"val_batch_size": val_batch}},
            )  # fmt: skip
    runs = find_runs([tmp_path])
    search = [r for r in runs if r.summary["optim"] != "other"]
    configs = {r["config"] for r in compare(search, baseline="optim=baseline")["rows"]}
    assert configs == {"optim=baseline", "optim=trial"}
    configs = {r["config"] for r in compare(runs, baseline="optim=baseline")["rows"]}
    assert configs == {
        "trainer.val_batch_size=8 optim=baseline",
        "optim=trial",
        "optim=other trainer.val_batch_size=4",
    }


def test_a_seed_run_more_than_once_pairs_by_its_median_run(tmp_path):
    """Repeats of one seed on both sides pair by their median samples/s, not by which path sorts first."""
    make_repeats(tmp_path, "base", (10.0, 30.0, 20.0), val_loss=2.0)
    make_repeats(tmp_path, "again", (40.0, 48.0, 44.0), val_loss=1.9)
    rows = {r["config"]: r for r in compare(find_runs([tmp_path]), baseline="optim=base")["rows"]}
    assert rows["optim=again"]["paired_seeds"] == [0]
    assert rows["optim=again"]["speedup"] == pytest.approx(44.0 / 20.0)
