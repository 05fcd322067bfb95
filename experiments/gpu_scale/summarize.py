"""The table of experiments/gpu_scale/run.sh, from the runs' own records.

aamperf's runs: summary.json (median step, batch, FLOPs per step, peak device memory, last train and
val loss) and the step count of metrics.jsonl; the original's: time_original.py's steps.json (each
step's time, losses, each epoch's val loss, the CUDA allocator's peak). End to end: launch to exit,
stamped by run.sh (clock_s). Every run is read alike: steady step = median step after the first SKIP
(warm-up, compile), samples/s = batch / steady step. MFU = model FLOPs per sample (aamperf's count at
batch 8, the same model at the same shapes for every configuration) x samples/s / the device's dense
bf16 peak (aamperf/metrics/gpu_peaks.py; on a CPU, the peak aamperf's run calibrated); HFU = the FLOPs
aamperf's run executed per sample (its hardware_flops_per_step: each distinct ASV of a batch encoded once,
recomputation counted) x samples/s / the same peak. Ratios are to
original-fastest, within each seed (paired), then the median over seeds [min, max]; each `ultra-*`
configuration (ultra with one change) also against ultra of the same seed (`against_ultra`).
Usage: python summarize.py OUT_DIR   (writes OUT_DIR/table.json, prints the markdown table)
       python summarize.py --seeds DIR...   (several OUT_DIRs' table.json, one seed or more each: each
       configuration against original-fastest per seed, and the mean over seeds with its 95% interval)
"""

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from aamperf.metrics.gpu_peaks import gpu_peak
from aamperf.report.paired import MIN_PAIRS, geometric, mean_interval

SKIP = 3
REFERENCE = "original-fastest"
ORDER = ["original-default", "original-fastest", "baseline", "basic", "advanced", "ultra"]
ORDER += ["ultra-packed", "ultra-ops", "ultra-full", "ultra-budget"]  # ultra with one change each
ORDER += ["ultra-compiled", "ultra-graphs", "ultra-ops-compiled", "ultra-full-compiled", "ultra-waited"]
ORDER += ["ultra-residual", "ultra-big", "ultra-auto"]

GIB = 2**30
CONFIDENCE = 0.95


def in_order(configs) -> list[str]:
    """The configuration names of `configs` in the table's order: ORDER's, then any other sorted (a name
    run.sh learns before this list does is shown, not dropped)."""
    return [c for c in ORDER if c in configs] + sorted(c for c in configs if c not in ORDER)


def read_run(run: Path) -> dict[str, Any]:
    """One run's figures; `exit_code` alone where it did not finish."""
    clock = (run / "clock_s").read_text().split() if (run / "clock_s").is_file() else []
    row: dict[str, Any] = {"exit_code": int((run / "exit_code").read_text())}
    if row["exit_code"] != 0:
        return row
    row["wall_s"] = float(clock[1]) - float(clock[0])
    if (run / "steps.json").is_file():  # the original
        r = json.loads((run / "steps.json").read_text())
        steps = r["step_times_s"]
        row.update(
            batch=r["batch_size"][0],
            steps=len(steps),
            step_s=statistics.median(steps[SKIP:] or steps),
            peak_device_bytes=r["peak_device_bytes"],
            train_loss=r["losses"][-1]["total"],
            val_loss=r["val_losses"][-1] if r["val_losses"] else None,
        )
    else:
        s = json.loads((run / "summary.json").read_text())
        batch = s.get("batch_finder", {}).get("batch_size") or s["config"]["trainer"]["batch_size"]
        row.update(
            batch=batch,
            steps=s["steps"],
            step_s=s["step_time_median_s"],
            peak_device_bytes=s["peak_device_bytes"],
            train_loss=s["train_loss"],
            val_loss=s["val_loss"],
            flops_per_sample=s["model_flops_per_step"] / batch,
            executed_flops_per_sample=s["hardware_flops_per_step"] / batch,
            peak_flops=s["peak_flops"],
            gpu_busy=s.get("gpu_util_percent"),  # pynvml's utilization over the run
            probes_s=s.get("auto_s"),  # the `auto` decisions' measuring: once per machine, then cached
            probes_peak=s.get("setup_peak_device_bytes"),  # their peak, apart from training's since 7072adc
            # metrics.memory_snapshot's (SNAPSHOT=1): what the recorded steps held at their peak, by source
            memory_peak=((s.get("profile") or {}).get("memory_snapshot") or {}).get("peak"),
            duration_parts=s.get("duration_parts_s"),  # where its duration went (since d1fa24d)
        )
    row["samples_per_s"] = row["batch"] / row["step_s"]
    return row


