"""The collate: samples as unpadded ASV lists -> a padded batch, with its slot index and its UniFrac slice."""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aamperf.data.branches import batch_matrix
from aamperf.model.slots import bucket_size, bucketed, slot_index
from aamperf.tokens import TOKENS_PER_ASV


@dataclass
class Collate:
    """Items -> batch: pads ASVs to `pad_to` (None: the longest sample of the batch), slices UniFrac.

    Batch: tokens int64 [B, S, 151], counts float32 [B, S, 1], unifrac float32 [B, B],
    sample_idx int64 [B], asv_ids int64 [B, S] (each slot's row of the token table, -1 on padding),
    real_slots, unique_first, unique_inverse int64 and n_real_slots (where the real ASVs lie:
    `aamperf.model.slots.slot_index`; with `bucket_cap`, padded to bucket sizes, `bucketed`, and n_real_slots
    the count of real slots, else None),
    target float32 [B, 1] (when the data has one), categorical int64 [B, columns] (data.categorical: each
    sample's category per column, 0 unseen or missing), n_samples and n_tokens int.
    Under torch.distributed B is this rank's slice b of the global batch, and unifrac is [b, B]:
    its rows against every sample of the global batch; n_samples and n_tokens count the global batch.
    Padding rows are all zero (START included), so `tokens[..., 0] == 0` marks padding.
    Batch UniFrac (`branch_lengths` set): no `unifrac` yet, but the global batch's branch sets
    `branches` uint8 [B, U], their `branch_lengths` float64 [U] and this rank's `branch_rows` [b], from
    which `to_device` computes `unifrac` [b, B] on the run's device (aamperf/data/branches.py).
    """

    tokens: torch.Tensor  # [n_asvs, 151] uint8, every distinct ASV tokenized once
    unifrac: torch.Tensor | None  # [n_samples, n_samples] float32, the whole data set (None: prediction)
    pad_to: int | None
    rank: int = 0  # under torch.distributed: the items are the global batch, this rank takes its slice
    world_size: int = 1
    bucket_cap: int | None = None  # with pad_to=None: the longest sample rounded up to `bucket_size`, <= this
    branch_lengths: np.ndarray | None = None  # batch UniFrac: the lengths the items' `branches` index

    def __call__(self, items: list[dict]) -> dict:
        # Counted over the global batch: what one optimizer (micro-)step processes on all ranks.
        n_samples, n_tokens = len(items), sum(item["n_tokens"] for item in items)
        batch_idx = torch.tensor([item["sample_idx"] for item in items])
        rows = torch.arange(len(items))
        if self.branch_lengths is not None:  # of the global batch: every rank's rows meet every column
            branches, branch_lengths = batch_matrix([item["branches"] for item in items], self.branch_lengths)
        if self.world_size > 1:
            share = len(items) // self.world_size
            items = items[self.rank * share : (self.rank + 1) * share]
            rows = rows[self.rank * share : (self.rank + 1) * share]
        lengths = torch.tensor([len(item["asv_idx"]) for item in items])
        width = self.width(lengths)
        batch_pos = torch.repeat_interleave(torch.arange(len(items)), lengths)
        asv_pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        asv_idx = torch.cat([item["asv_idx"] for item in items])
        tokens = torch.zeros(len(items), width, TOKENS_PER_ASV, dtype=torch.long)
        tokens[batch_pos, asv_pos] = self.tokens[asv_idx].long()
        asv_ids = torch.full((len(items), width), -1, dtype=torch.long)
        asv_ids[batch_pos, asv_pos] = asv_idx
        counts = torch.zeros(len(items), width, 1)
        counts[batch_pos, asv_pos, 0] = torch.cat([item["counts"] for item in items])
        sample_idx = torch.tensor([item["sample_idx"] for item in items])
        batch = {
            "tokens": tokens,
            "counts": counts,
            "sample_idx": sample_idx,
            "asv_ids": asv_ids,
            # where the real ASVs lie and which are the same, found here so that the model need not read
            # them back from the GPU (aamperf.model.slots.SlotIndex); the slots ascend as the items' ASVs do
            **self.slot_index(batch_pos * width + asv_pos, asv_idx, len(items) * width),
            # counted here, on the host, so the trainer's samples/s and tokens/s need no device sync
            "n_samples": n_samples,
            "n_tokens": n_tokens,
        }
        if self.unifrac is not None:  # this rank's rows, every sample's column
            batch["unifrac"] = self.unifrac[sample_idx][:, batch_idx]
        if self.branch_lengths is not None:
            batch.update(branches=branches, branch_lengths=branch_lengths, branch_rows=rows)
        if "target" in items[0]:
            batch["target"] = torch.stack([item["target"] for item in items]).float().unsqueeze(1)
        if "categorical" in items[0]:  # this rank's rows, as the target's
            batch["categorical"] = torch.stack([item["categorical"] for item in items])
        return batch

    def slot_index(self, slots: torch.Tensor, asv_idx: torch.Tensor, n_slots: int) -> dict[str, Any]:
        """The batch's SlotIndex (`aamperf.model.slots.slot_index`); with buckets (`bucket_cap`), padded to
        bucket sizes too (`bucketed`), as the batch's width is: a few shapes on the device."""
        index = slot_index(slots, asv_idx)
        return index if self.bucket_cap is None else bucketed(index, n_slots)

    def width(self, lengths: torch.Tensor) -> int:
        """The ASV slots of a batch whose samples have `lengths` ASVs each: `pad_to`, or the longest (rounded
        up to `bucket_size` under `bucket_cap`)."""
        width = int(lengths.max()) if self.pad_to is None else self.pad_to
        if self.pad_to is None and self.bucket_cap is not None:
            width = min(bucket_size(width), self.bucket_cap)
        assert int(lengths.max()) <= width, "a sample has more ASVs than pad_to"
        return width
