"""AAM (Attention All Microbes): nucleotides -> ASV vectors -> sample embedding (its FLOP count:
aamperf/model/aam_flops.py)."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from aamperf.model.aam_arguments import TARGET_ACTIVATIONS, argument_problems
from aamperf.model.aam_flops import FlopCount
from aamperf.model.conditioning import Conditioning
from aamperf.model.layers import MLP, AttentionPooling, Transformer
from aamperf.model.packed import Packing
from aamperf.model.slots import SlotIndex, bucket_size, first_slots
from aamperf.tokens import PAD, TOKENS_PER_ASV, VOCAB_SIZE

ASV_ROWS = ("all", "real", "unique")  # which ASV rows the ASV encoder runs on (`AAM.asv_rows`)


class AAM(FlopCount, Conditioning, nn.Module):
    """Hierarchical transformer: an ASV encoder over the bases of every ASV, then a sample encoder
    over the ASVs of every sample. Heads: nucleotide logits per position, optional target.

    forward(tokens [B, S, L] long, counts [B, S, 1] float, asv_ids [B, S] long or None) -> dict with
      `sample_embedding` [B, D], `asv_embedding` [B, S, D] (ASV encoder output, 0 on padding ASVs),
      `nuc_logits` [B, S, L, vocab_size] (0 on padding ASVs), and `target` [B, target_dim] when
      target_dim > 0. `asv_ids` (the batch's global ASV index per slot, -1 on padding) is only read
      when `asv_rows == "unique"`. forward(sample_embedding=[B, D]) runs the heads alone on given
      embeddings (a frozen encoder's, cached): `sample_embedding` and `target`. With `categorical_sizes`
      (data.categorical: categories per column), `categorical` [B, columns] long (0: unseen or missing) is
      fused into the embedding the target head reads (`condition`), in either call.

    `target_head` picks what the target head reads: "linear" (the default) a Linear on the sample embedding;
    "transformer" (the original AAM's) a fresh transformer of `target_layers` layers over the sample encoder's
    per-ASV states (categorical columns fused into each ASV's), an attention pooling, then the Linear. With
    `keep_states` set (by the cache of a frozen encoder, while it embeds), the outputs add `asv_states`
    [B, S, D] (those states, 0 on padding ASVs) and `asv_real` [B, S] bool: forward(sample_embedding=,
    asv_states=, asv_real=) runs the heads on them. A training step does not copy them.

    `target_hidden_dims` (the original's --regressor-hidden-dims): the target head's Linear becomes an MLP of
    those widths (ReLU, and Dropout of `target_dropout` after each), plus a Linear of its input with
    `target_residual` (`layers.MLP`).

    `count_head` (the original AAM's count prediction, on by default in its `aam train`): a transformer of
    `count_layers` layers (None: `sample_layers`, as the original's) over the sample encoder's per-ASV
    states, then Linear(D, 1) and a sigmoid: the outputs add `count` [B, S], each ASV's predicted count
    scaled to [0, 1] (0 on padding ASVs), which AAMLoss's `count` part fits. It reads states a cache of
    sample embeddings does not keep: forward on given embeddings outputs no `count`.

    Set by `aamperf/phases/aam_ops.py`, none changing the outputs (up to fp32 rounding):
    `pack_samples`: the sample level runs on each sample's real ASVs packed along one axis
    (`aamperf/model/packed.py`: variable-length attention) instead of the batch padded to its width;
    `unmasked_asvs`: the ASV encoder attends and pools with no mask (SDPA's fused kernels apply), for
    data whose every ASV is full length, no PAD inside (`full_length_asvs`, set from the data).
    `slots` (a `SlotIndex`, from the collate through the loss): the real slots and distinct ASVs found on
    the host; without it forward finds them on the tokens' device (two host syncs on a GPU).

    `asv_rows` (set by `aamperf/phases/aam_ops.py`) picks the rows the ASV encoder runs on; the
    outputs are the same in every mode (up to fp32 rounding):
      "real"   only the real rows, gathered, encoded, scattered back into zero-filled tensors: what the
               original AAM does (its ASV transformer skips rows that are all padding); the default;
      "all"    every one of the B*S rows, padding included (static shapes; no level uses it: the cost
               the original avoids, kept as the reference the other modes are tested against);
      "unique" each distinct ASV of the batch once, its results copied to every slot that holds it.
               Exact only if an ASV's (masked) tokens are the same in every slot: AAMLoss masks per ASV.
    """

    takes_slots = True  # forward(slots=): the loss passes the collate's SlotIndex

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
        vocab_size: int = VOCAB_SIZE,
        seq_len: int = TOKENS_PER_ASV,
        target_dim: int = 1,
        count_embedding: bool = True,
        categorical_sizes: Sequence[int] = (),
        categorical_fusion: str = "concat",
        target_head: str = "linear",
        target_layers: int = 1,
        target_activation: str = "none",
        count_head: bool = False,
        count_layers: int | None = None,
        target_hidden_dims: Sequence[int] = (),
        target_dropout: float = 0.0,
        target_residual: bool = False,
        count_embedding_method: str = "add",
        categorical_output_scaling: bool = False,
        categorical_dim: int | None = None,
    ):
        problems = argument_problems({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        if problems:
            raise ValueError("; ".join(problems))
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
        # each ASV's log(1 + count), joined to its vector by count_embedding_method (`with_counts`)
        self.count_method = count_embedding_method
        width = 2 * dim if count_embedding_method == "film" else dim
        self.count_embedding = nn.Linear(1, width) if count_embedding else None
        self.count_projection = (
            nn.Linear(2 * dim, dim) if count_embedding and count_embedding_method == "concat" else None
        )
        self.asv_position = nn.Embedding(max_asvs, dim)
        self.sample_transformer = Transformer(dim, num_heads, sample_layers, ffn_mult, dropout)
        self.encoder_transformer = Transformer(dim, num_heads, encoder_layers, ffn_mult, dropout)
        self.sample_pool = AttentionPooling(dim)
        self.target_head = None  # a Linear, or an MLP of target_hidden_dims (the original's regressor head)
        if target_dim > 0:
            hidden = list(target_hidden_dims)
            self.target_head = (
                MLP(dim, target_dim, hidden, target_dropout, target_residual)
                if hidden
                else nn.Linear(dim, target_dim)
            )
        self.target_activation = TARGET_ACTIVATIONS[target_activation]
        # target_head=transformer: the head's own stack and pooling over the per-ASV states
        self.target_encoder = self.target_pool = None
        if target_dim > 0 and target_head == "transformer":
            self.target_encoder = Transformer(dim, num_heads, target_layers, ffn_mult, dropout)
            self.target_pool = AttentionPooling(dim)
        # count_head: each ASV's count predicted from its state (the original's count_encoder + count_head)
        count_layers = sample_layers if count_layers is None else count_layers
        self.count_encoder = (
            Transformer(dim, num_heads, count_layers, ffn_mult, dropout) if count_head else None
        )
        self.count_head = nn.Linear(dim, 1) if count_head else None
        self.keep_states = False  # output the per-ASV states too (aamperf/trainer/cached.py, embedding)
        # categorical conditioning of the target head (aamperf/model/conditioning.py)
        self.build_conditioning(
            dim,
            target_dim,
            categorical_sizes,
            categorical_fusion,
            categorical_dim,
            categorical_output_scaling,
        )
        self.apply(self._init_weights)
        self.reset_conditioning()  # after the init: slot 0's zero rows, the output scaling's identity
        self.asv_rows = "real"  # one of ASV_ROWS; set by the aam_ops phase, before any wrapper
        self.bucket_rows = False  # pad the encoded rows to `bucket_size` (aam_ops.bucket)
        self.pack_samples = False  # the sample level on the real ASVs, packed (aam_ops.pack_samples)
        # every ASV row of the data is full length (no PAD inside): set by the job from its data's token
        # table, once; no batch is checked (that would be a host sync per step)
        self.full_length_asvs = False
        self.unmasked_asvs = False  # the ASV encoder without masks (aam_ops.unmask_full_length)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # small normal init, as in GPT-2 / nanoGPT; LayerNorms keep PyTorch's (1, 0)
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        tokens: Tensor | None = None,
        counts: Tensor | None = None,
        asv_ids: Tensor | None = None,
        sample_embedding: Tensor | None = None,
        categorical: Tensor | None = None,
        asv_states: Tensor | None = None,
        asv_real: Tensor | None = None,
        slots: SlotIndex | None = None,
    ) -> dict[str, Tensor]:
        if sample_embedding is not None:  # a frozen encoder's, computed once (aamperf/trainer/cached.py)
            if self.target_encoder is not None and (asv_states is None or asv_real is None):
                raise ValueError(
                    "model.target_head=transformer reads the per-ASV states: pass asv_states=[B, S, D] and "
                    "asv_real=[B, S] with sample_embedding (a cache of the model's own outputs)"
                )
            states = None if self.target_encoder is None else self.packed(asv_states, asv_real)
            return self.heads(sample_embedding, categorical, states)
        batch, n_asvs, length = tokens.shape
        if n_asvs > self.max_asvs or length > self.seq_len:
            raise ValueError(
                f"batch has {n_asvs} ASVs x {length} bases but the model holds at most "
                f"{self.max_asvs} x {self.seq_len}: raise model.max_asvs / model.seq_len"
            )
        real_asv = (tokens != PAD).any(dim=-1)  # [B, S]; an all-padding row is a padding ASV
        rows = None  # the real slots, in [0, B*S): where the ASV encoder or the packing needs them
        # the collate's index in buckets (`bucketed`): its sinks, rows past the batch's slots, to be dropped
        sinks = slots is not None and slots.n_real is not None
        if slots is not None:  # found by the collate, on the host
            rows = slots.real
        elif self.asv_rows != "all" or self.pack_samples:
            # host sync: nonzero sizes its output. Worth it: every padding row skipped saves a transformer
            # pass over L positions, far more than the device idles while the queue drains
            rows = real_asv.reshape(-1).nonzero().squeeze(1)
        distinct = None if slots is None else (slots.first, slots.inverse)
        asv, nuc_logits = self.encode_asvs(tokens, real_asv, asv_ids, rows, distinct, sinks)

        if self.pack_samples:  # the real slots only, each sample's after the other's: [T, D]
            rows = rows[: slots.n_real] if sinks else rows  # packed: R rows, whatever the buckets
            packing = Packing.from_slots(rows, batch, n_asvs)
            x, position = asv.reshape(batch * n_asvs, -1)[rows], self.asv_position.weight[rows % n_asvs]
            counts = counts.reshape(batch * n_asvs, 1)[rows]
        else:  # padding ASVs are masked as keys, so they cannot reach the real ones
            packing = real_asv
            x, position = asv, self.asv_position.weight[:n_asvs]
        if self.count_embedding is None:
            h = x + position
        elif self.count_method == "add":  # (vector + position) + counts: the sums every run before made
            h = self.with_counts(x + position, counts)
        else:  # the original's order: the counts joined to the ASV vector, then its slot's position added
            h = self.with_counts(x, counts) + position
        h = self.sample_transformer(h, packing)
        h = self.encoder_transformer(h, packing)
        sample = self.sample_pool(h, packing)
        out = {"sample_embedding": sample, "asv_embedding": asv, "nuc_logits": nuc_logits}
        if self.keep_states and self.target_encoder is not None:  # the head's input, padded, for a cache
            if self.pack_samples:
                padded = h.new_zeros(batch * n_asvs, h.size(-1)).index_copy(0, rows, h)
                out.update(asv_states=padded.view(batch, n_asvs, -1), asv_real=real_asv)
            else:
                out.update(asv_states=h * real_asv[..., None].to(h.dtype), asv_real=real_asv)
        if self.count_head is not None:
            out["count"] = self.predict_counts(h, packing, rows, (batch, n_asvs))
        return {**out, **self.heads(sample, categorical, (h, packing))}

    def with_counts(self, h: Tensor, counts: Tensor) -> Tensor:
        """ASV vectors h [..., D] joined with their counts [..., 1] by `count_method` (`COUNT_METHODS`)."""
        c = self.count_embedding(torch.log1p(counts.to(h.dtype)))
        if self.count_method == "add":
            return h + c
        if self.count_method == "concat":
            return self.count_projection(torch.cat([h, c.to(h.dtype)], dim=-1))
        scale, shift = c.chunk(2, dim=-1)  # film: a scale around 1 and a shift around 0
        return h * (1 + scale) + shift

    def predict_counts(
        self, h: Tensor, packing: Tensor | Packing, rows: Tensor | None, shape: tuple[int, int]
    ) -> Tensor:
        """The count head on the sample encoder's per-ASV states `h` ([B, S, D] padded, `packing` the real
        ASVs [B, S]; or [T, D] packed, `rows` their slots in [0, B*S)) -> [B, S] in (0, 1), 0 on padding."""
        count = torch.sigmoid(self.count_head(self.count_encoder(h, packing))).squeeze(-1)
        if isinstance(packing, Packing):  # the real slots' back into the batch's
            return count.new_zeros(shape[0] * shape[1]).index_copy(0, rows, count).view(shape)
        return count * packing.to(count.dtype)

    def packed(self, asv_states: Tensor, asv_real: Tensor) -> tuple[Tensor, Tensor | Packing]:
        """Per-ASV states [B, S, D] and which are real [B, S] as the sample level lays them out: packed
        ([T, D] and their Packing) under `pack_samples`, else as given."""
        if not self.pack_samples:
            return asv_states, asv_real
        batch, n_asvs = asv_real.shape
        rows = asv_real.reshape(-1).nonzero().squeeze(1)  # host sync, as forward's
        return asv_states.reshape(batch * n_asvs, -1)[rows], Packing.from_slots(rows, batch, n_asvs)

    def heads(
        self, sample_embedding: Tensor, categorical: Tensor | None = None,
        states: tuple[Tensor, Tensor | Packing] | None = None,
    ) -> dict[str, Tensor]:  # fmt: skip
        """The outputs of sample embeddings [B, D]: themselves, and the target head's where there is one (on
        the embeddings conditioned on the samples' `categorical` [B, columns], `condition`). The transformer
        head reads `states`: the per-ASV states and which are real ([B, S, D] and [B, S] bool, or [T, D] and
        their Packing)."""
        out = {"sample_embedding": sample_embedding}
        if self.target_head is None:
            return out
        if self.target_encoder is None:
            target = self.target_head(self.condition(sample_embedding, categorical))
            out["target"] = self.activated(self.scaled(target, categorical))
            return out
        h, real = states
        if isinstance(real, Packing):  # each packed ASV's sample's categories
            conditioned = self.condition(h, None if categorical is None else categorical[real.segment])
        else:
            conditioned = self.condition(h, None if categorical is None else categorical[:, None, :])
        pooled = self.target_pool(self.target_encoder(conditioned, real), real)
        out["target"] = self.activated(self.scaled(self.target_head(pooled), categorical))
        return out

    def activated(self, target: Tensor) -> Tensor:
        """The target head's output through `target_activation` (a regression's: learn_target refuses one
        for a classification's logits)."""
        return target if self.target_activation is None else self.target_activation(target)

    def encode_asvs(
        self,
        tokens: Tensor,
        real_asv: Tensor,
        asv_ids: Tensor | None = None,
        rows: Tensor | None = None,
        distinct: tuple[Tensor, Tensor] | None = None,
        sinks: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """tokens [B, S, L], real_asv [B, S] bool -> ASV vectors [B, S, D] and nucleotide logits
        [B, S, L, vocab_size], both 0 on padding rows; `self.asv_rows` picks the rows encoded. `rows`:
        the real slots (`real_asv.reshape(-1).nonzero()`), where the caller has them; `distinct`: the
        (first, inverse) of `first_slots` over their ASVs, where the caller found them on the host;
        `sinks`: they are `bucketed`, padded with slots past the batch's."""
        batch, n_asvs, length = tokens.shape
        flat, real = tokens.reshape(-1, length), real_asv.reshape(-1)
        if self.asv_rows == "all":
            # every row, padding included: shapes fixed by the batch, padding paid for
            asv, logits = self._encode_rows(flat)
            keep = real.to(asv.dtype)
            asv, logits = asv * keep[:, None], logits * keep[:, None, None].to(logits.dtype)
            return asv.view(batch, n_asvs, -1), logits.view(batch, n_asvs, length, -1)
        if self.asv_rows not in ASV_ROWS:
            raise ValueError(f"model.asv_rows={self.asv_rows!r} is not one of {ASV_ROWS}: fix aam_ops.*")
        if self.asv_rows == "unique" and asv_ids is None:
            raise ValueError(
                "model.asv_rows='unique' (aam_ops.dedup=true) needs the batch's asv_ids: pass them "
                "(the data pipeline's batches have them) or set aam_ops.dedup=false"
            )

        if rows is None:  # host sync: as in forward, for the same reason
            rows = real.nonzero().squeeze(1)  # slots of the real ASVs, in [0, B*S)
        n_slots = batch * n_asvs
        if self.asv_rows == "real":  # `bucketed`'s sinks (rows from n_slots on) encode any row's tokens
            asv, logits = self._encode_rows(flat[rows.clamp(max=n_slots - 1) if sinks else rows])
        else:
            if distinct is not None:
                first, inverse = distinct
            else:
                # host sync: it comes right after the nonzero, with nothing queued in between, so it costs
                # a round trip, not a second drain; it saves one encoder pass per repeated ASV (the
                # samples of a batch share many)
                first, inverse = first_slots(asv_ids.reshape(-1)[rows])
            asv, logits = self._encode_rows(flat[rows[first]])
            asv, logits = asv[inverse], logits[inverse]  # distinct ASVs -> every real slot holding one
        # scatter the real slots back into zero-filled [B*S, ...] tensors (index_copy: differentiable); sinks
        # land in rows past them, dropped (B*S + len(rows) rows: a size the buckets fix)
        n_rows = n_slots + len(rows) if sinks else n_slots
        asv = asv.new_zeros(n_rows, asv.size(-1)).index_copy(0, rows, asv)[:n_slots]
        logits = logits.new_zeros(n_rows, length, logits.size(-1)).index_copy(0, rows, logits)[:n_slots]
        return asv.view(batch, n_asvs, -1), logits.view(batch, n_asvs, length, -1)

    def _encode_rows(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The ASV encoder on [N, L] token rows -> (pooled vectors [N, D], nucleotide logits [N, L, V]).
        With `bucket_rows`, all-padding rows are appended up to `bucket_size(N)` and their results
        dropped: each row is encoded on its own, so the real rows' results are unchanged."""
        if self.bucket_rows and bucket_size(len(tokens)) > len(tokens):
            n = len(tokens)
            padded = torch.cat([tokens, tokens.new_full((bucket_size(n) - n, tokens.size(1)), PAD)])
            asv, logits = self._encode_rows_as_given(padded)
            return asv[:n], logits[:n]
        return self._encode_rows_as_given(tokens)

    def _encode_rows_as_given(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        # unmasked: no PAD inside a real row, and a padding row's results are dropped or zeroed
        real_base = None if self.unmasked_asvs else tokens != PAD
        x = self.token_embedding(tokens) + self.base_position.weight[: tokens.size(1)]
        x = self.asv_encoder(x, real_base)
        return self.asv_pool(x, real_base), self.nuc_head(x)

    def count_encoded_rows(self, tokens: Tensor, asv_ids: Tensor | None = None) -> int:
        """Rows the ASV encoder runs on for this batch under `self.asv_rows` (for the FLOP count).
        Call it on the host copy of the batch: on a GPU tensor it would be a device sync."""
        batch, n_asvs = tokens.shape[:2]
        if self.asv_rows == "all":
            return batch * n_asvs
        real = (tokens != PAD).any(dim=-1)
        rows = int(asv_ids[real].unique().numel()) if self.asv_rows == "unique" else int(real.sum())
        return bucket_size(rows) if self.bucket_rows else rows
