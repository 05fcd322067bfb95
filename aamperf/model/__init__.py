"""The AAM workload: model and loss, plus the layers phases act on (attention swap, checkpointing)."""

from aamperf.model.aam import AAM
from aamperf.model.layers import Block, MathAttention, SelfAttention, Transformer
from aamperf.model.loss import AAMLoss
from aamperf.model.masking import nucleotide_mask

__all__ = ["AAM", "AAMLoss", "Block", "MathAttention", "SelfAttention", "Transformer", "nucleotide_mask"]
