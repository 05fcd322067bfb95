"""aamperf/report/plots.py: the comparison figure shows every run's curves."""

import itertools
import json

from aamperf.report import compare, find_runs, group_runs
from aamperf.report.plots import plot_comparison


def write_run(root, level: str, seed: int, **more) -> None:
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
        **more,
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
    _, _, _, train_ax, val_ax, _, _ = fig.axes
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


def test_each_configuration_s_time_is_drawn_as_its_parts_medians_stacked(tmp_path):
    """summary.json duration_parts_s: each part's median over the seeds, stacked in the runs' order; a
    configuration whose runs did not record them is n/a."""
    for seed in (0, 1):
        parts = {"start": 2.0, "setup": 1.0 + seed, "auto": 0.0, "steps": 5.0 * (seed + 1)}
        write_run(tmp_path, "baseline", seed, duration_parts_s=parts)
        write_run(tmp_path, "ultra", seed, duration_parts_s={**parts, "auto": 4.0, "steps": 1.0})
        write_run(tmp_path, "advanced", seed)  # from before the parts were recorded
    write_run(tmp_path, "advanced", 2, duration_parts_s=["start", 1.0])  # a damaged record's: left out
    write_run(tmp_path, "advanced", 3, duration_parts_s={"start": "1 s"})
    runs = find_runs([tmp_path])
    result = compare(runs)
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["optim=baseline"]["duration_parts_s"] == {
        "start": 2.0,
        "setup": 1.5,
        "auto": 0.0,
        "steps": 7.5,
    }
    assert rows["optim=advanced"]["duration_parts_s"] is None
    parts_ax = plot_comparison(result, group_runs(runs), tmp_path / "figure.png").axes[-1]
    labels = [r["config"] for r in result["rows"]]
    segments = {}  # (configuration, part): (left, width)
    for bars in parts_ax.containers:
        for label, patch in zip(labels, bars.patches, strict=True):
            segments[label, bars.get_label()] = (patch.get_x(), patch.get_width())
    assert [c.get_label() for c in parts_ax.containers] == ["start", "setup", "auto", "steps"]
    assert segments["optim=ultra", "auto"] == (3.5, 4.0) and segments["optim=ultra", "steps"] == (7.5, 1.0)
    totals = {text.get_text() for text in parts_ax.texts}
    assert totals == {" 11 s", " 8.5 s", " n/a"}


def test_long_configuration_labels_do_not_run_into_each_other(tmp_path):
    """The exact-batch study's labels: five overrides each, on five lines; the figure grows to hold them."""
    overrides = [
        "trainer.batch_size=32",
        "trainer.max_steps=100",
        "trainer.warmup_steps=5",
        "trainer.val_every=6 metrics.log_every=6",
    ]
    for i, extra in enumerate(
        ["", "trainer.lr=2e-4", "trainer.grad_accum_steps=4", "trainer.grad_accum_steps=4 lr"]
    ):
        for seed in (0, 1):
            run = tmp_path / f"c{i}_{seed}"
            write_run(tmp_path, f"c{i}_", seed)
            names = overrides + extra.split() if i else ["trainer.batch_size=8"]
            (run / ".hydra" / "overrides.yaml").write_text(
                "".join(f"- {o}\n" for o in [*names, f"seed={seed}"])
            )
    runs = find_runs([tmp_path])
    fig = plot_comparison(
        compare(runs, baseline="trainer.batch_size=8"), group_runs(runs), tmp_path / "f.png"
    )
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the figure as it was saved: drawn, its text laid out
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in (fig.axes[0], fig.axes[-1]):  # a bar panel, and the time each part took
        boxes = sorted(
            (label.get_window_extent(renderer) for label in ax.get_yticklabels() if label.get_text()),
            key=lambda box: box.y0,
        )
        assert len(boxes) == 4
        assert all(low.y1 <= high.y0 for low, high in itertools.pairwise(boxes)), [b.bounds for b in boxes]
