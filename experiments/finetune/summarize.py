"""The table of experiments/finetune/run.sh, from the runs' own records.

aamperf's runs: summary.json (median step, steps, the validation's target figures, the random forest's
beside them, cached embeddings where the frozen encoder's were computed once). The original's: the
record time_aam.py wrote (each training epoch's time, each validation's results as its evaluator
computed them, its last confusion matrix). End to end: launch to exit, stamped by run.sh (clock_s).
Time per epoch: the original's median `train_epoch` (an epoch without its validation); aamperf's
median step x the steps of an epoch (settings.txt: training samples / batch, the original's count).
Ratios are the original's time / this one's for the same target, freeze and seed (paired; higher is
faster), then the median over seeds [min, max]. The figures: a regression's validation R^2 and MAE
(target units), a classification's accuracy and macro-F1 (the original's from its confusion matrix:
its own `f1` is support-weighted). aamperf validates on the original's validation samples of the same seed
where run.sh gave them (data.val_samples: "original's" in the table; the same samples scored, the same
trained on), else on its own split ("own"). Held-out (regressions, where score_heldout.sh scored them): R^2
and MAE over the samples of heldout.py, which no run trained or validated on, the same formula for both
programs (scikit-learn's) from each one's predictions in the target's units; paired and decided like figure 1.
Usage: python summarize.py OUT_DIR   (writes OUT_DIR/table.json, prints the markdown table)
"""

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from sklearn.metrics import mean_absolute_error, r2_score

from aamperf.report.paired import MIN_PAIRS, mean_interval, seeds_needed

ORIGINAL = "original"
BATCH = 8  # run.sh's batch size, both programs
FROZEN_BAR = 20.0  # issue 42: frozen fine-tuning at optim=ultra, end to end, >= 20x the original's
# "equal or better" figure 1 (R^2, accuracy): the 95% interval of the paired difference (this run's minus the
# original's, same seed) lies above -MARGIN, from MIN_PAIRS seeds on; fewer: every seed's difference >= 0
MARGIN = 0.05
CONFIDENCE = 0.95
FIGURES = {  # target kind: (first figure, second figure), each (label, aamperf key, original key)
    "regression": (("R^2", "val_target_r2", "r2"), ("MAE", "val_target_mae", "mae")),
    "classification": (("accuracy", "val_accuracy", "accuracy"), ("macro-F1", "val_macro_f1", "macro_f1")),
}


def macro_f1(matrix: list[list[int]]) -> float:
    """Mean F1 over the classes observed or predicted (rows observed, columns predicted), scikit-learn's."""
    n = len(matrix)
    scores = []
    for c in range(n):
        tp = matrix[c][c]
        predicted = sum(matrix[r][c] for r in range(n))
        observed = sum(matrix[c])
        if predicted or observed:
            scores.append(2 * tp / (predicted + observed))
    return sum(scores) / len(scores) if scores else float("nan")


def heldout_figures(predictions: Path) -> dict[str, Any] | None:
    """R^2 and MAE of a run's predictions of the held-out samples (columns predicted, observed), or None."""
    if not predictions.is_file():
        return None
    with predictions.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    observed, predicted = ([float(r[k]) for r in rows] for k in ("observed", "predicted"))
    return {
        "r2": r2_score(observed, predicted),
        "mae": mean_absolute_error(observed, predicted),
        "n": len(rows),
    }


def read_settings(out: Path) -> dict[str, int]:
    """run.sh's settings.txt: per_epoch=<steps of an epoch>, epochs=<fine-tuning epochs>, ..."""
    pairs = (line.split("=", 1) for line in (out / "settings.txt").read_text().split())
    return {key: int(value) for key, value in pairs}


def read_original(run: Path, row: dict[str, Any]) -> None:
    """The original's epoch time, validated samples' figures (its last validation) and step count."""
    r = json.loads((run / "record.json").read_text())
    last = r["val_results"][-1] if r["val_results"] else {}
    if r["confusion_matrix"] is not None:
        last["macro_f1"] = macro_f1(r["confusion_matrix"])
    split = run / "aam" / "val_samples.txt"  # its validation split; its loader drops a last partial batch
    held_out = len(split.read_text().split()) if split.is_file() else None
    row.update(
        epoch_s=statistics.median(r["epoch_times_s"]),
        epochs=len(r["epoch_times_s"]),
        steps=len(r["step_times_s"]),
        val=last,
        val_samples=held_out and held_out // BATCH * BATCH,
        val_loss=last.get("total_loss"),
        heldout=heldout_figures(run / "heldout_predictions.tsv"),
    )


