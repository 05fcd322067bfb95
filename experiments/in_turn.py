"""Two ways of one training step, timed in one process and in turn: a forward + backward of a level's model
on one batch, switching a setting of the built model between steps (a change of machine load falls on both).
Each pair is a setting that keeps the results: the same masks or the same math, so only the time differs.

  mask-threads  the fast dropout's random words drawn on one thread (dropout.threads=1) against the run's
                threads (null): the same masks, from the same seed
  asv-masks     the ASV encoder with its masks (aam_ops.unmask_full_length=false) against without them, on
                data whose ASVs are all full length: the same outputs
  chunk-bytes   the CPU's chunked dropout attention (attention=sdpa in training) in chunks of CHUNK_MIB
                (default 8) MiB of scores against its CHUNK_BYTES: the same math, row for row
  pad-keys      the CPU's chunked dropout attention in bf16 with its softmax rows padded to a multiple of
                PAD_KEYS_TO keys against unpadded (PAD_KEYS_TO=1): the same math, a few weights rounded
                the other way in bf16 (by one unit in the last place)
  mask-cast     the fast dropout's 2-byte multiplier cast from the bool mask (as before 2026-12-06)
                against made from the random int16 in place (`keep_multiplier`): the same multiplier
                (bf16 activations: add precision=bf16 where precision=auto takes fp32)

Usage: LD_PRELOAD=libtcmalloc_minimal.so.4 python experiments/in_turn.py PAIR [PAIRS=20] [overrides]
(tcmalloc preloaded as `system=tuned` runs it; the overrides follow `optim=advanced`, e.g.
`experiment=headline` for the headline's shapes; without one, the default job's).
"""

import os
import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_dir

from aamperf.config import CONF_DIR, register_configs
from aamperf.device import to_device
from aamperf.job import build_job
from aamperf.metrics.host import cpu_description
from aamperf.metrics.timing import StepMeter
from aamperf.phases import attention
from aamperf.phases.dropout import FastDropout, keep_scale
from aamperf.summary import Summary


def mask_threads(model: torch.nn.Module):
    drops = [m for m in model.modules() if isinstance(m, FastDropout)]

    def use(one: bool) -> None:
        for m in drops:
            m.threads = 1 if one else None

    return use, ("dropout.threads=1", "dropout.threads=null")


def asv_masks(model: torch.nn.Module):
    aam = next(m for m in model.modules() if hasattr(m, "unmasked_asvs"))
    assert aam.full_length_asvs, "the data has ASVs shorter than full length: the masks cannot go"

    def use(masked: bool) -> None:
        aam.unmasked_asvs = not masked

    return use, ("aam_ops.unmask_full_length=false", "aam_ops.unmask_full_length=true")


def chunk_bytes(model: torch.nn.Module):
    chunked = any(isinstance(m, attention.SDPAttention) for m in model.modules())
    assert chunked, "no chunked dropout attention here: it runs with attention=sdpa"
    default, other = attention.CHUNK_BYTES, int(float(os.environ.get("CHUNK_MIB", "8")) * 2**20)

    def use(changed: bool) -> None:
        attention.CHUNK_BYTES = other if changed else default

    return use, (f"chunks_of_{other / 2**20:g}_MiB", f"chunks_of_{default / 2**20:g}_MiB")


def pad_keys(model: torch.nn.Module):
    chunked = any(isinstance(m, attention.SDPAttention) for m in model.modules())
    assert chunked, "no chunked dropout attention here: it runs with attention=sdpa"
    default = attention.PAD_KEYS_TO

    def use(unpadded: bool) -> None:
        attention.PAD_KEYS_TO = 1 if unpadded else default

    return use, ("keys_unpadded", f"keys_padded_to_{default}")


class BoolCastDropout(FastDropout):
    """FastDropout as it was: a 2-byte dtype's multiplier cast from the bool mask itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or x.element_size() != 2:
            return super().forward(x)
        keep = self.keep(x)
        return x * keep.to(x.dtype).mul_(keep_scale(self.p, x))


def mask_cast(model: torch.nn.Module):
    drops = [m for m in model.modules() if isinstance(m, FastDropout)]
    assert drops, "no fast dropout here: it runs with dropout=fast"

    def use(bool_cast: bool) -> None:
        for m in drops:
            m.__class__ = BoolCastDropout if bool_cast else FastDropout

    return use, ("bool_mask_cast", "multiplier_from_bits")


PAIRS = {
    "mask-threads": mask_threads,
    "asv-masks": asv_masks,
    "chunk-bytes": chunk_bytes,
    "mask-cast": mask_cast,
    "pad-keys": pad_keys,
}


def main() -> None:
    pair, pairs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["optim=advanced", *sys.argv[3:]])
        job = build_job(cfg, Summary(cfg, StepMeter(0), "process", []))
    model, plan = job.plan.model, job.plan
    use, names = PAIRS[pair](model)
    batch = to_device(next(iter(job.data.train_loader)), job.device)

    def step(first: bool) -> tuple[float, float]:
        use(first)
        torch.manual_seed(0)  # the same dropout masks both ways
        start = time.perf_counter()
        with plan.autocast():
            loss, _ = job.loss_fn(model, batch, 0)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, loss.item()

    losses = step(True)[1], step(False)[1]  # warm-up, and the two ways' losses
    times = {True: [], False: []}
    for i in range(pairs):
        for first in (True, False) if i % 2 == 0 else (False, True):
            times[first].append(step(first)[0])
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    print(f"{cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"losses: {names[0]} {losses[0]!r}, {names[1]} {losses[1]!r}")
    for first, name in ((True, names[0]), (False, names[1])):
        print(f"{name}: median {statistics.median(times[first]):.4f} s a forward + backward")
    print(
        f"{names[0]}'s time over {names[1]}'s: median {statistics.median(ratios):.3f}, "
        f"range {min(ratios):.3f}-{max(ratios):.3f} over {pairs} pairs"
    )


if __name__ == "__main__":
    main()
