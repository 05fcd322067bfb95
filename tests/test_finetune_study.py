"""experiments/finetune/summarize.py: paired ratios to the original's frozen / unfrozen runs per seed, each
program's figures (the original's macro-F1 from its confusion matrix, scikit-learn's), the verdict, from
run directories written as run.sh, time_aam.py and aamperf write them (records of known figures)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix, f1_score, mean_absolute_error, r2_score

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments/finetune/summarize.py"
spec = importlib.util.spec_from_file_location("finetune_summarize", SCRIPT)
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


def write_run(out: Path, name: str, wall_s: float, exit_code=0, original: dict | None = None, **summary):
    run = out / "runs" / name
    run.mkdir(parents=True)
    (run / "exit_code").write_text(f"{exit_code}\n")
    (run / "clock_s").write_text(f"1000.0 {1000.0 + wall_s}\n")
    if original is not None:  # time_aam.py's record, and the original's own split file
        (run / "record.json").write_text(json.dumps(original))
        (run / "aam").mkdir()
        (run / "aam" / "val_samples.txt").write_text("".join(f"S{i}\n" for i in range(20)))
    elif summary:  # aamperf's summary.json, the fields summarize reads
        (run / "summary.json").write_text(json.dumps(summary))


def original_record(epoch_s: float, val: dict, matrix: list | None = None) -> dict:
    epochs = [epoch_s * 2, epoch_s, epoch_s]  # the first slower: the median is epoch_s
    return {
        "epoch_times_s": epochs,
        "step_times_s": [0.1] * 30,
        "val_results": [val],
        "confusion_matrix": matrix,
    }


def aamperf_summary(step_s: float, val: dict, kind: str, cached: bool = False, given: bool = False) -> dict:
    """given: validated on the original's samples (run.sh's data.val_samples)"""
    embeddings = {"applied": True, "embed_s": 4.0} if cached else {"applied": False}
    return {
        "config": {"data": {"val_samples": "/out/runs/x/aam/val_samples.txt" if given else None}},
        "step_time_median_s": step_s,
        "steps": 30,
        "val": {"val_samples": 16, **val},
        "val_loss": 1.0,
        "rf_baseline": {"val_target_r2": 0.3, "val_target_mae": 0.2},
        "finetune": {"cached_embeddings": embeddings},
        "target": {"type": kind},
    }


def test_macro_f1_is_scikit_learns_from_the_confusion_matrix():
    rng = np.random.default_rng(0)
    observed = rng.integers(0, 4, 40)
    predicted = np.where(rng.random(40) < 0.5, observed, rng.integers(0, 3, 40))  # class 3 never predicted
    matrix = confusion_matrix(observed, predicted, labels=range(4)).tolist()
    assert summarize.macro_f1(matrix) == pytest.approx(f1_score(observed, predicted, average="macro"))


def test_ratios_are_paired_by_seed_and_the_frozen_verdict_reads_every_seed(tmp_path):
    (tmp_path / "machine.txt").write_text("AMD EPYC\ncores 2; flags: avx512_bf16\ntorch 2.13.0+cpu\n")
    (tmp_path / "settings.txt").write_text("per_epoch=10 epochs=3 pretrain_epochs=1 samples=100\n")
    seeds = {"0": (20.0, 100.0, 4.0), "1": (40.0, 200.0, 20.0)}  # original epoch, end to end; ultra's
    for seed, (orig_epoch, orig_wall, ultra_wall) in seeds.items():
        write_run(tmp_path, f"target-frozen-original_seed{seed}", orig_wall,
                  original=original_record(orig_epoch, {"r2": 0.1, "mae": 0.3}))  # fmt: skip
        figures = {"val_target_r2": 0.2, "val_target_mae": 0.25}
        write_run(tmp_path, f"target-frozen-ultra-transformer_seed{seed}", ultra_wall,
                  **aamperf_summary(0.01, figures, "regression", cached=True, given=True))  # fmt: skip
    matrix = [[3, 1], [2, 2]]  # the original's: accuracy 5/8, macro-F1 of the two classes' F1
    write_run(tmp_path, "environment-unfrozen-original_seed0", 300,
              original=original_record(30.0, {"accuracy": 0.625, "f1": 0.6}, matrix))  # fmt: skip
    write_run(tmp_path, "environment-unfrozen-baseline_seed0", 0, exit_code=124)  # cut off by TIME_LIMIT_S
    result = summarize.summarize(tmp_path)
    groups = {(g["target"], g["frozen"]): g for g in result["groups"]}

    frozen = {r["program"]: r for r in groups["target", "frozen"]["rows"]}
    assert groups["target", "frozen"]["kind"] == "regression"
    assert frozen["original"]["epoch_s"] == [20.0, 40.0]  # the median training epoch
    assert frozen["ultra-transformer"]["epoch_s"] == pytest.approx(
        [0.1, 0.1]
    )  # median step x 10 steps an epoch
    assert frozen["ultra-transformer"]["epoch_speedup"] == pytest.approx(
        [200.0, 400.0]
    )  # each to its own seed's
    assert frozen["ultra-transformer"]["wall_speedup"] == pytest.approx([25.0, 10.0])
    assert frozen["ultra-transformer"]["first_vs_original"] == pytest.approx([0.1, 0.1])
    assert frozen["ultra-transformer"]["rf_first"] == [0.3, 0.3] and frozen["ultra-transformer"][
        "cached_embed_s"
    ] == [4.0, 4.0]
    assert frozen["original"]["val_samples"] == [16]  # 20 held out, the last partial batch of 8 dropped
    assert (
        frozen["ultra-transformer"]["val_split"] == ["original's"] and frozen["original"]["val_split"] == []
    )
    verdict = summarize.verdict(groups["target", "frozen"], frozen["ultra-transformer"])
    assert verdict == "< 20x end to end; R^2 >= original's (every seed)"  # seed 1: 10x

    unfrozen = {r["program"]: r for r in groups["environment", "unfrozen"]["rows"]}
    assert groups["environment", "unfrozen"]["kind"] == "classification"
    assert unfrozen["original"]["first"] == [0.625]
    assert unfrozen["original"]["second"] == pytest.approx([(6 / 9 + 4 / 7) / 2])  # not its weighted f1
    assert unfrozen["baseline"]["seeds_done"] == [] and unfrozen["baseline"]["failed"] == {"0": 124}
    assert frozen["ultra-transformer"]["heldout_r2"] == []  # none scored: no held-out verdict
    table = summarize.to_markdown(result)
    assert "Device: AMD EPYC; cores 2; flags: avx512_bf16" in table and "seed 0: exit 124" in table
    assert (
        "| target (regression) | frozen | ultra-transformer | 3 "
        "| 0.1 [0.1, 0.1] (+ 4 [4, 4] s embedding once) |" in table
    )
    assert "| 16 (original's) |" in table


@pytest.mark.parametrize(
    ("differences", "said"),
    [
        ([0.10, -0.02, 0.05, 0.08], "R^2 equal or better (mean +0.053 ["),
        ([-0.20, -0.30, -0.25], "R^2 worse (mean -0.250 ["),
        ([0.30, -0.40, 0.20], "R^2 undecided (mean +0.033 ["),
        ([0.10, -0.01], "R^2 < original's (some seed)"),  # too few seeds for an interval: each seed's sign
        ([0.10, 0.01], "R^2 >= original's (every seed)"),
    ],
)
def test_quality_is_decided_by_the_paired_interval_from_three_seeds_on(differences, said):
    assert summarize.quality(differences, "R^2").startswith(said)


def test_an_undecided_mean_near_the_margin_says_how_near_beside_the_seeds_it_would_take():
    said = summarize.quality([-0.02, -0.07, -0.045], "R^2")  # mean -0.045 against the -0.05 margin
    assert said.startswith("R^2 undecided (mean -0.045 [")
    assert "the mean +0.005 from the margin: about " in said


def write_predictions(path: Path, observed: list[float], predicted: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"T{i}\t{p!r}\t{o!r}" for i, (o, p) in enumerate(zip(observed, predicted, strict=True))]
    path.write_text("\n".join(["sample_id\tpredicted\tobserved", *rows]) + "\n")


def test_held_out_figures_are_scikit_learns_paired_by_seed_with_a_verdict_of_their_own(tmp_path):
    """score_heldout.sh's predictions (the original's heldout_predictions.tsv, aamperf's heldout/targets.tsv):
    R^2 over the held-out samples by one formula for both, paired by seed, decided as figure 1."""
    (tmp_path / "machine.txt").write_text("AMD EPYC\n")
    (tmp_path / "settings.txt").write_text("per_epoch=10 epochs=3 pretrain_epochs=1 samples=100\n")
    rng = np.random.default_rng(0)
    observed = rng.normal(size=50).tolist()
    expected, maes = {"original": [], "ultra-transformer": []}, {}
    for seed in "012":
        for program, noise in (("original", 0.6), ("ultra-transformer", 0.5)):
            name = f"target-frozen-{program}_seed{seed}"
            predicted = (np.array(observed) + rng.normal(scale=noise, size=50)).tolist()
            if program == "original":
                write_run(tmp_path, name, 100.0, original=original_record(20.0, {"r2": 0.1, "mae": 0.3}))
                write_predictions(tmp_path / "runs" / name / "heldout_predictions.tsv", observed, predicted)
            else:
                figures = {"val_target_r2": 0.1, "val_target_mae": 0.3}
                write_run(tmp_path, name, 2.0, **aamperf_summary(0.01, figures, "regression", given=True))
                write_predictions(tmp_path / "runs" / name / "heldout" / "targets.tsv", observed, predicted)
            expected[program].append(r2_score(observed, predicted))
            maes.setdefault(program, []).append(mean_absolute_error(observed, predicted))
    group = summarize.summarize(tmp_path)["groups"][0]
    rows = {r["program"]: r for r in group["rows"]}
    assert rows["original"]["heldout_r2"] == pytest.approx(expected["original"])
    ultra = rows["ultra-transformer"]
    assert ultra["heldout_samples"] == [50] and ultra["heldout_mae"] == pytest.approx(
        maes["ultra-transformer"]
    )
    assert ultra["heldout_mae_vs_original"] == pytest.approx(
        np.subtract(maes["ultra-transformer"], maes["original"])
    )
    differences = np.subtract(expected["ultra-transformer"], expected["original"])
    assert ultra["heldout_r2_vs_original"] == pytest.approx(differences.tolist())
    said = summarize.quality(differences.tolist(), "held-out R^2")
    assert (
        summarize.verdict(group, ultra)
        == f">= 20x end to end; R^2 equal or better (mean +0.000 [+0.000, +0.000], 3 seeds); {said}"
    )
    assert "(50 samples)" in summarize.to_markdown(summarize.summarize(tmp_path))
