"""The categorical conditioning of AAM's target head (data.categorical), a mixin of `AAM` as its FLOP count
is: each column's embedding table (row 0, unseen or missing, a zero vector), their fusion into what the head
reads (`condition`: concat, add, gmu or cross_attention) and the output's scale and bias per category
(`scaled`). Its modules keep AAM's attribute names (model.pt's keys, aamperf/finetune.py's FRESH, the
optimizer's categorical_lr)."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class Conditioning:
    """`build_conditioning` in AAM.__init__ (where the modules were always made: the parameters' order and
    their random init unchanged), `reset_conditioning` after its weight init."""

    def build_conditioning(
        self,
        dim: int,
        target_dim: int,
        categorical_sizes: Sequence[int],
        fusion: str,
        categorical_dim: int | None,
        output_scaling: bool,
    ) -> None:
        self.categorical_fusion = fusion
        # each column's embedding width: categorical_dim (the original AAM's --categorical-embed-dim), or D
        width = dim if categorical_dim is None else categorical_dim
        self.categorical_embeddings = nn.ModuleList(
            nn.Embedding(n + 1, width, padding_idx=0) for n in categorical_sizes
        )
        columns = len(categorical_sizes) * width
        concat = categorical_sizes and fusion == "concat"
        self.categorical_projection = nn.Linear(dim + columns, dim) if concat else None
        # gmu: the original AAM's gated unit, x + sigmoid(gate [x, c]) * tanh(transform c) (`condition`)
        gmu = categorical_sizes and fusion == "gmu"
        self.categorical_gate = nn.Linear(dim + columns, dim) if gmu else None
        self.categorical_transform = nn.Linear(columns, dim) if gmu else None
        # cross_attention: the original AAM's, whose attention over one key (the metadata) is the same update
        # at every position: LayerNorm(x + Linear c) (`condition`)
        attend = categorical_sizes and fusion == "cross_attention"
        self.categorical_update = nn.Linear(columns, dim) if attend else None
        self.categorical_norm = nn.LayerNorm(dim) if attend else None
        # output scaling: each column's scale and bias of the target output per category (the original
        # AAM's --conditional-output-scaling), 1 and 0 at first (`scaled`)
        scaled = output_scaling and target_dim > 0
        self.output_scales = nn.ModuleList(
            nn.Embedding(n + 1, target_dim) for n in categorical_sizes if scaled
        )
        self.output_biases = nn.ModuleList(
            nn.Embedding(n + 1, target_dim) for n in categorical_sizes if scaled
        )

    def reset_conditioning(self) -> None:
        """Slot 0's zero rows (padding_idx's, which a weight init draws over) and the scaling's identity."""
        with torch.no_grad():
            for table in self.categorical_embeddings:
                table.weight[0].zero_()
            for scale, bias in zip(self.output_scales, self.output_biases, strict=True):
                scale.weight.fill_(1.0)
                bias.weight.zero_()

    def condition(self, sample_embedding: Tensor, categorical: Tensor | None) -> Tensor:
        """The sample embeddings [B, D] the target head reads: with categorical columns, fused with each
        column's embedding of the samples' categories `categorical` [B, columns] (index 0: unseen or
        missing, a zero vector): `concat` [sample, columns...] -> Linear -> D, `add` their sum, `gmu`
        (the original's gated unit) x + sigmoid(Linear [x, c]) * tanh(Linear c), c the columns side by side,
        or `cross_attention` LayerNorm(x + Linear c): the original's cross-attention of each position to the
        metadata, one key, so its softmax is 1 everywhere and the update the same at every position.
        Only the target head reads them, as in the original AAM (its `_fuse_categorical` feeds the target
        pathway alone): the embedding UniFrac and predict's embeddings.tsv see stays the encoder's. The
        transformer head fuses each ASV's state the same way: [..., D] states with [..., columns] categories
        that broadcast to them ([B, 1, columns] padded, [T, columns] packed)."""
        if not len(self.categorical_embeddings):
            return sample_embedding
        if categorical is None:
            raise ValueError(
                f"the model is conditioned on {len(self.categorical_embeddings)} categorical columns: pass "
                "categorical=[B, columns] (the batch's `categorical`, data.categorical)"
            )
        columns = [table(categorical[..., i]) for i, table in enumerate(self.categorical_embeddings)]
        if self.categorical_fusion == "add":
            return sample_embedding + sum(columns)
        columns = [c.to(sample_embedding.dtype).expand(*sample_embedding.shape[:-1], -1) for c in columns]
        fused = torch.cat([sample_embedding, *columns], dim=-1)
        if self.categorical_projection is not None:  # concat
            return self.categorical_projection(fused)
        if self.categorical_update is not None:  # cross_attention
            return self.categorical_norm(
                sample_embedding + self.categorical_update(torch.cat(columns, dim=-1))
            )
        gate = torch.sigmoid(self.categorical_gate(fused))
        return sample_embedding + gate * torch.tanh(self.categorical_transform(torch.cat(columns, dim=-1)))

    def scaled(self, target: Tensor, categorical: Tensor | None) -> Tensor:
        """The target output [B, target_dim] x each column's scale of the samples' categories, + its bias, a
        column after another (categorical_output_scaling: the original AAM's --conditional-output-scaling,
        before the activation as its); slot 0, unseen or missing, has its own. As it is without scaling."""
        for i, (scale, bias) in enumerate(zip(self.output_scales, self.output_biases, strict=True)):
            slot = categorical[:, i]
            target = target * scale(slot).to(target.dtype) + bias(slot).to(target.dtype)
        return target
