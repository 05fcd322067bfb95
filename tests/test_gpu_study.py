"""experiments/gpu/: summarize.py's table from reports the real report code wrote for runs of known
figures, and run.sh's refusals and install choices before it installs anything (no GPU needed)."""

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from aamperf.predict.bench import report as bench_report
from aamperf.report import compare, find_runs

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "experiments" / "gpu" / "run.sh"
GIB = 2**30

spec = importlib.util.spec_from_file_location("gpu_summarize", REPO / "experiments" / "gpu" / "summarize.py")
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)

# pytest --junitxml's layout: 4 run, 1 failed, 1 error, 1 skipped (deselected tests are not in it)
JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" '
    'errors="1" failures="1" skipped="1" tests="5" time="3.1"><testcase classname="gpu" name="test_a" '
    'time="0.1" /></testsuite></testsuites>'
)
MACHINE = {
    "date": "2026-11-24 08:00",
    "gpu": "NVIDIA H100 80GB HBM3",
    "gpu_memory_bytes": 80 * GIB,
    "torch": "2.13.0+cu128",
    "torch_cuda": "12.8",
    "driver": "570.86.15",
    "driver_cuda": "12.8",
    "cpu": "Intel(R) Xeon(R) Platinum 8480+, 26 CPUs",
}


def write_run(path: Path, overrides: list[str], **summary) -> None:
    """A training run's directory as the report reads it: overrides and summary.json."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (path / "summary.json").write_text(json.dumps({"config": {"data": {"seed": 0}}, **summary}))


def write_study(out: Path, option: str, figures: dict, baseline: str) -> None:
    """{value of `option`: (samples/s per seed, val loss per seed, peak device bytes)} -> runs and the
    comparison.json the sweep's report writes."""
    for value, (speeds, losses, device_bytes) in figures.items():
        for seed, (sps, loss) in enumerate(zip(speeds, losses, strict=True)):
            done = {"samples_per_s": sps, "val_loss": loss, "mfu": 0.25, "peak_device_bytes": device_bytes}
            write_run(
                out / f"{value}_seed{seed}",
                [f"{option}={value}", f"seed={seed}"],
                seed=seed,
                **(
                    {"status": "completed", **done}
                    if sps
                    else {"status": "failed", "error": "CUDA error: boom"}
                ),
            )
    result = compare(find_runs([out]), baseline)
    (out / "comparison.json").write_text(json.dumps(result))


def write_bench(out: Path) -> None:
    """A benchmark sweep of two levels and the comparison.json its callback writes."""
    for level, p50_s, cosine in (("baseline", 0.010, 1.0), ("fast", 0.004, 0.9999)):
        figures = {"samples_per_s": 32 / p50_s, "peak_rss_bytes": GIB, "peak_device_bytes": GIB // 2}
        write_run(
            out / level,
            [f"inference={level}"],
            status="completed",
            inference=level,
            device="cuda:0",
            bench={"32": {"p50_s": p50_s, "p95_s": 2 * p50_s, **figures}},
            quality={"embedding_cosine_min": cosine, "target_mae": 0.0},
        )
    bounds = OmegaConf.create({"bench": {"min_cosine": 0.999, "max_target_mae_std": 0.01}})
    (out / "comparison.json").write_text(json.dumps(bench_report(out, bounds)))


def test_the_summary_puts_every_study_of_the_gpu_check_in_one_table(tmp_path):
    (tmp_path / "machine.json").write_text(json.dumps(MACHINE))
    (tmp_path / "gpu_tests.xml").write_text(JUNIT)
    (tmp_path / "steps.tsv").write_text(
        "install\t0\t95\ngpu_tests\t1\t42\nheadline\t0\t300\nprecision\t0\t60\ninference\t0\t90\n"
    )
    write_study(
        tmp_path / "headline",
        "optim",
        {"baseline": ((10, 11, 12), (2.0, 2.0, 2.0), 3 * GIB), "ultra": ((50, 55, 60), (2.0, 2.0, 2.0), GIB)},
        "optim=baseline",
    )
    write_study(
        tmp_path / "precision",
        "precision",
        {"fp32": ((10, 10, 10), (2.0, 2.0, 2.0), GIB), "fp16": ((None,) * 3, (None,) * 3, None)},
        "precision=fp32",
    )
    write_bench(tmp_path / "inference" / "bench1")  # bench2 never finished

    summary = summarize.summarize(tmp_path)

    assert summary["gpu_tests"] == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1}
    assert summary["steps"][1] == {"step": "gpu_tests", "exit_code": 1, "seconds": 42}
    ultra = summary["studies"]["headline"]["rows"][1]
    assert ultra["config"] == "optim=ultra" and ultra["speedup"] == pytest.approx(5.0)
    assert ultra["peak_device_bytes"] == GIB and ultra["val_loss_delta"] == 0.0
    assert summary["studies"]["precision"]["rows"][1]["verdict"].startswith("failed (3 runs): CUDA error")
    fast = summary["studies"]["inference/bench1"]["rows"][1]
    assert fast["speedup"]["32"] == pytest.approx(2.5) and fast["peak_device_bytes"] == GIB // 2
    assert summary["studies"]["inference/bench2"] is None
    assert json.loads((tmp_path / "summary.json").read_text()) == summary

    table = (tmp_path / "summary.md").read_text()
    assert "GPU: NVIDIA H100 80GB HBM3 (80 GiB), driver 570.86.15 (CUDA 12.8); torch 2.13.0+cu128" in table
    assert "(`pytest -m gpu`, gpu_tests.log): 2 passed, 1 failed, 1 errors, 1 skipped." in table
    assert "| gpu_tests | 1 | 0.7 |" in table
    assert "| `optim=ultra` | 55 | 5.00x [5.00, 5.00] | 0.250 | 1.00 | +0.00 [+0.00, +0.00] | faster" in table
    assert "| `precision=fp16` | n/a | n/a | n/a | n/a | n/a | failed (3 runs): CUDA error: boom |" in table
    assert "| fast | 8000 (2.50x) | 0.50 | yes |" in table and "keeps quality: fast." in table
    assert "No comparison.json: the study stopped before its report; see inference.log." in table


