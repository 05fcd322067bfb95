"""Attention implementation: the written-out math baseline, or F.scaled_dot_product_attention."""

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aamperf.model.layers import MathAttention
from aamperf.phases.record import applied, skipped

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


class SDPAttention(nn.Module):
    """Drop-in for MathAttention: same inputs (q, k, v [N, H, L, d], bool mask: True = may attend)."""

    def __init__(self, dropout_p: float, backends: list[str]):
        super().__init__()
        self.dropout_p = dropout_p
        self.backends = [BACKENDS[b] for b in backends]
        # No CPU kernel of SDPA has dropout: in training it falls back to this same math. Running it
        # here keeps its dropout a module, which the dropout phase can make cheaper.
        self.math = MathAttention(dropout_p)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.training and self.dropout_p > 0 and q.device.type == "cpu":
            return self.math(q, k, v, mask)
        dropout_p = self.dropout_p if self.training else 0.0
        if not self.backends:  # torch picks the fastest kernel that supports the inputs
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        with sdpa_kernel(self.backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def check_attention(cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> list[str]:
    """A restricted backend must run on this device and dtype: try it once on a tiny masked input."""
    if cfg.impl == "math" or not cfg.backends:
        return []
    q = torch.randn(2, 2, 8, 16, device=device, dtype=dtype)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool, device=device)
    try:
        SDPAttention(0.0, list(cfg.backends))(q, q, q, mask)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        return [
            f"attention.backends={[str(b) for b in cfg.backends]} cannot run on {device.type} with {dtype} "
            f"({first}); use attention=sdpa to let torch choose"
        ]
    return []


def apply_attention(model: nn.Module, cfg: DictConfig) -> dict:
    """Replace every MathAttention module of `model` by SDPAttention with the same dropout."""
    if cfg.impl == "math":
        return skipped("attention=math (the written-out baseline)")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, MathAttention):
                setattr(parent, name, SDPAttention(child.dropout_p, list(cfg.backends)))
                swapped += 1
    if not swapped:
        return skipped("the model has no MathAttention module to replace")
    note = "on CPU, training with dropout runs SDPA's own math fallback (no CPU kernel has dropout)"
    return applied(impl="sdpa", backends=list(cfg.backends) or "auto", modules=swapped, note=note)