def read_runs(out: Path) -> dict[str, dict[str, dict]]:
    """{configuration: {seed: run}} from OUT_DIR/runs/<configuration>_seed<seed>/."""
    runs: dict[str, dict[str, dict]] = {}
    for run in sorted((out / "runs").iterdir()):
        if (run / "exit_code").is_file():
            cfg, seed = run.name.rsplit("_seed", 1)
            runs.setdefault(cfg, {})[seed] = read_run(run)
    return runs


def peak_bf16(device: str, runs: dict[str, dict[str, dict]]) -> tuple[float | None, str]:
    """The denominator of MFU: the GPU's dense bf16 peak, or on a CPU the peak aamperf calibrated."""
    if device != "cpu":
        peak, record = gpu_peak(device, "bf16")
        return peak, record.get("model") or record["reason"]
    peaks = [r["peak_flops"] for rs in runs.values() for r in rs.values() if r.get("peak_flops")]
    return (max(peaks), "this CPU's calibrated peak (aamperf)") if peaks else (None, "none recorded")


def spread(values: list[float], spec: str, scale: float = 1) -> str:
    if not values:
        return "n/a"
    v = [x * scale for x in values]
    if len(v) == 1:
        return format(v[0], spec)
    return f"{statistics.median(v):{spec}} [{min(v):{spec}}, {max(v):{spec}}]"