def test_a_study_that_steps_left_out_is_said_not_run_not_stopped(tmp_path):
    (tmp_path / "machine.json").write_text(json.dumps(MACHINE))
    (tmp_path / "steps.tsv").write_text("install\t0\t20\ngpu_tests\t0\t103\n")  # STEPS=gpu_tests
    table = (summarize.summarize(tmp_path), (tmp_path / "summary.md").read_text())[1]
    assert table.count("Not run: `STEPS` left this step out.") == 4 and "No comparison.json" not in table


def test_a_check_that_stopped_early_is_still_summarized_and_names_this_machine(tmp_path):
    summary = summarize.summarize(tmp_path)  # no tests' file, no reports, no machine.json yet

    machine = json.loads((tmp_path / "machine.json").read_text())
    assert machine["torch"] == torch.__version__ and machine["torch_cuda"] == torch.version.cuda
    assert machine["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    assert summary["gpu_tests"] is None and set(summary["studies"].values()) == {None}
    assert "no result file (gpu_tests.xml)" in (tmp_path / "summary.md").read_text()


# ---- run.sh, up to what it would install ----------------------------------------------------------


@pytest.fixture
def fake_machine(tmp_path):
    """A copy of run.sh in a repository of its own (where .venv-gpu would go) and a bin directory for
    PATH holding only `dirname`; run(...) adds a fake nvidia-smi or python3 and runs the script."""
    script = tmp_path / "repo" / "experiments" / "gpu" / "run.sh"
    script.parent.mkdir(parents=True)
    shutil.copy(RUN_SH, script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))

    def run(nvidia_smi: str | None = None, python3: str = "exit 1", **env) -> subprocess.CompletedProcess:
        for name, body in (("nvidia-smi", nvidia_smi), ("python3", python3)):
            if body is not None:
                (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
                (bin_dir / name).chmod(0o755)
        return subprocess.run(
            ["/bin/bash", str(script), str(tmp_path / "out")],
            env={"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/"), **env},
            capture_output=True,
            text=True,
            timeout=30,
        )

    return run, tmp_path


def h100(cuda: str) -> str:
    """nvidia-smi of an H100 whose driver supports `cuda`: its -L list, else its header."""
    return (
        'if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"; exit 0; fi\n'
        f'echo "| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: {cuda}   |"'
    )


def test_run_sh_parses():
    assert subprocess.run(["bash", "-n", str(RUN_SH)]).returncode == 0


@pytest.mark.parametrize(
    "nvidia_smi, says",
    [
        (None, "error: nvidia-smi not found: run this on a machine with an NVIDIA GPU and its driver"),
        (
            'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
            "error: nvidia-smi sees no GPU: NVIDIA-SMI has failed because it couldn't communicate",
        ),
        ("echo 'No devices were found'; exit 6", "error: nvidia-smi sees no GPU: No devices were found"),
    ],
)
def test_without_a_gpu_run_sh_says_so_in_one_line_and_writes_nothing(fake_machine, nvidia_smi, says):
    run, root = fake_machine
    proc = run(nvidia_smi)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(says) and proc.stderr.count("\n") == 1
    assert not (root / "repo" / ".venv-gpu").exists() and not (root / "out").exists()


@pytest.mark.parametrize(
    "cuda, build",
    [("12.8", "cu128"), ("12.9", "cu128"), ("12.2", "cu126"), ("13.0", "cu130"), ("13.1", "cu130")],
)
def test_run_sh_installs_the_torch_build_of_the_drivers_cuda(fake_machine, cuda, build):
    run, root = fake_machine
    proc = run(h100(cuda), DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "venv: .venv-gpu, a plain one",
        f"torch: pip install torch --index-url https://download.pytorch.org/whl/{build}",
        "aamperf: pip install -e .[dev]",
    ]
    assert not (root / "repo" / ".venv-gpu").exists() and not (root / "out").exists()


def test_run_sh_refuses_a_driver_older_than_any_build_unless_given_an_index(fake_machine):
    run, _ = fake_machine
    proc = run(h100("11.8"), DRY_RUN="1")
    assert proc.returncode == 2 and "error: the driver supports CUDA 11.8" in proc.stderr
    proc = run(h100("11.8"), DRY_RUN="1", TORCH_INDEX_URL="https://example.org/whl/cu118")
    assert (
        proc.returncode == 0
        and "torch: pip install torch --index-url https://example.org/whl/cu118\n" in proc.stdout
    )


def test_run_sh_reuses_a_system_torch_that_sees_the_gpu_and_installs_offline_from_wheels(fake_machine):
    run, _ = fake_machine
    proc = run(h100("12.8"), python3="echo 2.13.0+cu128", DRY_RUN="1", WHEELS="/media/wheels")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "venv: .venv-gpu with --system-site-packages: python3's torch sees the GPU and is reused",
        "torch: 2.13.0+cu128, already there",
        "aamperf: pip install --no-index --find-links /media/wheels -e .[dev] (offline)",
    ]
    proc = run(h100("12.8"), python3="echo 2.13.0+cu128", DRY_RUN="1", WHEELS="/media/wheels", EXTRAS="")
    assert (
        proc.stdout.splitlines()[-1]
        == "aamperf: pip install --no-index --find-links /media/wheels -e . (offline)"
    )
