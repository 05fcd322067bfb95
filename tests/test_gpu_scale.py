"""experiments/gpu_scale/summarize.py: paired ratios, end to end only over the same samples, MFU, from
run directories written as run.sh and the two programs write them (records of known figures)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments/gpu_scale/summarize.py"
spec = importlib.util.spec_from_file_location("gpu_scale_summarize", SCRIPT)
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


def write_run(out: Path, name: str, wall_s: float, exit_code: int = 0, **record) -> None:
    run = out / "runs" / name
    run.mkdir(parents=True)
    (run / "exit_code").write_text(f"{exit_code}\n")
    (run / "clock_s").write_text(f"1000.0 {1000.0 + wall_s}\n")
    if "step_times_s" in record:  # the original, as time_original.py writes it
        steps = {"batch_size": [8], "peak_device_bytes": 4 * 2**30, **record}
        (run / "steps.json").write_text(json.dumps(steps))
    elif record:  # aamperf's summary.json, the fields summarize reads
        (run / "summary.json").write_text(json.dumps(record))


def aamperf_summary(step_s: float, batch: int = 8, auto: bool = False, steps: int = 10) -> dict:
    summary = {
        "steps": steps,
        "step_time_median_s": step_s,
        "peak_device_bytes": 2**30,
        "setup_peak_device_bytes": 3 * 2**30,  # the probes'
        "train_loss": 2.0,
        "val_loss": 2.1,
        "model_flops_per_step": 8e12 * batch / 8,  # 1e12 per sample
        "hardware_flops_per_step": 4e12 * batch / 8,  # each distinct ASV once: half
        "peak_flops": 989.5e12,
        "gpu_util_percent": 40.0,
        "auto_s": 5.0,
        "config": {"trainer": {"batch_size": "auto" if auto else batch}},
    }
    return {**summary, "batch_finder": {"batch_size": batch}} if auto else summary


def original(step_s: float) -> dict:
    losses = [{"total": 2.5, "unifrac": 0.5, "nuc": 2.0}, {"total": 2.3, "unifrac": 0.4, "nuc": 1.9}]
    return {"step_times_s": [9.0, 9.0, 9.0] + [step_s] * 7, "losses": losses, "val_losses": [2.4, 2.2]}


def test_ratios_are_paired_by_seed_and_end_to_end_needs_the_same_samples(tmp_path):
    machine = "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\ntorch 2.11.0 CUDA 13.0\n"
    (tmp_path / "machine.txt").write_text(machine)
    write_run(tmp_path, "original-fastest_seed0", 100, **original(0.100))
    write_run(tmp_path, "original-fastest_seed1", 200, **original(0.200))
    peak = {  # a memory snapshot's (metrics.memory_snapshot): its run's table names what held the peak
        "peak_bytes": 3 * 2**30,
        "held_from_before_bytes": 2**30,
        "sources": [{"where": "model/layers.py:95 forward", "bytes": 2**31, "blocks": 40}],
        "other_sources_bytes": 0,
    }
    snapshot = {"profile": {"memory_snapshot": {"file": "memory_snapshot.pickle", "peak": peak}}}
    write_run(tmp_path, "ultra_seed0", 50, **aamperf_summary(0.025), **snapshot)  # 4x its seed's original
    parts = {"start": 3.0, "setup": 9.0, "auto": 5.0, "data": 2.0, "steps": 19.0, "end": 1.0}
    # 2x its seed's original; 39 of its 40 s from launch to exit in its parts (the rest: its exit)
    write_run(tmp_path, "ultra_seed1", 40, **aamperf_summary(0.100), duration_parts_s=parts)
    write_run(tmp_path, "ultra-auto_seed0", 60, **aamperf_summary(0.2, batch=64, auto=True))
    write_run(tmp_path, "advanced_seed0", 0, exit_code=124)  # cut off by TIME_LIMIT_S
    write_run(tmp_path, "ultra-unlisted_seed0", 50, **aamperf_summary(0.025))  # a name not in ORDER
    rows = {r["config"]: r for r in summarize.summarize(tmp_path)["rows"]}
    assert list(rows)[-1] == "ultra-unlisted" and rows["ultra-unlisted"]["speedup"] == pytest.approx([4.0])

    assert rows["original-fastest"]["step_s"] == [0.1, 0.2]  # the first 3 steps (compile) left out
    assert rows["ultra"]["speedup"] == pytest.approx([4.0, 2.0])  # not 0.1 / 0.1 across seeds
    assert rows["ultra"]["wall_speedup"] == pytest.approx([2.0, 5.0])
    auto = rows["ultra-auto"]
    assert auto["batch"] == [64] and auto["samples_per_s"] == pytest.approx([320.0])
    assert auto["speedup"] == pytest.approx([4.0]) and auto["wall_speedup"] == []  # other samples
    # 1e12 FLOPs per sample x 320 samples/s over the H100 SXM's dense bf16 989.5 TFLOP/s
    assert auto["mfu"] == pytest.approx([320e12 / 989.5e12])
    fastest = rows["original-fastest"]
    assert fastest["mfu"] == pytest.approx([80e12 / 989.5e12, 40e12 / 989.5e12])  # aamperf's FLOPs count
    # HFU: what the run executed per sample (half the model's math here), the original's unknown
    assert auto["hfu"] == pytest.approx([160e12 / 989.5e12]) and fastest["hfu"] == []
    assert rows["ultra"]["gpu_busy_percent"] == [40.0, 40.0] and rows["ultra"]["probes_s"] == [5.0, 5.0]
    assert (
        rows["ultra"]["probes_peak_bytes"] == [3 * 2**30] * 2
        and rows["ultra"]["peak_device_bytes"] == [2**30] * 2
    )
    assert fastest["gpu_busy_percent"] == [] and fastest["probes_s"] == []  # aamperf's records alone
    assert fastest["val_loss"] == [2.2, 2.2] and fastest["train_loss"] == [2.3, 2.3]  # the last epoch, step
    assert rows["advanced"]["seeds_done"] == [] and rows["advanced"]["failed"] == {"0": 124}
    table = summarize.to_markdown(summarize.summarize(tmp_path))
    assert "| ultra | 8 | 10 | 62.5 [25.0, 100.0] |" in table and "seed 0: exit 124" in table
    assert "**ultra seed 0: what its recorded steps held at their peak** (metrics.memory_snapshot, 3" in table
    assert "| model/layers.py:95 forward | 2.000 | 40 |" in table and "ultra seed 1: what" not in table
    # the parts of a run that wrote them (ultra seed 0's summary has none: written before d1fa24d)
    assert "| run | end to end | start | setup | auto | data | steps | end |" in table
    assert "| ultra seed 1 | 40.0 | 3.0 | 9.0 | 5.0 | 2.0 | 19.0 | 1.0 |" in table
    assert "| ultra seed 0 |" not in table


def test_each_change_is_paired_with_ultra_of_its_own_seed(tmp_path):
    """The one-change rows (ultra-graphs, ultra-residual, ...) against ultra of the same seed: a seed
    without ultra, or where the change did not finish, is left out, never paired across seeds."""
    (tmp_path / "machine.txt").write_text("NVIDIA H200, 143771 MiB, 580.159.04\ntorch 2.11.0 CUDA 13.0\n")
    write_run(tmp_path, "ultra_seed0", 50, **aamperf_summary(0.050))
    write_run(tmp_path, "ultra_seed1", 40, **{**aamperf_summary(0.040), "peak_device_bytes": 2**31})
    write_run(tmp_path, "ultra-graphs_seed0", 100, **{**aamperf_summary(0.040), "peak_device_bytes": 2**29})
    write_run(tmp_path, "ultra-graphs_seed1", 0, exit_code=124)  # cut off: no pair
    write_run(tmp_path, "ultra-residual_seed2", 30, **aamperf_summary(0.010))  # no ultra of seed 2
    write_run(tmp_path, "ultra-big_seed1", 40, **aamperf_summary(0.120, batch=48))
    result = summarize.summarize(tmp_path)
    found = {c["config"]: c for c in result["against_ultra"]}
    assert list(found) == ["ultra-graphs", "ultra-big"]
    graphs, big = found["ultra-graphs"], found["ultra-big"]
    assert graphs["seeds"] == ["0"] and graphs["samples_per_s_x"] == pytest.approx([1.25])
    assert graphs["peak_x"] == pytest.approx([0.5]) and graphs["wall_x"] == pytest.approx([2.0])
    # batch 48 in 120 ms against seed 1's batch 8 in 40 ms: 400 / 200 samples/s; 1 GiB against 2
    assert big["samples_per_s_x"] == pytest.approx([2.0]) and big["peak_x"] == pytest.approx([0.5])
    table = summarize.to_markdown(result)
    row = "| ultra-graphs | 8 | 0 | 40.0 | 1.25x | 0.50x | 2.00x | 40 | 2.000 / 2.100 (2.000 / 2.100) |"
    assert row in table
    assert "| ultra-big | 48 | 1 | 120.0 | 2.00x | 0.50x | 1.00x |" in table


@pytest.mark.slow  # about 25 s (aam_base's steps on a CPU): the default suite stays near 10 minutes
def test_the_activation_count_finds_what_each_kernel_keeps_on_a_real_batch(tmp_path):
    """activations.py on the dry run's data: the attention kernel keeps q, k, v and its output (2 bytes a
    channel each; no mask: the data's ASVs are all full length, which aam_ops=fast unmasks), the GELU its
    4 D wide input, for each encoded ASV row's tokens."""
    import subprocess
    import sys

    data = tmp_path / "data"
    sizes = ["48", "300", "30", "500", "1000"]  # run.sh's dry run's: samples, ASVs, richness, depth, reads
    subprocess.run([sys.executable, REPO / "experiments/original/prepare.py", data, *sizes], check=True)
    spec = importlib.util.spec_from_file_location("gpu_scale_activations", SCRIPT.with_name("activations.py"))
    activations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(activations)
    import torch

    found = activations.count(data, 8, torch.bfloat16, 1, [], depth=500)
    parts = {(p["stack"], p["part"], p["dtype"]): p["bytes"] for p in found["parts"]}
    tokens = found["encoded_rows"] * 151 * 4  # rows x tokens x layers (aam_base: D 128, 4 layers)
    assert parts[("asv_encoder", "attn.attend", "bfloat16")] == tokens * 4 * 128 * 2
    assert parts[("asv_encoder", "ffn.1", "bfloat16")] == tokens * 4 * 128 * 2
    assert parts[("asv_encoder", "ffn.2", "bool")] == tokens * 4 * 128
    assert found["kept_bytes"] == sum(parts.values())
    assert found["rss_peak_bytes"] >= found["rss_forward_bytes"]
    assert "GELU: its input" in activations.table(found)


