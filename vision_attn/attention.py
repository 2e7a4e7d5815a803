"""The attention math of both models, in one place.

- Scaled dot-product attention, Softmax(QKᵀ/√d)V (Vaswani et al. 2017), as used by the ViT
  (Dosovitskiy et al. 2020). The fused ``F.scaled_dot_product_attention`` kernel is the default path;
  the explicit path runs only when the caller asks for the attention weights.
- Additive (Bahdanau) attention, e_i = w·tanh(W_a a_i + W_h h), α = softmax(e), as used by the
  "Show, Attend and Tell" soft attention (Xu et al. 2015, §4.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0, return_weights: bool = False, fused: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Softmax(QKᵀ/√d)V over (B, H, N, d) tensors; the weights (B, H, N, N) only when asked for.

    ``fused`` runs ``F.scaled_dot_product_attention`` unless the weights are asked for. ``fused=False`` always
    takes the explicit path: on a CPU with a few tokens it trains faster (17 tokens of 24 dims, forward +
    backward: 4.4 ms against 9.6 ms for the fused kernel, measured on this project's 2-core machine; at 197
    tokens the fused kernel wins).
    """
    if fused and not return_weights:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p), None
    scale = q.shape[-1] ** -0.5
    weights = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)  # (B, H, N, N); scaled in place: one pass less
    weights = weights.softmax(dim=-1)
    attended = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return attended @ v, weights


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (parameter names as in timm's ``Attention``)."""

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        fused: bool = True,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.fused = fused
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        batch, tokens, dim = x.shape
        # (B, N, 3·D) -> (3, B, H, N, d)
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        dropout_p = self.attn_drop if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, return_weights=return_weights,
                                                    fused=self.fused)
        out = out.transpose(1, 2).reshape(batch, tokens, dim)  # (B, H, N, d) -> (B, N, D)
        return self.proj_drop(self.proj(out)), weights


class AdditiveAttention(nn.Module):
    """Bahdanau attention over a set of annotation vectors a_i ∈ R^D, queried by a hidden state h.

    The projection W_a a_i does not depend on the query, so ``project_annotations`` computes it once per
    image and ``forward`` reuses it at every decoding step.

    With ``coverage`` the score also reads how much attention each location has had so far,
    e_ti = w·tanh(W_a a_i + W_h h + w_c c_ti) with c_t = Σ_{s<t} α_s (Tu et al. 2016, See et al. 2017), so the
    decoder can tell the objects it has described from the ones it has not.

    With ``word_dim`` the query also reads the word just emitted, e_ti = w·tanh(W_a a_i + W_h h + W_y E y_{t-1}):
    the attention then knows what the decoder has just said of the object it is describing (as the attention
    of Anderson et al. 2018 is queried by an LSTM that has read the previous word).
    """

    def __init__(self, annotation_dim: int, query_dim: int, attention_dim: int, *, coverage: bool = False,
                 word_dim: int = 0) -> None:
        super().__init__()
        self.annotation_proj = nn.Linear(annotation_dim, attention_dim)  # W_a
        self.query_proj = nn.Linear(query_dim, attention_dim)  # W_h
        self.score = nn.Linear(attention_dim, 1)  # w
        self.coverage_proj = nn.Linear(1, attention_dim, bias=False) if coverage else None  # w_c
        self.word_proj = nn.Linear(word_dim, attention_dim, bias=False) if word_dim else None  # W_y

    def project_annotations(self, annotations: Tensor) -> Tensor:
        """W_a a_i for all i: (B, L, D) -> (B, L, A)."""
        return self.annotation_proj(annotations)

    # The tanh term is a (B, L, A) temporary at every step: 128 MB for a beam of 5 over 64 COCO images. When
    # no gradient is needed, rows are taken in chunks of at most this many elements, so it stays in cache
    # instead of being re-allocated. Training keeps one piece: autograd saves every chunk anyway, and the
    # backward of each slice would write a zero-filled gradient of the full size.
    chunk_elements = 2**21

    def _scores(self, projected_annotations: Tensor, projected_query: Tensor, out: Tensor | None = None) -> Tensor:
        """e_i = w·tanh(W_a a_i + W_h h) + b, computed as 2w·σ(2x) + (b − Σw), since tanh(x) = 2σ(2x) − 1.

        The same numbers (within float rounding), but faster on a CPU, where PyTorch's tanh is slow: 2.7 ms
        for 2M floats against 0.9 ms for 2σ(2x) − 1 with its extra passes (``python -m benchmarks.profile_step
        activations`` on this project's 2-core machine). The sum, the doubling and σ run in place on a single
        temporary (``out`` when given).
        """
        x = torch.add(projected_annotations, projected_query, out=out).mul_(2.0).sigmoid_()  # σ(2(W_a a_i + W_h h))
        weight, bias = self.score.weight, self.score.bias  # w (1, A), b (1,)
        return F.linear(x, 2.0 * weight, bias - weight.sum()).squeeze(-1)

    def forward(self, projected_annotations: Tensor, query: Tensor, coverage: Tensor | None = None,
                word: Tensor | None = None) -> Tensor:
        """α over the L locations, (B·r, L), for r queries per image (B·r, Q), e.g. the r beams of a search.

        ``projected_annotations`` is (B, L, A) and is shared by the r queries of each image, never copied;
        query row n belongs to image n // r. ``coverage`` (B·r, L) is c_t, needed when built with coverage;
        ``word`` (B·r, E) is E y_{t-1}, needed when built with ``word_dim``.
        """
        batch, locations, width = projected_annotations.shape
        if query.shape[0] % batch:
            raise ValueError(f"{query.shape[0]} queries for {batch} images: expected a multiple")
        per_image = query.shape[0] // batch
        projected_query = self.query_proj(query)  # W_h h, (B·r, A)
        if self.word_proj is not None:
            if word is None:
                raise ValueError("this attention reads the word just emitted: pass E y_{t-1}")
            projected_query = projected_query + self.word_proj(word)  # W_h h + W_y E y_{t-1}
        projected_query = projected_query.view(batch, per_image, 1, width)  # (B·r, A) -> (B, r, 1, A)
        projected_annotations = projected_annotations.unsqueeze(1)  # W_a a, (B, 1, L, A)
        if self.coverage_proj is not None:
            if coverage is None:
                raise ValueError("this attention reads coverage: pass c_t, the attention summed over past steps")
            # W_h h + w_c c_ti, (B, r, L, A): the query term becomes per location
            projected_query = projected_query + self.coverage_proj(coverage.view(batch, per_image, locations, 1))
        rows = max(1, self.chunk_elements // (per_image * locations * width))
        if batch <= rows or torch.is_grad_enabled() and (projected_annotations.requires_grad
                                                        or projected_query.requires_grad):
            scores = self._scores(projected_annotations, projected_query)  # e_i, (B, r, L)
        else:  # chunks of rows through one reused buffer: a fresh 8 MB tensor each time costs page faults
            buffer = projected_query.new_empty(rows, per_image, locations, width)
            scores = torch.cat([
                self._scores(projected_annotations[i : i + rows], projected_query[i : i + rows],
                             out=buffer[: min(rows, batch - i)])  # e_i, (rows, r, L)
                for i in range(0, batch, rows)
            ])
        return scores.view(batch * per_image, locations).softmax(dim=-1)  # α = softmax(e)
