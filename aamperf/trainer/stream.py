"""Batches without end, and where the run is in them (kept in checkpoints)."""

from collections.abc import Iterator
from typing import Any

import torch

from aamperf.data.loaders import step_loader
from aamperf.errors import UserError


class BatchStream:
    """Endless batches; each pass re-shuffles through the sampler's own seeded generator. Its position
    (the generator's state when the pass began, batches taken since) goes into checkpoints."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.loader = loader
        self._iter: Iterator[dict[str, Any]] | None = None
        self._pass_state: torch.Tensor | None = None
        self._taken = 0

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._iter is None:
                self._pass_state = self.loader.sampler.generator.get_state()
                self._iter, self._taken = iter(self.loader), 0
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = None
                continue
            self._taken += 1
            return batch

    def regroup(self, micro_batches: int) -> None:
        """Draw the batches of whole optimizer steps of `micro_batches` of the loader's batches each
        (`step_loader`), from where the stream stands: its position (a checkpoint's, loaded before) is
        counted in these batches, as the run that saved it counted them."""
        if micro_batches == 1:
            return
        step_batch, samples = self.loader.batch_size * micro_batches, len(self.loader.dataset)
        if step_batch > samples:  # a loader that drops its last partial batch would yield none, ever
            raise UserError(
                f"a step of {step_batch} samples (trainer.batch_size, or trainer.auto_batch.effective_batch) "
                f"is more than the {samples} training samples, and a step's batch is drawn whole (UniFrac "
                "pairs every sample of it): lower it, or give more samples"
            )
        state = self.state_dict()
        self.loader = step_loader(self.loader, micro_batches)
        self.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return {"pass_state": self._pass_state, "taken": self._taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replay the pass from its start: the same shuffle, the batches already trained on skipped."""
        self._iter = None
        if state["pass_state"] is None:
            return
        self.loader.sampler.generator.set_state(state["pass_state"])
        self._pass_state, self._iter = state["pass_state"], iter(self.loader)
        for _ in range(state["taken"]):
            next(self._iter)
        self._taken = state["taken"]
