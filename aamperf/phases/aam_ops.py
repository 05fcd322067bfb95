"""AAM-specific work: pad each batch to its longest sample; run the ASV encoder once per distinct ASV;
pack the sample level; drop the ASV encoder's masks where no ASV has padding inside.

plain is the original AAM: every batch padded to data.max_asvs, the ASV encoder on the real rows only
(`AAM.asv_rows = "real"`: the original skips rows that are all padding). Both options are exact (same
embeddings, loss and gradients as plain, up to fp32 rounding):
- skip_padding: the collate pads a batch to its longest sample instead of data.max_asvs, which
  shortens the sample encoder and the nucleotide head's padding rows.
- dedup: the ASV encoder runs once per distinct ASV of the batch (`AAM.asv_rows = "unique"`). It
  needs the batch's `asv_ids` and a mask drawn per ASV (AAMLoss).
- bucket: the encoded rows, and under skip_padding the batch's width, rounded up to a ladder of
  sizes (`aamperf.model.slots.bucket_size`, < 25% padding): a handful of shapes instead of one per batch,
  so a compiled graph is reused and the allocator reuses its blocks instead of growing. Exact too.
- pack_samples: the sample level runs on each sample's real ASVs packed along one axis, with
  variable-length attention (`aamperf/model/packed.py`: nested jagged tensors + SDPA, CUDA's
  varlen_attn in fp16/bf16 without dropout) and pooling over each sample's own ASVs, instead of on the
  batch padded to its width. Exact. Its attention is SDPA's whatever `attention` says (the written-out
  math has no variable-length form; `attention.backends` does not restrict it). Opt-in: not yet measured
  on a GPU, where it should pay (no padding positions); on a CPU it runs SDPA sample by sample.
- unmask_full_length: where every ASV of the data is full length (no PAD inside: `AAM.full_length_asvs`,
  set from the data's token table), the ASV encoder attends and pools with no mask, so SDPA may use its
  flash / memory-efficient kernels and no attention adds a mask; masks kept (recorded why) where the data
  has shorter ASVs. Exact. In `fast`: 1.08x [1.06, 1.11] `optim=advanced`'s samples/s at the headline
  shapes on a 2-core AVX-512 BF16 EPYC (experiments/unmasked/).
"""

import logging

from omegaconf import DictConfig
from torch import Tensor, nn

from aamperf.phases.record import applied, skipped
from aamperf.tokens import PAD

log = logging.getLogger(__name__)


def asv_rows(cfg: DictConfig) -> str:
    """The `AAM.asv_rows` mode the aam_ops node asks for."""
    if cfg.dedup:
        return "unique"
    return "real"  # the original's: padding rows are never encoded


def set_full_length(model: nn.Module, token_table: Tensor) -> None:
    """Tell the AAM `model` whether every ASV of its data is full length (no PAD inside a row of the data's
    token table [n_asvs, L]): once per run, on the host, so that no step has to check its batch."""
    if hasattr(model, "full_length_asvs"):
        model.full_length_asvs = bool((token_table != PAD).all())


def unmask_for(model: nn.Module, cfg: DictConfig, token_table: Tensor) -> bool:
    """New data for an AAM `model` already set up by apply_aam_ops (prediction's next chunk of samples, with
    its own ASVs): its ASV encoder unmasked where `cfg` (the aam_ops node) asks and every ASV of this token
    table is full length, masked again where one is not. Returns whether it runs unmasked."""
    set_full_length(model, token_table)
    if hasattr(model, "unmasked_asvs"):
        model.unmasked_asvs = bool(cfg.unmask_full_length and model.full_length_asvs)
    return bool(getattr(model, "unmasked_asvs", False))


def apply_aam_ops(model: nn.Module, cfg: DictConfig) -> dict:
    """Set the ASV encoder's row strategy on the AAM `model`. `cfg` is the `aam_ops` node.

    Call it on the bare model, before any wrapper (compile, DDP): it sets attributes of the AAM."""
    if not (cfg.dedup or cfg.skip_padding or cfg.bucket or cfg.pack_samples or cfg.unmask_full_length):
        return skipped("aam_ops=plain", asv_rows=getattr(model, "asv_rows", None))
    if not hasattr(model, "asv_rows"):
        return skipped("model has no ASV encoder (not AAM)", asv_rows=None)
    model.asv_rows, model.bucket_rows = asv_rows(cfg), bool(cfg.bucket)
    model.pack_samples = bool(cfg.pack_samples)
    model.unmasked_asvs = bool(cfg.unmask_full_length and model.full_length_asvs)
    record = applied(asv_rows=model.asv_rows, bucket=model.bucket_rows)
    if cfg.pack_samples:
        record["sample_level"] = "packed"
    if cfg.unmask_full_length:
        record["asv_masks"] = not model.unmasked_asvs
    if cfg.unmask_full_length and not model.unmasked_asvs:
        record["asv_masks_kept"] = "the data has ASVs with PAD inside (under 150 bp, or ambiguous bases)"
        # info, not a warning: `fast` (advanced, ultra) asks on any data, and short ASVs are no error
        log.info("aam_ops.unmask_full_length: %s; the ASV encoder keeps its masks", record["asv_masks_kept"])
    return record


def collate_pad_to(cfg: DictConfig, max_asvs: int) -> int | str | None:
    """`build_data(pad_to=...)`: None (each batch padded to its longest sample) under skip_padding,
    "bucket" (that, rounded up to a bucket size) with bucket too, else max_asvs (every batch
    [B, max_asvs, L], the original fixed shapes)."""
    if cfg.skip_padding:
        return "bucket" if cfg.bucket else None
    return max_asvs
