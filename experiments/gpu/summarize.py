"""The GPU check's one table (experiments/gpu/run.sh): the machine, the GPU test suite's counts, each
step's exit code and time, and per study each configuration's samples/s, speed-up with its interval, MFU,
peak device memory, val-loss change and verdict, read from the studies' comparison.json files (the
inference study: its two benchmark sweeps'), into OUT_DIR/summary.md and OUT_DIR/summary.json.
    python experiments/gpu/summarize.py OUT_DIR"""

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

GIB = 2**30
STUDIES = ("headline", "precision")  # paired-seed reports (aamperf/report/comparison.py)
BENCHES = ("inference/bench1", "inference/bench2")  # benchmark sweeps' reports (aamperf/predict/bench.py)


def describe_machine() -> dict[str, Any]:
    """This machine's GPU, its driver, torch and the CPU: run.sh calls this script where it measured."""
    import torch

    gpu = torch.cuda.is_available()
    machine: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if gpu else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # the CUDA torch was built with; the driver's may be newer
        "driver": None,
        "driver_cuda": None,
        "cpu": None,
    }
    import pynvml  # nvidia-ml-py, a dependency: the driver's own answer, where there is a driver

    try:
        pynvml.nvmlInit()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12080
        machine["driver"] = pynvml.nvmlSystemGetDriverVersion()
        machine["driver_cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        fields = {
            k.strip(): v.strip()
            for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        }
        machine["cpu"] = f"{fields['Model name']}, {fields['CPU(s)']} CPUs"
    except (OSError, KeyError):
        pass
    return machine


def read_steps(out: Path) -> list[dict[str, Any]]:
    """run.sh's steps.tsv: each step's name, exit code and seconds."""
    path = out / "steps.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []
    return [{"step": name, "exit_code": int(rc), "seconds": int(s)} for name, rc, s in rows]


def read_tests(path: Path) -> dict[str, int] | None:
    """passed / failed / errors / skipped of a pytest --junitxml file (None: the suite wrote none)."""
    if not path.exists():
        return None
    suites = ET.parse(path).getroot().iter("testsuite")
    counts = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
    }


def study(report: dict[str, Any]) -> dict[str, Any]:
    """The summary's figures of a paired-seed report, per configuration."""
    keys = ("config", "samples_per_s", "speedup", "speedup_lo", "speedup_hi", "mfu", "peak_device_bytes")
    keys += ("val_loss_delta", "val_loss_delta_lo", "val_loss_delta_hi", "verdict")
    rows = [{k: row.get(k) for k in keys} for row in report["rows"]]  # peak_device_bytes: newer reports
    return {"baseline": report["baseline"], "confidence": report["confidence"], "rows": rows}


def bench(report: dict[str, Any]) -> dict[str, Any]:
    """The summary's figures of a benchmark sweep's report, per inference level and batch size."""
    rows = []
    for row in report["rows"]:
        sizes = [k for k in row if k.isdigit()]
        device = [row[s].get("peak_device_bytes") for s in sizes if row[s].get("peak_device_bytes")]
        rows.append(
            {
                "level": row["inference"],
                "samples_per_s": {s: row[s]["samples_per_s"] for s in sizes},
                "speedup": {s: row[s].get("speedup") for s in sizes},
                "peak_device_bytes": max(device, default=None),
                "keeps_quality": row["keeps_quality"],
            }
        )
    return {
        "device": report["device"],
        "fastest_keeping_quality": report["fastest_keeping_quality"],
        "rows": rows,
    }


def fmt(value: float | None, spec: str, scale: float = 1) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def ratio(value: float | None, lo: float | None, hi: float | None) -> str:
    """`2.50x [2.31, 2.70]`; the value alone where the report gives no interval (fewer than 3 seeds)."""
    if value is None:
        return "n/a"
    return f"{value:.2f}x" + ("" if lo is None else f" [{lo:.2f}, {hi:.2f}]")


def percent(value: float | None, lo: float | None, hi: float | None) -> str:
    """A fraction and its interval as percentages: `+0.12 [-0.30, +0.55]`."""
    if value is None:
        return "n/a"
    return f"{100 * value:+.2f}" + ("" if lo is None else f" [{100 * lo:+.2f}, {100 * hi:+.2f}]")