def against_ultra(runs: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """Each `ultra-*` configuration (ultra with one change) against ultra of the same seed, run on the
    same machine in the same OUT_DIR: its samples/s and its training peak over ultra's (paired by seed),
    its GPU busy and losses beside ultra's. Seeds where either did not finish are left out."""
    ultra = {s: r for s, r in runs.get("ultra", {}).items() if r["exit_code"] == 0}
    found = []
    for cfg in in_order(runs):
        if not cfg.startswith("ultra-"):
            continue
        done = {s: r for s, r in sorted(runs[cfg].items()) if r["exit_code"] == 0}
        paired = {s: (r, ultra[s]) for s, r in done.items() if s in ultra}
        if not paired:
            continue
        pairs = list(paired.values())
        found.append(
            {
                "config": cfg,
                "seeds": list(paired),
                "batch": sorted({r["batch"] for r, _ in pairs}),
                "step_s": [r["step_s"] for r, _ in pairs],
                "samples_per_s_x": [r["samples_per_s"] / u["samples_per_s"] for r, u in pairs],
                "peak_x": [
                    r["peak_device_bytes"] / u["peak_device_bytes"]
                    for r, u in pairs
                    if r["peak_device_bytes"] and u["peak_device_bytes"]
                ],
                "wall_x": [r["wall_s"] / u["wall_s"] for r, u in pairs],
                "gpu_busy_percent": [r["gpu_busy"] for r, _ in pairs if r.get("gpu_busy") is not None],
                "losses": [
                    (r["train_loss"], r["val_loss"], u["train_loss"], u["val_loss"]) for r, u in pairs
                ],
            }
        )
    return found


def summarize(out: Path) -> dict[str, Any]:
    machine = (out / "machine.txt").read_text().splitlines()
    device = "cpu" if "CUDA None" in machine[-1] else machine[0].split(",")[0].strip()
    runs = read_runs(out)
    peak, peak_source = peak_bf16(device, runs)
    flops = {  # model FLOPs per sample per seed, from aamperf's batch-8 runs (baseline's first)
        seed: r["flops_per_sample"]
        for cfg in ["ultra", "advanced", "basic", "baseline"]
        for seed, r in runs.get(cfg, {}).items()
        if "flops_per_sample" in r
    }
    ref = runs.get(REFERENCE, {})
    rows = []
    for cfg in in_order(runs):
        done = {seed: r for seed, r in runs[cfg].items() if r["exit_code"] == 0}
        paired = [(r, ref[s]) for s, r in done.items() if ref.get(s, {}).get("exit_code") == 0]
        same_steps = [(r, o) for r, o in paired if r["steps"] * r["batch"] == o["steps"] * o["batch"]]
        mfu = [r["samples_per_s"] * flops[s] / peak for s, r in done.items() if s in flops and peak]
        hfu = [  # what the run executed: aamperf's own count (the original's is not known)
            r["samples_per_s"] * r["executed_flops_per_sample"] / peak
            for r in done.values()
            if "executed_flops_per_sample" in r and peak
        ]
        memory = [r["peak_device_bytes"] for r in done.values() if r["peak_device_bytes"] is not None]
        rows.append(
            {
                "config": cfg,
                "seeds_done": sorted(done),
                "failed": {s: r["exit_code"] for s, r in runs[cfg].items() if r["exit_code"] != 0},
                "batch": sorted({r["batch"] for r in done.values()}),
                "steps": sorted({r["steps"] for r in done.values()}),
                "step_s": [r["step_s"] for r in done.values()],
                "samples_per_s": [r["samples_per_s"] for r in done.values()],
                "speedup": [r["samples_per_s"] / o["samples_per_s"] for r, o in paired],
                "wall_s": [r["wall_s"] for r in done.values()],
                "wall_speedup": [o["wall_s"] / r["wall_s"] for r, o in same_steps],
                "peak_device_bytes": memory,
                "mfu": mfu,
                "hfu": hfu,
                "gpu_busy_percent": [r["gpu_busy"] for r in done.values() if r.get("gpu_busy") is not None],
                "probes_s": [r["probes_s"] for r in done.values() if r.get("probes_s") is not None],
                "probes_peak_bytes": [
                    r["probes_peak"] for r in done.values() if r.get("probes_peak") is not None
                ],
                "train_loss": [r["train_loss"] for r in done.values()],
                "val_loss": [r["val_loss"] for r in done.values() if r["val_loss"] is not None],
            }
        )
    result = {"machine": machine, "device": device, "peak_flops": peak, "peak_source": peak_source}
    result["rows"] = rows
    result["against_ultra"] = against_ultra(runs)
    result["memory_peaks"] = {
        f"{cfg} seed {seed}": r["memory_peak"]
        for cfg in in_order(runs)
        for seed, r in runs[cfg].items()
        if r.get("memory_peak")
    }
    result["duration_parts"] = {  # launch to exit beside the run's own duration and its parts
        f"{cfg} seed {seed}": {"wall_s": r["wall_s"], **r["duration_parts"]}
        for cfg in in_order(runs)
        for seed, r in runs[cfg].items()
        if r.get("duration_parts")
    }
    (out / "table.json").write_text(json.dumps(result, indent=1))
    return result


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Machine: {'; '.join(result['machine'])}. MFU against {result['peak_source']}"
        + (f" ({result['peak_flops'] / 1e12:.1f} TFLOP/s)." if result["peak_flops"] else "."),
        "",
        f"| configuration | batch | steps | steady step ms | samples/s | x {REFERENCE} samples/s (paired) "
        f"| end to end s | x {REFERENCE} end to end | probes s | probes' peak GiB | peak GPU memory GiB "
        "| MFU % | HFU % | GPU busy % | train loss at end | val loss at end | seeds done |",
        "|---" * 17 + "|",
    ]
    for r in result["rows"]:
        failed = ", ".join(f"seed {s}: exit {c}" for s, c in r["failed"].items())
        cells = [
            r["config"],
            "/".join(map(str, r["batch"])) or "n/a",
            "/".join(map(str, r["steps"])) or "n/a",
            spread(r["step_s"], ".1f", 1e3),
            spread(r["samples_per_s"], ".1f"),
            spread(r["speedup"], ".2f") + ("x" if r["speedup"] else ""),
            spread(r["wall_s"], ".0f"),
            spread(r["wall_speedup"], ".2f") + ("x" if r["wall_speedup"] else ""),
            spread(r["probes_s"], ".1f"),
            spread(r.get("probes_peak_bytes", []), ".2f", 1 / GIB),
            spread(r["peak_device_bytes"], ".2f", 1 / GIB),
            spread(r["mfu"], ".2f", 100),
            spread(r["hfu"], ".2f", 100),
            spread(r["gpu_busy_percent"], ".0f"),
            spread(r["train_loss"], ".3f"),
            spread(r["val_loss"], ".3f"),
            " ".join(r["seeds_done"]) + (f" (failed: {failed})" if failed else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Median over seeds [min, max]; steady step = median step after the first {SKIP}; x = paired ratio"
        f" to {REFERENCE} of the same seed (higher is faster); end to end only where both ran the same"
        " samples (same batch and steps). MFU: the model's math per sample (each sample's ASVs encoded),"
        " HFU: the FLOPs aamperf's run executed (aam_ops encodes each distinct ASV of a batch once, and"
        " counts recomputation), both over the same peak; the original's HFU is not known. Probes: the"
        " seconds aamperf's `auto` decisions spent measuring (once per machine, then read from its cache: a"
        " later run's end to end is that much shorter), and the GPU memory they held at most, apart from"
        " the peak of training and validation (`setup_peak_device_bytes`; before 7072adc: in that peak)."
        " GPU busy: pynvml's utilization over the run.",
    ]
    changes = result.get("against_ultra") or []
    if changes:
        lines += [
            "",
            "**Each change against ultra of the same seed** (paired; the same machine and OUT_DIR; x: its "
            "figure over ultra's, median over seeds [min, max]; samples/s higher is faster, training peak "
            "lower is less memory; end to end includes each run's probes, cached after the machine's first):",
            "",
            "| configuration | batch | seeds | steady step ms | x ultra's samples/s "
            "| x ultra's training peak | x ultra's end to end | GPU busy % "
            "| train / val loss at end (ultra's) |",
            "|---" * 9 + "|",
        ]
        for c in changes:
            losses = "; ".join(
                f"{t:.3f} / {'n/a' if v is None else format(v, '.3f')} ({ut:.3f} / "
                f"{'n/a' if uv is None else format(uv, '.3f')})"
                for t, v, ut, uv in c["losses"]
            )
            cells = [
                c["config"],
                "/".join(map(str, c["batch"])),
                " ".join(c["seeds"]),
                spread(c["step_s"], ".1f", 1e3),
                spread(c["samples_per_s_x"], ".2f") + "x",
                spread(c["peak_x"], ".2f") + ("x" if c["peak_x"] else ""),
                spread(c["wall_x"], ".2f") + "x",
                spread(c["gpu_busy_percent"], ".0f"),
                losses,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    parts = result.get("duration_parts") or {}
    names = list(dict.fromkeys(n for p in parts.values() for n in p if n != "wall_s"))  # the runs' order
    if parts:
        lines += [
            "",
            "**Where each aamperf run's end to end went** (seconds: summary.json `duration_parts_s`, from "
            "the process's start to its summary; launch to exit beside it, the rest is the process's exit):",
            "",
            "| run | end to end | " + " | ".join(names) + " |",
            "|---" * (len(names) + 2) + "|",
            *(
                f"| {run} | {p['wall_s']:.1f} | " + " | ".join(f"{p.get(n, 0.0):.1f}" for n in names) + " |"
                for run, p in parts.items()
            ),
        ]
    for run, peak in result.get("memory_peaks", {}).items():
        lines += [
            "",
            f"**{run}: what its recorded steps held at their peak** (metrics.memory_snapshot, "
            f"{peak['peak_bytes'] / GIB:.2f} GiB): {peak['held_from_before_bytes'] / GIB:.2f} GiB allocated "
            "before them (weights, optimizer state, the step before's)",
        ]
        if "sources" not in peak:  # recorded without stacks (a model that recomputes in eager Python)
            lines[-1] += "; recorded without the allocating lines (the model recomputes: snapshot.py)"
            continue
        lines += [
            "",
            "| allocated at | GiB | blocks |",
            "|---|---|---|",
            *(f"| {s['where']} | {s['bytes'] / GIB:.3f} | {s['blocks']} |" for s in peak["sources"]),
            f"| elsewhere | {peak['other_sources_bytes'] / GIB:.3f} | |",
        ]
    return "\n".join(lines)


def by_seed(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A table.json row's figures by seed: its lists are in the order of `seeds_done`."""
    seeds = row["seeds_done"]
    keys = ["samples_per_s", "wall_s", "peak_device_bytes", "train_loss", "val_loss"]
    if any(len(row[k]) != len(seeds) for k in keys):
        raise ValueError(f"{row['config']}: a figure is missing for a seed: the seeds cannot be paired")
    return {seed: {k: row[k][i] for k in keys} for i, seed in enumerate(seeds)}


def pooled(tables: list[dict[str, Any]]) -> dict[str, Any]:
    """Each configuration against REFERENCE, seed by seed, over several tables (run.sh's OUT_DIRs, one
    machine each): the paired ratios and loss differences, and their means with a 95% bootstrap interval
    (aamperf.report.paired; ratios as geometric means). An interval needs MIN_PAIRS seeds or more."""
    seeds: dict[str, dict[str, dict]] = {}  # config -> seed -> figures
    for table in tables:
        for row in table["rows"]:
            for seed, figures in by_seed(row).items():
                if seed in seeds.setdefault(row["config"], {}):
                    raise ValueError(f"{row['config']} seed {seed} is in two tables: pool distinct seeds")
                seeds[row["config"]][seed] = figures
    ref = seeds.get(REFERENCE, {})
    samples = {row["config"]: (row["batch"], row["steps"]) for table in tables for row in table["rows"]}
    pairs, other_samples = {}, []
    for cfg in [c for c in in_order(seeds) if c != REFERENCE]:
        if samples[cfg] != samples.get(REFERENCE):  # its end to end and losses are of other samples
            other_samples.append(cfg)
            continue
        paired = {s: (r, ref[s]) for s, r in sorted(seeds[cfg].items()) if s in ref}
        if not paired:
            continue
        values = {
            "samples_per_s_x": [r["samples_per_s"] / o["samples_per_s"] for r, o in paired.values()],
            "end_to_end_x": [o["wall_s"] / r["wall_s"] for r, o in paired.values()],
            "peak_memory_x": [r["peak_device_bytes"] / o["peak_device_bytes"] for r, o in paired.values()],
            "train_loss_diff": [r["train_loss"] - o["train_loss"] for r, o in paired.values()],
            "val_loss_diff": [r["val_loss"] - o["val_loss"] for r, o in paired.values()],
        }
        means = {}
        for key, v in values.items():
            if key.endswith("_x"):
                mean, lo, hi = geometric(mean_interval([math.log(x) for x in v], CONFIDENCE))
            else:
                i = mean_interval(v, CONFIDENCE)
                mean, lo, hi = i.mean, i.lo, i.hi
            means[key] = {"mean": mean, "lo": lo, "hi": hi}
        pairs[cfg] = {"seeds": list(paired), "values": values, "means": means}
    machines = sorted({", ".join(t["machine"]) for t in tables})
    return {"machines": machines, "pairs": pairs, "other_samples": other_samples}


def pooled_markdown(result: dict[str, Any]) -> str:
    heads = ["samples/s x", "end to end x", "peak memory x", "train loss -", "val loss -"]
    lines = [
        f"Against {REFERENCE}, paired by seed; machines: {'; '.join(result['machines'])}.",
        "",
        "| configuration | seed | " + " | ".join(heads) + " |",
        "|---" * (len(heads) + 2) + "|",
    ]
    for cfg, pair in result["pairs"].items():
        values, means = pair["values"], pair["means"]
        for i, seed in enumerate(pair["seeds"]):
            cells = [f"{values[k][i]:.2f}x" if k.endswith("_x") else f"{values[k][i]:+.3f}" for k in values]
            lines.append(f"| {cfg} | {seed} | " + " | ".join(cells) + " |")
        n = len(pair["seeds"])
        if n >= MIN_PAIRS:
            cells = [
                f"{m['mean']:.2f}x [{m['lo']:.2f}, {m['hi']:.2f}]"
                if k.endswith("_x")
                else f"{m['mean']:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}]"
                for k, m in means.items()
            ]
            lines.append(f"| {cfg} | mean of {n}, {CONFIDENCE:.0%} interval | " + " | ".join(cells) + " |")
        else:
            few = f"{n} seed{'s' * (n > 1)}: fewer than {MIN_PAIRS}, no interval"
            lines.append(f"| {cfg} | {few} |" + " |" * len(heads))
    lines += [
        "",
        f"x: the configuration's figure over {REFERENCE}'s of the same seed (memory: lower is less); loss -:"
        " the configuration's last loss minus the original's (below 0: lower). The val losses are each"
        " program's own 20% of the samples (drawn by its seed): a rough comparison only.",
    ]
    if result["other_samples"]:
        lines[-1] += f" Left out, at another batch or step count: {', '.join(result['other_samples'])}."
    return "\n".join(lines)


def main(args: list[str]) -> int:
    usage = (
        "python experiments/gpu_scale/summarize.py OUT_DIR (run.sh's output directory), or"
        " --seeds OUT_DIR... (directories with table.json)"
    )
    if args[:1] == ["--seeds"]:
        paths = [Path(a) / "table.json" for a in args[1:]]
        missing = [str(p) for p in paths if not p.is_file()]
        if not paths or missing:
            print(
                f"error: no table.json in {', '.join(missing) or 'no directory'}: usage: {usage}",
                file=sys.stderr,
            )
            return 2
        try:
            tables = [json.loads(p.read_text()) for p in paths]
            result = pooled(tables)
        except (json.JSONDecodeError, KeyError, TypeError) as e:  # not JSON, or JSON of another shape
            names = ", ".join(map(str, paths))
            print(f"error: {names}: not all tables summarize.py wrote ({type(e).__name__}: {e}); run "
                  "summarize.py OUT_DIR on each to write its table.json", file=sys.stderr)  # fmt: skip
            return 2
        except ValueError as e:  # seeds that cannot be paired
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(pooled_markdown(result))
        return 0
    if len(args) != 1 or not (Path(args[0]) / "runs").is_dir():
        print(f"error: usage: {usage}", file=sys.stderr)
        return 2
    print(to_markdown(summarize(Path(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
