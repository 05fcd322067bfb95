"""aamperf/report/plots.py: the comparison figure shows every run's curves."""

import json

from aamperf.report import compare, find_runs, group_runs
from aamperf.report.plots import plot_comparison


def write_run(root, level: str, seed: int) -> None:
    """A completed run of `optim=level` whose losses are every other run's: curves that coincide."""
    run = root / f"{level}{seed}"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(f"- optim={level}\n- seed={seed}\n")
    summary = {"status": "completed", "optim": level, "seed": seed, "samples_per_s": 10.0, "val_loss": 2.0}
    summary |= {
        "peak_rss_bytes": 2**30,
        "step_time_s": 1.0,
        "train_loss": 2.0,
        "config": {"data": {"seed": 0}},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    lines = [
        {"step": step, "loss": 3.0 - step / 100, "elapsed_s": step / 10, "val_loss": 2.0} for step in (10, 20)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_baselines_loss_curves_are_drawn_over_the_others_and_dashed(tmp_path):
    # the baseline's row comes first, so its lines were drawn first, and equal losses hid them under the rest
    for level in ("baseline", "ultra", "advanced"):
        for seed in (0, 1):
            write_run(tmp_path, level, seed)
    runs = find_runs([tmp_path])
    result = compare(runs)
    assert result["baseline"] == "optim=baseline"
    fig = plot_comparison(result, group_runs(runs), tmp_path / "figure.png")
    _, _, _, train_ax, val_ax, _ = fig.axes
    for ax in (train_ax, val_ax):
        curves = [
            line for line in ax.lines if line.get_linestyle() != ":"
        ]  # not the baseline's final val loss
        baseline = [line for line in curves if line.get_color() == "tab:gray"]
        others = [line for line in curves if line.get_color() != "tab:gray"]
        assert len(baseline) == 2 and len(others) == 4  # one a seed
        assert min(line.get_zorder() for line in baseline) > max(line.get_zorder() for line in others)
        assert {line.get_linestyle() for line in baseline} == {"--"}
        assert {line.get_linestyle() for line in others} == {"-"}
    handles = {line.get_color(): line.get_linestyle() for line in fig.legends[0].get_lines()}
    assert handles["tab:gray"] == "--" and len(handles) == 3  # the legend shows the baseline dashed too