def read_aamperf(run: Path, row: dict[str, Any], per_epoch: int) -> None:
    """aamperf's epoch time (median step x steps of an epoch), validation figures and its forest's."""
    s = json.loads((run / "summary.json").read_text())
    cached = (s.get("finetune") or {}).get("cached_embeddings") or {}
    row.update(
        epoch_s=s["step_time_median_s"] * per_epoch,
        epochs=s["steps"] / per_epoch,
        steps=s["steps"],
        val=s["val"],
        val_samples=s["val"].get("val_samples"),
        val_loss=s["val_loss"],
        rf=s.get("rf_baseline"),
        cached_embed_s=cached.get("embed_s") if cached.get("applied") else None,
        target_type=(s.get("target") or {}).get("type"),
        val_split="original's" if ((s.get("config") or {}).get("data") or {}).get("val_samples") else "own",
        heldout=heldout_figures(run / "heldout" / "targets.tsv"),
    )


def read_run(run: Path, per_epoch: int) -> dict[str, Any]:
    """One run's figures; `exit_code` alone where it did not finish."""
    row: dict[str, Any] = {"exit_code": int((run / "exit_code").read_text())}
    if row["exit_code"] != 0:
        return row
    start, end = map(float, (run / "clock_s").read_text().split())
    row["wall_s"] = end - start
    if (run / "record.json").is_file():
        read_original(run, row)
    else:
        read_aamperf(run, row, per_epoch)
    return row


def read_runs(out: Path, per_epoch: int) -> dict[tuple[str, str], dict[str, dict[str, dict]]]:
    """{(target, frozen): {program: {seed: run}}} from runs/<target>-<frozen>-<program>_seed<seed>/."""
    runs: dict[tuple[str, str], dict[str, dict[str, dict]]] = {}
    for run in sorted((out / "runs").iterdir()):
        if "_seed" not in run.name or not (run / "exit_code").is_file():
            continue  # the pretrainings: read_pretraining
        name, seed = run.name.rsplit("_seed", 1)
        target, frozen, program = name.split("-", 2)
        runs.setdefault((target, frozen), {}).setdefault(program, {})[seed] = read_run(run, per_epoch)
    return runs


def kind(group: dict[str, dict[str, dict]]) -> str:
    """regression or classification, as aamperf's runs of this target recorded it (the original's: R^2)."""
    for program in group.values():
        for r in program.values():
            if r.get("target_type"):
                return r["target_type"]
            if "accuracy" in r.get("val", {}):
                return "classification"
    return "regression"


def figure(row: dict[str, Any], program: str, spec: tuple[str, str, str]) -> float | None:
    value = row.get("val", {}).get(spec[2] if program == ORIGINAL else spec[1])
    return None if value is None else float(value)


def summarize_group(group: dict[str, dict[str, dict]], target_kind: str) -> list[dict[str, Any]]:
    """One row per program of one (target, freeze): paired ratios to the original's runs of each seed."""
    ref = {s: r for s, r in group.get(ORIGINAL, {}).items() if r["exit_code"] == 0}
    first, second = FIGURES[target_kind]
    rows = []
    for program in [ORIGINAL] + sorted(p for p in group if p != ORIGINAL):
        if program not in group:
            continue
        done = {s: r for s, r in group[program].items() if r["exit_code"] == 0}
        paired = {s: (r, ref[s]) for s, r in done.items() if s in ref}
        rf = [r["rf"] for r in done.values() if r.get("rf")]
        rows.append(
            {
                "program": program,
                "seeds_done": sorted(done),
                "failed": {s: r["exit_code"] for s, r in group[program].items() if r["exit_code"] != 0},
                "epochs": sorted({round(r["epochs"], 2) for r in done.values()}),
                "epoch_s": [r["epoch_s"] for r in done.values()],
                "epoch_speedup": [o["epoch_s"] / r["epoch_s"] for r, o in paired.values()],
                "wall_s": [r["wall_s"] for r in done.values()],
                "wall_speedup": [o["wall_s"] / r["wall_s"] for r, o in paired.values()],
                "cached_embed_s": [r["cached_embed_s"] for r in done.values() if r.get("cached_embed_s")],
                "first": [v for r in done.values() if (v := figure(r, program, first)) is not None],
                "second": [v for r in done.values() if (v := figure(r, program, second)) is not None],
                "first_vs_original": [  # paired: this run's figure minus the original's, same seed
                    figure(r, program, first) - figure(o, ORIGINAL, first)
                    for r, o in paired.values()
                    if figure(r, program, first) is not None and figure(o, ORIGINAL, first) is not None
                ],
                "rf_first": [x[first[1]] for x in rf if first[1] in x],
                "rf_second": [x[second[1]] for x in rf if second[1] in x],
                "val_samples": sorted({r["val_samples"] for r in done.values() if r.get("val_samples")}),
                "val_split": sorted({r["val_split"] for r in done.values() if r.get("val_split")}),
                **{
                    f"heldout_{k}": [r["heldout"][k] for r in done.values() if r.get("heldout")]
                    for k in ("r2", "mae")
                },
                **{
                    f"heldout_{k}_vs_original": [
                        r["heldout"][k] - o["heldout"][k]
                        for r, o in paired.values()
                        if r.get("heldout") and o.get("heldout")
                    ]
                    for k in ("r2", "mae")
                },
                "heldout_samples": sorted({r["heldout"]["n"] for r in done.values() if r.get("heldout")}),
            }
        )
    return rows