def study_table(result: dict[str, Any]) -> list[str]:
    pct = f"{result['confidence']:.0%}"
    lines = [
        f"Baseline: `{result['baseline']}`.",
        "",
        f"| config | samples/s | speed-up [{pct} interval] | MFU | peak device memory GiB "
        f"| val loss change % [{pct} interval] | verdict |",
        "|---" * 7 + "|",
    ]
    for r in result["rows"]:
        cells = [
            f"`{r['config']}`",
            fmt(r["samples_per_s"], ".4g"),
            ratio(r["speedup"], r["speedup_lo"], r["speedup_hi"]),
            fmt(r["mfu"], ".3f"),
            fmt(r["peak_device_bytes"], ".2f", 1 / GIB),
            percent(r["val_loss_delta"], r["val_loss_delta_lo"], r["val_loss_delta_hi"]),
            r["verdict"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bench_table(result: dict[str, Any]) -> list[str]:
    sizes = list(result["rows"][0]["samples_per_s"])
    columns = "".join(f" batch {s}: samples/s (speed-up) |" for s in sizes)
    lines = [
        f"On {result['device']}.",
        "",
        f"| level |{columns} peak device memory GiB | keeps quality |",
        "|---" * (len(sizes) + 3) + "|",
    ]
    for r in result["rows"]:
        speeds = "".join(f" {r['samples_per_s'][s]:.4g} ({fmt(r['speedup'][s], '.2f')}x) |" for s in sizes)
        device = fmt(r["peak_device_bytes"], ".2f", 1 / GIB)
        lines.append(f"| {r['level']} |{speeds} {device} | {'yes' if r['keeps_quality'] else 'no'} |")
    return lines + ["", f"Fastest level that keeps quality: {result['fastest_keeping_quality']}."]


def tests_line(tests: dict[str, int] | None) -> str:
    if tests is None:
        return "no result file (gpu_tests.xml): the suite did not finish; see gpu_tests.log"
    if not any(tests.values()):
        return "no test selected (pytest -m gpu found none)"
    return ", ".join(f"{n} {k}" for k, n in tests.items())


def to_markdown(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    lines = [
        f"# GPU check, {m['date']}",
        "",
        f"GPU: {m['gpu'] or 'none visible to torch'} ({fmt(m['gpu_memory_bytes'], '.0f', 1 / GIB)} GiB), "
        f"driver {m['driver'] or '?'} (CUDA {m['driver_cuda'] or '?'}); torch {m['torch']} "
        f"(CUDA {m['torch_cuda'] or 'none'}); CPU: {m['cpu'] or '?'}.",
        "",
        f"GPU test suite (`pytest -m gpu`, gpu_tests.log): {tests_line(summary['gpu_tests'])}.",
        "",
        "| step | exit code | minutes |",
        "|---|---|---|",
        *(f"| {s['step']} | {s['exit_code']} | {s['seconds'] / 60:.1f} |" for s in summary["steps"]),
    ]
    for name, result in summary["studies"].items():
        lines += ["", f"## {name} ({name}/comparison.md)", ""]
        step = name.split("/")[0]
        if result is None and summary["steps"] and step not in {s["step"] for s in summary["steps"]}:
            lines.append("Not run: `STEPS` left this step out.")
        elif result is None:
            lines.append(f"No comparison.json: the study stopped before its report; see {step}.log.")
        else:
            lines += study_table(result) if "baseline" in result else bench_table(result)
    return "\n".join(lines) + "\n"


def summarize(out: Path) -> dict[str, Any]:
    """summary.json and summary.md in `out`; the machine is described once, into machine.json."""
    machine_file = out / "machine.json"
    if not machine_file.exists():
        machine_file.write_text(json.dumps(describe_machine(), indent=1))
    studies: dict[str, Any] = {}
    for name, read in [(s, study) for s in STUDIES] + [(b, bench) for b in BENCHES]:
        report = out / name / "comparison.json"
        studies[name] = read(json.loads(report.read_text())) if report.exists() else None
    summary = {
        "machine": json.loads(machine_file.read_text()),
        "gpu_tests": read_tests(out / "gpu_tests.xml"),
        "steps": read_steps(out),
        "studies": studies,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(to_markdown(summary))
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print(
            "error: usage: python experiments/gpu/summarize.py OUT_DIR (run.sh's output directory)",
            file=sys.stderr,
        )
        sys.exit(2)
    summarize(Path(sys.argv[1]))
