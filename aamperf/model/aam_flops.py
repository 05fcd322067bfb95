"""AAM's FLOP counts (`FlopCount`, a part of `aamperf.model.aam.AAM`): the matmuls of a training step, as the
model's math on the real ASVs (model FLOPs) and as the code executes them under the phases (hardware FLOPs:
padding, the rows the ASV encoder runs on, recomputed layers). tests/model/test_flops.py checks them against
torch's FlopCounterMode."""

from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from aamperf.tokens import PAD


def linears(module: nn.Module) -> list[nn.Linear]:
    """The nn.Linear layers of `module`, itself included."""
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


class FlopCount:
    """The FLOP counts of an AAM: reads its sizes (embedding_dim, ffn_mult, seq_len, layers, vocab_size,
    target_dim), its stacks and heads, and how the phases set it up (pack_samples, count_encoded_rows)."""

    @staticmethod
    def real_asvs_per_sample(tokens: Tensor) -> list[int]:
        """Real (not padding) ASVs of each sample of a host batch [B, S, L]."""
        return (tokens != PAD).any(dim=-1).sum(dim=1).tolist()

    def checkpointed_layers(self) -> tuple[int, int, int, int]:
        """Transformer layers of the ASV, sample and encoder stacks, and of the heads' own stacks (the target
        and count heads' transformers), wrapped for activation checkpointing (`aamperf/phases/memory.py`):
        each runs its forward twice (memory=ops's only their cheap ops)."""
        heads = [s for s in (self.target_encoder, self.count_encoder) if s is not None]

        def again(
            stack: nn.Module,
        ) -> int:  # its layers whose matmuls run again in backward (not memory=ops's)
            return sum(
                isinstance(b, CheckpointWrapper) and getattr(b, "recomputes_matmuls", True)
                for b in stack.blocks
            )

        stacks = (self.asv_encoder, self.sample_transformer, self.encoder_transformer)
        return (*(again(s) for s in stacks), sum(again(s) for s in heads))

    def _step_flops(
        self,
        encoded_rows: int,
        widths: list[int],
        count_rows: int,
        recomputed: tuple[int, ...],
        forwards: int = 3,
    ) -> float:
        """Matmul FLOPs of forward + backward (`forwards` x forward: 3, backward being two; 4 where gradient
        caching forwards each micro-batch once more, aamperf/trainer/gradcache.py; 2 FLOPs per multiply-add),
        plus one more forward of each recomputed layer: the ASV encoder and nucleotide head on
        `encoded_rows` rows of seq_len positions, the count embedding on `count_rows` slots, the sample
        encoder over samples of `widths` positions each."""
        dim, length = self.embedding_dim, self.seq_len
        asv_layers, sample_layers, encoder_layers = self.layers
        layer = self.layer_flops
        asv_layer = layer(encoded_rows * length, encoded_rows * length * length)
        sample_layer = layer(sum(widths), sum(w * w for w in widths))
        forward = (
            asv_layers * asv_layer
            + 2 * 2 * encoded_rows * length * dim  # ASV pooling: score Linear(D, 1) and the weighted sum
            + 2 * encoded_rows * length * dim * self.vocab_size  # nucleotide head
            + self.count_embedding_flops(count_rows)
            + (sample_layers + encoder_layers) * sample_layer
            + 2 * 2 * sum(widths) * dim  # sample pooling
            + self.target_head_flops(widths)
            + self.count_head_flops(widths)
        )
        # the heads' stacks run over the sample encoder's positions: a sample layer's FLOPs each
        recompute = recomputed[0] * asv_layer + sum(recomputed[1:]) * sample_layer
        return float(forwards) * forward + recompute

    def count_embedding_flops(self, rows: int) -> int:
        """Forward FLOPs of joining `rows` ASV slots' counts to their vectors (0 without): the count's Linear
        (1 to D, or to 2D for film), and concat's Linear(2D, D)."""
        layers = [m for m in (self.count_embedding, self.count_projection) if m is not None]
        return 2 * rows * sum(m.in_features * m.out_features for m in layers)

    def layer_flops(self, tokens: int, squares: int) -> int:
        """Forward FLOPs of one transformer layer over `tokens` positions, `squares` = sum of each sequence's
        positions^2."""
        dim, f = self.embedding_dim, self.ffn_mult
        proj = 2 * tokens * dim * (3 * dim + dim + 2 * f * dim)  # qkv, out, FFN up + down
        attn = 2 * 2 * squares * dim  # q k^T and weights @ v, all heads: positions^2 per sequence
        return proj + attn

    def target_head_flops(self, widths: list[int]) -> int:
        """Forward FLOPs of the target head (0 when absent) on samples of `widths` real ASVs each: its Linear,
        the categorical conditioning (concat's Linear((1 + columns) x D, D), gmu's gate of that size and its
        Linear(columns x D, D), cross_attention's Linear(columns x D, D); lookups, add's sums and the
        LayerNorm are no matmuls) on each sample's embedding, or for the transformer head on each ASV's
        state, and that head's layers and pooling."""
        if self.target_head is None:
            return 0
        dim, samples = self.embedding_dim, len(widths)
        # its Linear, or every Linear of its MLP (aamperf/model/layers.py MLP)
        linear = 2 * samples * sum(m.in_features * m.out_features for m in linears(self.target_head))
        conditioned = samples if self.target_encoder is None else sum(widths)
        fusion = (
            self.categorical_projection,
            self.categorical_gate,
            self.categorical_transform,
            self.categorical_update,
        )
        condition = 2 * conditioned * sum(m.in_features * m.out_features for m in fusion if m is not None)
        if self.target_encoder is None:
            return linear + condition
        layers = len(self.target_encoder.blocks) * self.layer_flops(sum(widths), sum(w * w for w in widths))
        return linear + condition + layers + 2 * 2 * sum(widths) * dim  # + the target pooling

    def count_head_flops(self, widths: list[int]) -> int:
        """Forward FLOPs of the count head (0 when absent) on samples of `widths` ASVs each: its layers over
        each sample's ASVs and its Linear(D, 1) on each ASV's state."""
        if self.count_head is None:
            return 0
        layers = len(self.count_encoder.blocks) * self.layer_flops(sum(widths), sum(w * w for w in widths))
        return layers + 2 * sum(widths) * self.embedding_dim

    def flops_per_step(
        self,
        batch_size: int,
        n_asvs: int,
        encoded_rows: int | None = None,
        recomputed: tuple[int, ...] = (0, 0, 0, 0),
        forwards: int = 3,
    ) -> float:
        """Hardware FLOPs: the matmuls this code executes in one training step on a [batch_size, n_asvs,
        seq_len] batch. `encoded_rows`: the rows the ASV encoder and nucleotide head run on
        (`count_encoded_rows`; default all batch_size * n_asvs); the sample encoder runs over the padded
        width n_asvs; `recomputed`: checkpointed layers per stack (`checkpointed_layers`); `forwards`: as
        `_step_flops` counts them."""
        rows = batch_size * n_asvs
        encoded = rows if encoded_rows is None else encoded_rows
        return self._step_flops(encoded, [n_asvs] * batch_size, rows, recomputed, forwards)

    def model_flops_per_step(self, asvs_per_sample: list[int]) -> float:
        """Model FLOPs: the model's math on the real ASVs of a batch (`real_asvs_per_sample`), the same
        whatever the configuration: every real ASV slot encoded (a repeated ASV counts once per slot),
        each sample's encoder over its own ASVs only, no padding, no recomputation."""
        return self._step_flops(
            sum(asvs_per_sample), list(asvs_per_sample), sum(asvs_per_sample), (0, 0, 0, 0)
        )

    def batch_flops(
        self, tokens: Tensor, asv_ids: Tensor | None = None, forwards: int = 3
    ) -> tuple[float, float]:
        """(model, hardware) FLOPs of one training step on this host batch, as the model is now set up;
        `forwards` (hardware only): 4 where gradient caching forwards the batch twice."""
        batch, n_asvs = tokens.shape[:2]
        real = self.real_asvs_per_sample(tokens)
        model = self.model_flops_per_step(real)
        encoded = self.count_encoded_rows(tokens, asv_ids)
        if self.pack_samples:  # the sample level over each sample's real ASVs, as the model FLOPs count it
            return model, self._step_flops(encoded, real, sum(real), self.checkpointed_layers(), forwards)
        return model, self.flops_per_step(batch, n_asvs, encoded, self.checkpointed_layers(), forwards)