def read_pretraining(out: Path, per_epoch: int) -> dict[str, dict[str, Any]]:
    """The two pretrainings (stage 1, seed 0): their epoch time and end to end."""
    found = {}
    for program in ("original", "aamperf"):
        run = out / "runs" / f"pretrain-{program}"
        if (run / "exit_code").is_file():
            found[program] = read_run(run, per_epoch)
    return found


def summarize(out: Path) -> dict[str, Any]:
    settings = read_settings(out)
    groups = read_runs(out, settings["per_epoch"])
    result: dict[str, Any] = {"machine": (out / "machine.txt").read_text().splitlines(), "settings": settings}
    result["pretraining"] = read_pretraining(out, settings["per_epoch"])
    result["groups"] = [
        {"target": target, "frozen": frozen, "kind": kind(group), "rows": summarize_group(group, kind(group))}
        for (target, frozen), group in sorted(groups.items())
    ]
    (out / "table.json").write_text(json.dumps(result, indent=1))
    return result


def spread(values: list[float], spec: str, suffix: str = "") -> str:
    """The median over seeds [min, max]; one value alone; n/a for none."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return format(values[0], spec) + suffix
    return f"{statistics.median(values):{spec}}{suffix} [{min(values):{spec}}, {max(values):{spec}}]"


def quality(differences: list[float], name: str) -> str:
    """Figure 1 against the original's: from MIN_PAIRS paired seeds on, by the 95% interval of the mean
    difference against -MARGIN (equal or better, worse, or undecided); fewer, every seed's sign."""
    if len(differences) < MIN_PAIRS:
        better = bool(differences) and min(differences) >= 0
        return f"{name} {'>=' if better else '<'} original's ({'every' if better else 'some'} seed)"
    i = mean_interval(differences, CONFIDENCE)
    shown = f"mean {i.mean:+.3f} [{i.lo:+.3f}, {i.hi:+.3f}], {i.n} seeds"
    if i.lo >= -MARGIN:
        return f"{name} equal or better ({shown})"
    if i.hi < -MARGIN:
        return f"{name} worse ({shown})"
    needed = seeds_needed(i, MARGIN, CONFIDENCE, inside=True)  # at this mean and spread
    more = ""
    if needed:  # a mean near the margin needs many seeds: say how near, so a large count reads as what it is
        more = f"; the mean {i.mean + MARGIN:+.3f} from the margin: about {needed} seeds would decide it"
    return f"{name} undecided ({shown}{more})"


def verdict(group: dict[str, Any], row: dict[str, Any]) -> str:
    """Issue 42's bar for a frozen fine-tune (>= 20x end to end in every seed, figure 1 equal or better)."""
    if row["program"] == ORIGINAL or not row["wall_speedup"]:
        return ""
    fast = min(row["wall_speedup"]) >= FROZEN_BAR
    speed = f"{'>=' if fast else '<'} {FROZEN_BAR:.0f}x end to end" if group["frozen"] == "frozen" else ""
    metric = quality(row["first_vs_original"], FIGURES[group["kind"]][0][0])
    heldout = quality(row["heldout_r2_vs_original"], "held-out R^2") if row["heldout_r2_vs_original"] else ""
    return "; ".join(x for x in (speed, metric, heldout) if x)


