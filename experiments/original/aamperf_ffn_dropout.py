"""`python -m aamperf.train ...` with the one dropout the original's transformer layer has and
aamperf's Block lacks: nn.TransformerEncoderLayer computes linear2(dropout(gelu(linear1(x)))), so
every layer draws one more Bernoulli mask, over the [rows, L, 4D] FFN activation. For this study
only (what the recommended model change would cost); the arguments are those of aamperf.train."""

import runpy

from torch import nn

from aamperf.model import layers

block_init = layers.Block.__init__


def original_block_init(self, dim: int, num_heads: int, ffn_mult: int, dropout: float) -> None:
    block_init(self, dim, num_heads, ffn_mult, dropout)
    self.ffn.insert(2, nn.Dropout(dropout))  # Linear, GELU, Dropout, Linear, Dropout


layers.Block.__init__ = original_block_init
runpy.run_module("aamperf.train", run_name="__main__", alter_sys=True)
