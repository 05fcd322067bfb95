"""What `python -m aamperf.predict` writes: the files a biologist opens (TSVs with sample ids, the n x n
predicted UniFrac as .npy), and the figures of them for summary.json."""

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from aamperf.files import write_atomic
from aamperf.model.loss import unifrac_of
from aamperf.predict.target import SavedTarget, target_figures, target_table


def write_predictions(
    out_dir: Path,
    read: dict,
    parts: list[dict],
    pairwise: bool,
    target: SavedTarget | None,
    observed: pd.Series | None,
    passes: int = 1,
    units: torch.Tensor | None = None,
) -> dict:
    """The ranks' shares, in input order, into the files; the summary's figures of them. `target`: the
    model file's (None: the run learned none, a pretraining, and its target head's output means nothing);
    `observed`: each sample's observed target (None: the metadata has none); `passes`: the draws of ASVs
    each sample's target outputs hold, `units` their zscore_category shift and scale (`target_table`)."""
    order = torch.argsort(torch.cat([part["rows"] for part in parts]))
    embedding = torch.cat([part["embedding"] for part in parts])[order]
    predicted = torch.cat([part["predicted"] for part in parts])
    targets, figures = None, {}
    if target is not None and len(predicted):  # a run that learned no target left its head untrained
        targets = target_table(read["ids"], predicted[order], target, observed, passes, units)
        figures = target_summary(target_figures(targets, target))
    written = write_outputs(out_dir, read["ids"], embedding, targets, pairwise)
    seconds = torch.cat([part["latencies"] for part in parts]).tolist()
    busy_s = max(float(part["latencies"].sum()) for part in parts)  # the ranks work side by side
    return {
        "files": written,
        "samples_per_s": len(read["ids"]) / busy_s,
        "batch_latency_s": {
            "p50": float(np.percentile(seconds, 50)),
            "p95": float(np.percentile(seconds, 95)),
        },
        **figures,
    }


def target_summary(figures: dict[str, Any]) -> dict[str, Any]:
    """summary.json's target figures: all of them as `target_metrics`; a regression's MAE, R^2 and sample
    count also under the keys predict wrote before (`target_mae`, `target_r2`, `target_observed`)."""
    if not figures:
        return {}
    summary = {"target_metrics": figures, "target_observed": figures["observed"]}
    if "mae" in figures:
        summary.update(target_mae=figures["mae"], target_r2=figures["r2"])
    return summary


def write_outputs(
    out_dir: Path, ids: list[str], embedding, targets: pd.DataFrame | None, pairwise: bool
) -> dict:
    """The files a biologist opens: TSVs with sample ids, .npy for the n x n matrix."""
    columns = [f"dim_{i}" for i in range(embedding.shape[1])]
    frame = pd.DataFrame(embedding.numpy(), index=pd.Index(ids, name="sample_id"), columns=columns)
    write_atomic(out_dir / "embeddings.tsv", frame.to_csv(sep="\t", float_format="%.6g"))
    written = {"embeddings.tsv": "sample embeddings, one row per sample"}
    if targets is not None:
        write_atomic(out_dir / "targets.tsv", targets.to_csv(sep="\t", float_format="%.6g"))
        written["targets.tsv"] = (
            "predicted target in its own units (a regression's value and quantiles, a classification's "
            "class and class probabilities), and the observed one where known"
        )
    if pairwise:
        write_atomic(out_dir / "unifrac.npy", lambda f: write_pairwise(f, embedding))
        write_atomic(out_dir / "unifrac.ids.txt", "".join(f"{sid}\n" for sid in ids))
        written["unifrac.npy"] = "predicted UniFrac, n x n, rows and columns in unifrac.ids.txt's order"
    return written


def write_pairwise(f, embedding: torch.Tensor, block_bytes: int = 1 << 26) -> None:
    """The predicted UniFrac between every pair of samples, as a float32 .npy written a block of rows at
    a time: its memory stays at `block_bytes` whatever n (100,000 samples: a 40 GB file, 64 MB here)."""
    n = len(embedding)
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (n, n)})
    rows = max(1, block_bytes // (4 * max(n, 1)))
    for start in range(0, n, rows):
        block = unifrac_of(torch.cdist(embedding[start : start + rows].float(), embedding.float()))
        block[torch.arange(len(block)), torch.arange(start, start + len(block))] = (
            0.0  # each sample to itself
        )
        f.write(block.numpy().astype("<f4").tobytes())