def to_markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"Device: {'; '.join(result['machine'])}. {s['per_epoch']} steps of {BATCH} per epoch,"
        f" {s['epochs']} epochs.",
        "",
        "| target | encoder | program | epochs | s per epoch | x original per epoch | end to end s "
        "| x original end to end | figure 1 | figure 2 | vs original (figure 1) "
        "| random forest (aamperf's val samples) | val samples | held-out | vs original (held-out) "
        "| verdict | seeds done |",
        "|---" * 17 + "|",
    ]
    for group in result["groups"]:
        (name1, _, _), (name2, _, _) = FIGURES[group["kind"]]
        for r in group["rows"]:
            failed = ", ".join(f"seed {seed}: exit {code}" for seed, code in r["failed"].items())
            epoch = spread(r["epoch_s"], ".3g")
            if r["cached_embed_s"]:
                epoch += f" (+ {spread(r['cached_embed_s'], '.3g')} s embedding once)"
            rf = f"{name1} {spread(r['rf_first'], '.3f')}, {name2} {spread(r['rf_second'], '.3f')}"
            cells = [
                f"{group['target']} ({group['kind']})",
                group["frozen"],
                r["program"],
                "/".join(f"{e:g}" for e in r["epochs"]) or "n/a",
                epoch,
                spread(r["epoch_speedup"], ".2f", "x"),
                spread(r["wall_s"], ".3g"),
                spread(r["wall_speedup"], ".2f", "x"),
                f"{name1} {spread(r['first'], '.3f')}",
                f"{name2} {spread(r['second'], '.3f')}",
                spread(r["first_vs_original"], "+.3f"),
                rf if r["rf_first"] else "",
                ("/".join(map(str, r["val_samples"])) or "n/a")
                + (f" ({'/'.join(r['val_split'])})" if r["val_split"] else ""),
                f"R^2 {spread(r['heldout_r2'], '.3f')}, MAE {spread(r['heldout_mae'], '.4f')}"
                + "".join(f" ({n} samples)" for n in r["heldout_samples"][:1])
                if r["heldout_r2"]
                else "",
                f"R^2 {spread(r['heldout_r2_vs_original'], '+.3f')}, "
                f"MAE {spread(r['heldout_mae_vs_original'], '+.4f')}"
                if r["heldout_r2_vs_original"]
                else "",
                verdict(group, r),
                " ".join(r["seeds_done"]) + (f" (failed: {failed})" if failed else ""),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    pre = result["pretraining"]
    done = {p: r for p, r in pre.items() if r["exit_code"] == 0}
    lines += [""] + [
        f"Pretraining ({p}, seed 0): {r['epoch_s']:.3g} s per epoch, {r['wall_s']:.3g} s end to end."
        for p, r in done.items()
    ]
    lines += [f"Pretraining ({p}): exit {r['exit_code']}." for p, r in pre.items() if r["exit_code"] != 0]
    lines += [
        "",
        "Median over seeds [min, max]; x original = the original's time / this one's, same target, encoder"
        " and seed (higher is faster); vs original = this figure minus the original's, same seed; the"
        f" verdict's quality: from {MIN_PAIRS} seeds on, the {CONFIDENCE:.0%} bootstrap interval of that"
        f" difference's mean, equal or better where it lies above -{MARGIN} (fewer seeds: each seed's"
        " sign). Per epoch:"
        " the original's median training epoch (validation excluded), aamperf's median step x steps per"
        " epoch (a frozen encoder's embeddings, where cached, computed once: in end to end). The original"
        " validates on its split of the samples (it follows --seed); aamperf on the same samples where val"
        " samples says original's (data.val_samples), else on its own split; the random forest is aamperf's"
        " metrics.rf_baseline on aamperf's validation samples. Held-out: R^2 over samples of the same"
        " simulated data set that no run trained or validated on (heldout.py), paired and decided as"
        " figure 1.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "settings.txt").is_file():
        usage = "python experiments/finetune/summarize.py OUT_DIR (run.sh's output directory)"
        print(f"error: usage: {usage}", file=sys.stderr)
        sys.exit(2)
    print(to_markdown(summarize(Path(sys.argv[1]))))
