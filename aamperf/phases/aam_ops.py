"""AAM-specific work: pad each batch to its longest sample; run the ASV encoder once per distinct ASV.

plain is the original AAM: every batch padded to data.max_asvs, the ASV encoder on the real rows only
(`AAM.asv_rows = "real"`: the original skips rows that are all padding). Both options are exact (same
embeddings, loss and gradients as plain, up to fp32 rounding):
- skip_padding: the collate pads a batch to its longest sample instead of data.max_asvs, which
  shortens the sample encoder and the nucleotide head's padding rows.
- dedup: the ASV encoder runs once per distinct ASV of the batch (`AAM.asv_rows = "unique"`). It
  needs the batch's `asv_ids` and a mask drawn per ASV (AAMLoss).
- bucket: the encoded rows, and under skip_padding the batch's width, rounded up to a ladder of
  sizes (`aamperf.model.aam.bucket_size`, < 25% padding): a handful of shapes instead of one per batch,
  so a compiled graph is reused and the allocator reuses its blocks instead of growing. Exact too.
"""

from omegaconf import DictConfig
from torch import nn

from aamperf.phases.record import applied, skipped


def asv_rows(cfg: DictConfig) -> str:
    """The `AAM.asv_rows` mode the aam_ops node asks for."""
    if cfg.dedup:
        return "unique"
    return "real"  # the original's: padding rows are never encoded


def apply_aam_ops(model: nn.Module, cfg: DictConfig) -> dict:
    """Set the ASV encoder's row strategy on the AAM `model`. `cfg` is the `aam_ops` node.

    Call it on the bare model, before any wrapper (compile, DDP): it sets an attribute of the AAM."""
    if not (cfg.dedup or cfg.skip_padding or cfg.bucket):
        return skipped("aam_ops=plain", asv_rows=getattr(model, "asv_rows", None))
    if not hasattr(model, "asv_rows"):
        return skipped("model has no ASV encoder (not AAM)", asv_rows=None)
    model.asv_rows, model.bucket_rows = asv_rows(cfg), bool(cfg.bucket)
    return applied(asv_rows=model.asv_rows, bucket=model.bucket_rows)


def collate_pad_to(cfg: DictConfig, max_asvs: int) -> int | str | None:
    """`build_data(pad_to=...)`: None (each batch padded to its longest sample) under skip_padding,
    "bucket" (that, rounded up to a bucket size) with bucket too, else max_asvs (every batch
    [B, max_asvs, L], the original fixed shapes)."""
    if cfg.skip_padding:
        return "bucket" if cfg.bucket else None
    return max_asvs
