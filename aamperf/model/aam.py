"""AAM (Attention All Microbes): nucleotides -> ASV vectors -> sample embedding, plus its FLOP count."""

import torch
from torch import Tensor, nn

from aamperf.model.layers import AttentionPooling, Transformer

PAD, A, C, G, T, START, MASK = range(7)  # token ids, as the data pipeline writes them


class AAM(nn.Module):
    """Hierarchical transformer: an ASV encoder over the bases of every ASV, then a sample encoder
    over the ASVs of every sample. Heads: nucleotide logits per position, optional target.

    forward(tokens [B, S, L] long, counts [B, S, 1] float) -> dict with
      `sample_embedding` [B, D], `asv_embedding` [B, S, D] (ASV encoder output, 0 on padding ASVs),
      `nuc_logits` [B, S, L, vocab_size], and `target` [B, target_dim] when target_dim > 0.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        asv_layers: int,
        sample_layers: int,
        encoder_layers: int,
        max_asvs: int,
        ffn_mult: int = 4,
        dropout: float = 0.1,
        vocab_size: int = 7,
        seq_len: int = 151,
        target_dim: int = 1,
        count_embedding: bool = True,
    ):
        super().__init__()
        dim = embedding_dim
        self.embedding_dim, self.num_heads, self.ffn_mult = dim, num_heads, ffn_mult
        self.layers = (asv_layers, sample_layers, encoder_layers)
        self.max_asvs, self.seq_len = max_asvs, seq_len
        self.vocab_size, self.target_dim = vocab_size, target_dim

        # ASV encoder: bases of one ASV -> one vector
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.base_position = nn.Embedding(seq_len, dim)
        self.asv_encoder = Transformer(dim, num_heads, asv_layers, ffn_mult, dropout)
        self.asv_pool = AttentionPooling(dim)
        self.nuc_head = nn.Linear(dim, vocab_size)

        # sample encoder: ASVs of one sample -> one vector
        self.count_embedding = nn.Linear(1, dim) if count_embedding else None
        self.asv_position = nn.Embedding(max_asvs, dim)
        self.sample_transformer = Transformer(dim, num_heads, sample_layers, ffn_mult, dropout)
        self.encoder_transformer = Transformer(dim, num_heads, encoder_layers, ffn_mult, dropout)
        self.sample_pool = AttentionPooling(dim)
        self.target_head = nn.Linear(dim, target_dim) if target_dim > 0 else None

        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # small normal init, as in GPT-2 / nanoGPT; LayerNorms keep PyTorch's (1, 0)
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor, counts: Tensor) -> dict[str, Tensor]:
        batch, n_asvs, length = tokens.shape
        if n_asvs > self.max_asvs or length > self.seq_len:
            raise ValueError(
                f"batch has {n_asvs} ASVs x {length} bases but the model holds at most "
                f"{self.max_asvs} x {self.seq_len}: raise model.max_asvs / model.seq_len"
            )
        real_base = tokens != PAD  # [B, S, L]
        real_asv = real_base.any(dim=-1)  # [B, S]; an all-padding row is a padding ASV

        # ASV encoder on all B*S rows, padding ASVs included (the baseline's cost; a phase may skip them)
        x = self.token_embedding(tokens.reshape(-1, length)) + self.base_position.weight[:length]
        x = self.asv_encoder(x, real_base.reshape(-1, length))
        nuc_logits = self.nuc_head(x).view(batch, n_asvs, length, self.vocab_size)
        asv = self.asv_pool(x, real_base.reshape(-1, length)).view(batch, n_asvs, -1)
        asv = asv * real_asv.unsqueeze(-1)  # padding ASVs become exact zeros

        # sample encoder; padding ASVs are masked as keys, so they cannot reach the real ones
        h = asv + self.asv_position.weight[:n_asvs]
        if self.count_embedding is not None:
            h = h + self.count_embedding(torch.log1p(counts.to(h.dtype)))
        h = self.sample_transformer(h, real_asv)
        h = self.encoder_transformer(h, real_asv)
        sample = self.sample_pool(h, real_asv)

        out = {"sample_embedding": sample, "asv_embedding": asv, "nuc_logits": nuc_logits}
        if self.target_head is not None:
            out["target"] = self.target_head(sample)
        return out

    def flops_per_step(self, batch_size: int, n_asvs: int) -> float:
        """Matmul FLOPs of one training step (forward + backward = 3 x forward, 2 FLOPs per
        multiply-add) on a [batch_size, n_asvs, seq_len] batch, padding rows included."""
        dim, f, length = self.embedding_dim, self.ffn_mult, self.seq_len
        asv_layers, sample_layers, encoder_layers = self.layers

        def transformer(rows: int, positions: int, layers: int) -> int:
            tokens = rows * positions
            proj = 2 * tokens * dim * (3 * dim + dim + 2 * f * dim)  # qkv, out, FFN up + down
            attn = 2 * 2 * rows * positions * positions * dim  # q k^T and weights @ v, all heads
            return layers * (proj + attn)

        def pool(rows: int, positions: int) -> int:
            return 2 * 2 * rows * positions * dim  # score Linear(D, 1) and the weighted sum

        rows = batch_size * n_asvs
        forward = (
            transformer(rows, length, asv_layers)
            + pool(rows, length)
            + 2 * rows * length * dim * self.vocab_size  # nucleotide head
            + (2 * rows * dim if self.count_embedding is not None else 0)  # Linear(1, D)
            + transformer(batch_size, n_asvs, sample_layers + encoder_layers)
            + pool(batch_size, n_asvs)
            + 2 * batch_size * dim * self.target_dim  # target head (0 when absent)
        )
        return 3.0 * forward