def test_the_activation_count_refuses_a_directory_without_data_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, SCRIPT.with_name("activations.py"), tmp_path], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no table.biom: give run.sh's $OUT_DIR/data, or python "
        "experiments/original/prepare.py DIR 400 3000 600 8000 20000"
    ]


def table(seed: str, ultra: dict, original: dict, **more_rows: dict) -> dict:
    """A run.sh table.json of one seed: rows with one value a figure, as summarize writes them."""

    def row(config: str, figures: dict, batch: int = 8, steps: int = 234) -> dict:
        return {"config": config, "seeds_done": [seed], "batch": [batch], "steps": [steps]} | {
            k: [v] for k, v in figures.items()
        }

    rows = [row(summarize.REFERENCE, original), row("ultra", ultra)]
    rows += [row(name, figures, batch=64, steps=30) for name, figures in more_rows.items()]
    return {"machine": ["NVIDIA H200", "torch 2.11.0"], "rows": rows}


def figures(samples_per_s: float, wall_s: float, peak: float, train: float, val: float) -> dict:
    keys = ["samples_per_s", "wall_s", "peak_device_bytes", "train_loss", "val_loss"]
    return dict(zip(keys, [samples_per_s, wall_s, peak, train, val], strict=True))


def test_seeds_pooled_from_several_tables_are_paired_and_given_an_interval_from_three(tmp_path):
    orig = figures(20.0, 300.0, 16.0, 1.25, 1.6)
    tables = [
        table(
            "0", figures(140.0, 60.0, 8.0, 1.05, 1.10), orig, **{"ultra-auto": figures(900.0, 30, 20, 2, 2)}
        ),
        table("1", figures(160.0, 75.0, 8.0, 1.10, 1.20), orig),
    ]
    two = summarize.pooled(tables)
    ultra = two["pairs"]["ultra"]
    assert ultra["seeds"] == ["0", "1"] and two["other_samples"] == ["ultra-auto"]  # other samples: left out
    assert ultra["values"]["samples_per_s_x"] == pytest.approx([7.0, 8.0])
    assert ultra["values"]["end_to_end_x"] == pytest.approx([5.0, 4.0])
    assert ultra["values"]["train_loss_diff"] == pytest.approx([-0.20, -0.15])
    assert "no interval" in summarize.pooled_markdown(two)  # two seeds: too few

    three = summarize.pooled([*tables, table("2", figures(150.0, 60.0, 4.0, 1.15, 1.30), orig)])
    means = three["pairs"]["ultra"]["means"]
    assert means["peak_memory_x"]["mean"] == pytest.approx((0.5 * 0.5 * 0.25) ** (1 / 3))  # geometric
    train = means["train_loss_diff"]
    assert (
        train["mean"] == pytest.approx(-0.15) and -0.20 <= train["lo"] < train["mean"] < train["hi"] <= -0.10
    )
    assert "mean of 3, 95% interval" in summarize.pooled_markdown(three)
    with pytest.raises(ValueError, match="original-fastest seed 1 is in two tables"):
        summarize.pooled([*tables, tables[1]])


