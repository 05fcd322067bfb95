"""The loaders over a split: the seeded shuffle (a new ASV draw per pass with data.asv_sampling=random), whole
optimizer steps' batches, and a step's batch cut into micro-batches."""

from collections.abc import Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, RandomSampler, Sampler, Subset

from aamperf.data.collate import Collate
from aamperf.data.samples import SampleDataset
from aamperf.errors import UserError
from aamperf.model.slots import SLOT_KEYS


def make_loaders(
    dataset: SampleDataset,
    collate: Collate,
    train_idx: list[int],
    val_idx: list[int],
    *,
    batch_size: int,
    seed: int,
    loader: DictConfig,
    val_samples: str | None = None,
    val_batch_size: int | None = None,
) -> tuple[DataLoader, DataLoader]:
    """Train loader (seeded shuffle) and val loader; both drop the last partial batch (UniFrac: pairs).
    `val_samples`: the data.val_samples file the split came from (None: data.val_fraction's), for the errors.
    `val_batch_size`: the val loader's batch (trainer.val_batch_size; None: `batch_size`).

    The shuffle has a generator of its own (`loader.sampler.generator`, one permutation per pass),
    apart from the DataLoader's, from which torch draws worker seeds at each new iterator: so the
    batch order of a seed is the same with or without workers, persistent or not."""
    fewer_val, more_val = " or data.val_fraction", "raise data.val_fraction"
    if val_samples is not None:  # the user's split: its file is the fix
        fewer_val = f", list fewer samples in data.val_samples={val_samples}"
        more_val = f"list more samples in data.val_samples={val_samples}"
    if len(train_idx) < batch_size:
        raise UserError(
            f"only {len(train_idx)} training samples, fewer than trainer.batch_size={batch_size}; "
            f"lower trainer.batch_size{fewer_val}, or give more samples"
        )
    if len(val_idx) < 2:
        raise UserError(f"only {len(val_idx)} validation samples (UniFrac needs >= 2 per batch); {more_val}")
    kwargs = {
        "collate_fn": collate,
        "drop_last": True,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
    }
    if loader.num_workers > 0:  # DataLoader refuses these without workers
        kwargs["persistent_workers"] = loader.persistent_workers
        if loader.prefetch_factor is not None:
            kwargs["prefetch_factor"] = loader.prefetch_factor
    train_set = Subset(dataset, train_idx)
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(seed))
    if getattr(dataset, "draws_anew", False):  # data.asv_sampling=random: each pass its own draw
        train_set, sampler = Draws(dataset, train_idx), DrawSampler(sampler)
    train = DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),  # worker seeds only
        **kwargs,
    )
    # a val set smaller than one batch is still used, as one batch of all of it (split evenly over ranks)
    world = collate.world_size
    val_batch = min(val_batch_size or batch_size, len(val_idx)) // world * world
    if val_batch < max(2, world):
        raise UserError(
            f"only {len(val_idx)} validation samples for {world} ranks (UniFrac needs >= 2 per batch); "
            + more_val
        )
    val_set, val_order = Subset(dataset, val_idx), None
    if getattr(dataset, "draws_anew", False):  # a validation pass reads its own draw (trainer.val_passes)
        val_set, val_order = Draws(dataset, val_idx), PassSampler(len(val_idx))
    val = DataLoader(val_set, batch_size=val_batch, sampler=val_order, shuffle=False, **kwargs)
    return train, val


class Draws(Subset):
    """The training samples where each pass draws their ASVs anew (data.asv_sampling=random): indexed by
    (draw, position) as `DrawSampler` yields them (any worker reads the same item for a key); by position
    alone, draw 0."""

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        draw, k = key if isinstance(key, tuple) else (0, key)
        return self.dataset.item(self.indices[k], draw)

    def __getitems__(self, keys: list) -> list[dict]:
        return [self[key] for key in keys]


class DrawSampler(Sampler):
    """A RandomSampler's positions, each with the pass's draw: a number taken from the sampler's own
    generator as the pass begins, so a resumed run (the generator's state at the pass's start: BatchStream)
    draws the same ASVs again."""

    def __init__(self, sampler: RandomSampler):
        self.sampler, self.generator = sampler, sampler.generator

    def __iter__(self) -> Iterator[tuple[int, int]]:
        draw = int(torch.randint(1 << 62, (), generator=self.generator))
        return ((draw, k) for k in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class PassSampler(Sampler):
    """The validation samples in order, each with the draw of the validation pass reading them: `draw`, which
    `validate` sets before each pass (trainer.val_passes; 0: the draw predict reads first)."""

    def __init__(self, n: int):
        self.n, self.draw = n, 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.draw, k) for k in range(self.n))

    def __len__(self) -> int:
        return self.n


def step_loader(loader: DataLoader, micro_batches: int) -> DataLoader:
    """`loader` drawing the batches of whole optimizer steps: `micro_batches` x its batch, from the same
    sampler (the same order), so that a step's batch holds every pair of its samples (UniFrac across
    micro-batches, `split_batch` cuts them)."""
    kwargs = {}
    if loader.num_workers > 0:  # DataLoader refuses these without workers
        kwargs = {"persistent_workers": loader.persistent_workers, "prefetch_factor": loader.prefetch_factor}
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size * micro_batches,
        sampler=loader.sampler,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        **kwargs,
    )


def split_batch(batch: dict, parts: int, world: int = 1) -> list[dict]:
    """A step's batch (this rank's rows of the global batch, as `Collate` makes it) -> `parts` micro-batches
    of its rows in order, each a batch as `Collate` makes one: its `unifrac` rows against the micro-batch's
    own samples on every rank, `n_samples` its global count (`n_tokens` is the step's: not split)."""
    rows = batch["tokens"].size(0)
    size = rows // parts
    assert size * parts == rows, f"a batch of {rows} rows does not split into {parts} micro-batches"
    micro = []
    for m in range(parts):
        mine = slice(m * size, (m + 1) * size)
        # the slot index is the step batch's (slots of its B x S): a micro-batch's model finds its own
        part = {
            k: v[mine] for k, v in batch.items() if torch.is_tensor(v) and k not in ("unifrac", *SLOT_KEYS)
        }
        if "unifrac" in batch:  # the global batch's columns are the ranks' rows in rank order
            starts = torch.arange(world, device=batch["unifrac"].device) * rows
            columns = (starts[:, None] + torch.arange(size, device=starts.device)).flatten()
            part["unifrac"] = batch["unifrac"][mine][:, columns + m * size]
        part["n_samples"] = batch["n_samples"] // parts
        micro.append(part)
    return micro
