"""The ViT's self-attention, Softmax(QKᵀ/√d)V (Vaswani et al. 2017): the fused SDPA kernel, or the explicit path
when the weights are asked for (rollout) or for a few tokens on a CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0, return_weights: bool = False, fused: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Softmax(QKᵀ/√d)V over (B, H, N, d); the weights (B, H, N, N) only when asked for (then never ``fused``)."""
    if fused and not return_weights:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p), None
    # (B, H, N, N), scaled in place: one pass less
    weights = torch.matmul(q, k.transpose(-2, -1)).mul_(q.shape[-1] ** -0.5).softmax(dim=-1)
    attended = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return attended @ v, weights


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (parameter names as in timm's ``Attention``)."""

    def __init__(self, dim: int, *, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, fused: bool = True) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.attn_drop, self.fused = attn_drop, fused
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        """Self-attention over the tokens, (B, N, D) -> (B, N, D), without the weights."""
        return self._attend(x, return_weights=False)[0]

    def forward_with_weights(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``forward``, and the attention weights (B, H, N, N), by the explicit Softmax(QKᵀ/√d)V."""
        return self._attend(x, return_weights=True)

    def _attend(self, x: Tensor, *, return_weights: bool) -> tuple[Tensor, Tensor | None]:
        batch, tokens, dim = x.shape  # qkv: (B, N, 3·D) -> (3, B, H, N, d)
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out, weights = scaled_dot_product_attention(*qkv.unbind(0), dropout_p=self.attn_drop if self.training else 0.0,
                                                    return_weights=return_weights, fused=self.fused)
        out = out.transpose(1, 2).reshape(batch, tokens, dim)  # (B, H, N, d) -> (B, N, D)
        return self.proj_drop(self.proj(out)), weights
