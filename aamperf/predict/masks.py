"""The bases `python -m aamperf.predict` hides (its `mask`): as the run's training hid them, so that the model
reads what every output was learnt from, each pass another draw, keyed by each sequence."""

import zlib
from typing import Any

import torch

from aamperf.model.masking import nucleotide_mask
from aamperf.weights import OWN_LOSSES


def run_masks(run_config: dict[str, Any], mask: str) -> dict[str, Any] | None:
    """The bases predict hides in each pass (`mask`): run, as the run's loss hid them in training
    (`nucleotide_mask` with its seed, loss.mask_fraction and loss.mask_strategy), where it hid any (AAMLoss
    with loss.nucleotide_weight > 0); none: whole sequences. None where nothing is hidden."""
    loss = run_config.get("loss") or {}
    if mask == "none" or loss.get("_target_") not in OWN_LOSSES or not loss.get("nucleotide_weight", 1.0) > 0:
        return None
    return {
        "seed": int(loss.get("seed", run_config.get("seed", 0))),  # the loss's (${seed} unless set apart)
        "fraction": float(loss.get("mask_fraction", 0.15)),
        "strategy": str(loss.get("mask_strategy", "random")),
    }


def sequence_keys(tokens: torch.Tensor) -> torch.Tensor:
    """[observations] long: each ASV's key for the bases predict hides, a hash of its tokens (crc32), so that
    a sequence is masked alike in every table and chunk it is read in."""
    return torch.tensor([zlib.crc32(row.tobytes()) for row in tokens.numpy()], dtype=torch.long)


def hidden_bases(batch: dict[str, Any], keys: torch.Tensor, draw: int, masks: dict[str, Any]) -> torch.Tensor:
    """The bases pass `draw` hides in a host batch (`nucleotide_mask`, as training draws them, keyed by
    `sequence_keys` instead of the run's table rows; per ASV: the dedup phase stays exact)."""
    ids = torch.where(batch["asv_ids"] >= 0, keys[batch["asv_ids"].clamp(min=0)], -1)
    return nucleotide_mask(batch["tokens"], ids, draw, masks["seed"], masks["fraction"], masks["strategy"])
