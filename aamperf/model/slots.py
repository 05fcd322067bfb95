"""Where the real ASVs of a padded batch lie, found on the host: the collate's slot index (`SlotIndex`,
keyed by `SLOT_KEYS`: the real slots, each distinct ASV's first slot, each slot's distinct ASV), which
the model reads instead of finding them on the device (host syncs), and the bucket sizes it and the
batch's width are padded to (`bucket_size`, `bucketed`), so that the device sees a few shapes."""

from typing import Any, NamedTuple

import torch
from torch import Tensor


class SlotIndex(NamedTuple):
    """Where a batch's real ASVs lie, found on the host by the collate (`slot_index`), so that forward
    reads them back from no GPU (`nonzero` and `unique` on a device tensor are host syncs: the host waits
    for the queued steps before it can launch more). `real` [R]: the real slots in [0, B*S), ascending;
    `first` [U]: for each distinct ASV of the batch, the position in `real` of its first slot; `inverse`
    [R]: each real slot's distinct ASV."""

    real: Tensor
    first: Tensor
    inverse: Tensor
    # R, where `bucketed` padded `real` past it (a host int: no sync to read it); None: not padded
    n_real: int | None = None


# a batch's SlotIndex, as the collate keys it
SLOT_KEYS = ("real_slots", "unique_first", "unique_inverse", "n_real_slots")


def first_slots(ids: Tensor) -> tuple[Tensor, Tensor]:
    """(first, inverse) of `ids` [R]: for each distinct id, the position of its first occurrence (any would
    do: an ASV's slots hold the same tokens); each position's distinct id. A host sync on a GPU tensor
    (unique sizes its output)."""
    distinct, inverse = torch.unique(ids, return_inverse=True)
    position = torch.arange(ids.numel(), device=ids.device)
    first = position.new_full(distinct.shape, ids.numel())
    return first.scatter_reduce_(0, inverse, position, reduce="amin"), inverse


def slot_index(slots: Tensor, asv_ids: Tensor) -> dict[str, Tensor]:
    """A batch's SlotIndex as the collate adds it (keyed by SLOT_KEYS): `slots` [R] its real slots in
    [0, B*S), ascending, and `asv_ids` [R] their ASVs, in the same order; the same values forward's
    `nonzero` and `first_slots` give on the device."""
    return dict(zip(SLOT_KEYS, (slots, *first_slots(asv_ids), None), strict=True))


def bucket_size(n: int) -> int:
    """The smallest size >= n of the ladder 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ... (four per doubling):
    shapes padded to it take few distinct values (compiled graphs reused, allocator blocks reused) at
    under 25% padding."""
    if n <= 4:
        return max(n, 1)
    step = 1 << max(0, (n - 1).bit_length() - 3)  # a quarter of the power of two below n
    return -(-n // step) * step


def bucketed(index: dict[str, Any], n_slots: int) -> dict[str, Any]:
    """A collate's slot index (`slot_index`) padded on the host to bucket sizes (`bucket_size`), so that the
    device's tensors, and the compiled graphs or CUDA graphs over them, take a handful of shapes rather
    than one per batch: `real_slots` [bucket(R)] with the sink slots n_slots, n_slots + 1, ... (past the
    batch's B*S: their rows are dropped after the scatter), `unique_first` [bucket(U)] with 0 (a distinct
    ASV encoded again, read by nothing), `unique_inverse` [bucket(R)] with 0 (what a sink reads);
    `n_real_slots` R (the model then scatters into B*S + bucket(R) rows, whether or not R needed padding)."""
    real, first, inverse, _ = (index[k] for k in SLOT_KEYS)
    n_real = len(real)
    extra_r, extra_u = bucket_size(n_real) - n_real, bucket_size(len(first)) - len(first)
    padded = (
        torch.cat([real, torch.arange(n_slots, n_slots + extra_r)]),
        torch.cat([first, first.new_zeros(extra_u)]),
        torch.cat([inverse, inverse.new_zeros(extra_r)]),
        n_real,
    )
    return dict(zip(SLOT_KEYS, padded, strict=True))
