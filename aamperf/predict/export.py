"""`export=true`: the run's model as a `torch.export` program (`model.pt2`), for a serving system to load
with `torch.export.load(path).module()`; checked against the eager model on a real batch."""

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aamperf.errors import UserError, one_line

EXPORT_FILE = "model.pt2"


def export_model(model: nn.Module, batch: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Export `model` (eval mode) with the batch and ASV dimensions dynamic; save it; the largest
    difference between the saved program's outputs and the eager model's on `batch`."""
    tokens, counts = batch["tokens"], batch["counts"]
    rows = getattr(model, "asv_rows", None)
    if rows is not None:  # AAM: every row encoded, padding included; no data-dependent shapes to trace
        model.asv_rows = "all"
    start = time.perf_counter()
    most = getattr(model, "max_asvs", 4096)  # AAM refuses more ASVs than it holds positions for
    dims = {0: torch.export.Dim("batch", min=1, max=4096), 1: torch.export.Dim("asvs", min=1, max=most)}
    try:
        program = torch.export.export(model, (tokens, counts), dynamic_shapes=(dims, dims))
    except Exception as exc:  # a plug-in model torch.export cannot trace
        raise UserError(f"export=true: torch.export cannot trace this model ({one_line(exc)[:300]})") from exc
    finally:
        if rows is not None:
            model.asv_rows = rows
    export_s = time.perf_counter() - start
    path = out_dir / EXPORT_FILE
    torch.export.save(program, path)
    served = torch.export.load(path).module()
    with torch.inference_mode():
        mine, theirs = served(tokens, counts), model(tokens, counts, asv_ids=batch.get("asv_ids"))
    difference = {k: (mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs}
    return {
        "file": EXPORT_FILE,
        "export_s": export_s,
        "max_abs_diff": difference,
        "dynamic": ["batch", "asvs"],
    }