def test_seeds_pooled_from_a_directory_without_a_table_is_one_error_line(tmp_path, capsys):
    assert summarize.main(["--seeds", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no table.json in") and err.count("\n") == 1
    for payload in (
        "{not json",
        '{"rows": [{}]}',
    ):  # a table.json that is not summarize.py's: named, one line
        (tmp_path / "table.json").write_text(payload)
        assert summarize.main(["--seeds", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        said = f"error: {tmp_path / 'table.json'}: not all tables summarize.py wrote"
        assert err.startswith(said) and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        (
            "PROFILED",
            "ultra ultra-budgte",
            "error: PROFILED: 'ultra-budgte' is not one of aamperf's configurations",
        ),
        (
            "CONFIGS",
            "ultra ultra-fulll",
            "error: CONFIGS / LATER_CONFIGS: unknown configuration 'ultra-fulll'",
        ),
        (
            "LATER_CONFIGS",
            "original-fast",
            "error: CONFIGS / LATER_CONFIGS: unknown configuration 'original-fast'",
        ),
        ("BIG_PASSES", "1.5", "error: BIG_PASSES=1.5 must be a whole number >= 1"),
    ],
)
def test_run_sh_refuses_a_name_it_does_not_run_before_writing_anything(tmp_path, variable, value, said):
    """A misspelt PROFILED name would profile nothing, silently; a misspelt configuration used to stop the
    script only once the venvs and data were made and the runs before it had run."""
    import subprocess

    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", variable: value, "DRY": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "experiments/gpu_scale/run.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.startswith(said) and proc.stderr.count("\n") == 1, proc.stderr


def test_every_configuration_run_sh_runs_has_its_place_in_the_table():
    script = (REPO / "experiments/gpu_scale/run.sh").read_text()
    names = re.search(r'^AAMPERF_CONFIGS="([^"]*)"', script, re.M).group(1).split()
    assert names and set(names) <= set(summarize.ORDER), set(names) - set(summarize.ORDER)
