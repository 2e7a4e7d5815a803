"""The attention math of both models, in one place.

- Scaled dot-product attention, Softmax(QKᵀ/√d)V (Vaswani et al. 2017), as used by the ViT
  (Dosovitskiy et al. 2020). The fused ``F.scaled_dot_product_attention`` kernel is the default path;
  the explicit path runs only when the caller asks for the attention weights.
- The scores of the captioner's attention over annotation vectors a_i, queried by the decoder's state h
  (``attention_score``; α = softmax(e) over the locations):
  - additive (Bahdanau et al. 2015; the "Show, Attend and Tell" paper's, Xu et al. 2015 §4.2):
    e_i = w·tanh(W_a a_i + W_h h);
  - dot (Luong et al. 2015): e_i = hᵀ (W_a a_i), the annotations projected once to the query's width;
  - general (Luong et al. 2015, bilinear): e_i = hᵀ W a_i;
  - scaled_dot (Vaswani et al. 2017): e_i = (W_q h)ᵀ (W_k a_i) / √d;
  - multihead: K scaled-dot heads over split widths, each with its own α; head k reads the k-th slice of a_i.
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

    def forward(self, x: Tensor) -> Tensor:
        """Self-attention over the tokens, (B, N, D) -> (B, N, D), without the weights."""
        return self._attend(x, return_weights=False)[0]

    def forward_with_weights(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``forward``, and the attention weights (B, H, N, N), by the explicit Softmax(QKᵀ/√d)V."""
        return self._attend(x, return_weights=True)

    def _attend(self, x: Tensor, *, return_weights: bool) -> tuple[Tensor, Tensor | None]:
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

    heads = 1  # one α per query

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


class ProductAttention(nn.Module):
    """The product scores, e_i = qᵀ k_i · s with k_i computed once per image and q once per step.

    ====================  =====================  ==========================  ===========
    score                 k_i (once per image)   q (every step)              s
    ====================  =====================  ==========================  ===========
    dot (Luong)           W_a a_i  (to |h|)      h                           1
    general (Luong)       a_i                    Wᵀ h  (so qᵀk_i = hᵀ W a_i)   1
    scaled_dot (Vaswani)  W_k a_i                W_q h                       1/√d
    multihead             W_k a_i, K slices      W_q h, K slices             1/√(d/K)
    ====================  =====================  ==========================  ===========

    dot and general score the same bilinear family (a bias on W_a adds hᵀb to every e_i, which the softmax
    ignores); they differ in where the product is taken and so in what a step costs: dot in the query's width
    over the projected annotations, general in the annotations' width with the query projected each step
    (nothing per image to project at all).

    As for the additive score: ``coverage`` adds w_c c_ti to e_ti (one learnt w_c per head; Tu et al. 2016),
    and ``word_dim`` adds the word just emitted to the query, q = … + W_y E y_{t-1}.
    """

    SCORES = ("dot", "general", "scaled_dot", "multihead")

    def __init__(self, score: str, annotation_dim: int, query_dim: int, attention_dim: int, *, heads: int = 1,
                 coverage: bool = False, word_dim: int = 0) -> None:
        super().__init__()
        if score not in self.SCORES:
            raise ValueError(f"unknown attention score {score!r}: use additive, {', '.join(self.SCORES)}")
        if score != "multihead":
            heads = 1
        elif heads < 1 or attention_dim % heads or annotation_dim % heads:
            raise ValueError(f"multihead attention needs attention_dim ({attention_dim}) and the annotation width "
                             f"({annotation_dim}) to be multiples of attention_heads, got {heads}")
        self.score_name, self.heads = score, heads
        key_dim = {"dot": query_dim, "general": annotation_dim}.get(score, attention_dim)
        self.scale = (key_dim // heads) ** -0.5 if score in ("scaled_dot", "multihead") else 1.0
        # W_a (dot) or W_k: a_i -> k_i; general keeps a_i as it is
        self.annotation_proj = None if score == "general" else nn.Linear(annotation_dim, key_dim)
        # W_q (scaled_dot, multihead) or Wᵀ (general): h -> q; dot reads h as it is
        self.query_proj = None if score == "dot" else nn.Linear(query_dim, key_dim, bias=score != "general")
        self.word_proj = nn.Linear(word_dim, key_dim, bias=False) if word_dim else None  # W_y
        self.coverage_proj = nn.Linear(1, heads, bias=False) if coverage else None  # w_c, one per head

    def project_annotations(self, annotations: Tensor) -> Tensor:
        """k_i for all i, once per image: (B, L, D) -> (B, L, d)."""
        return annotations if self.annotation_proj is None else self.annotation_proj(annotations)

    def forward(self, keys: Tensor, query: Tensor, coverage: Tensor | None = None,
                word: Tensor | None = None) -> Tensor:
        """α (B·r, L), or (B·r, K, L) with K > 1 heads, for r queries per image (B·r, Q).

        ``keys`` (B, L, d) are shared by the r queries of each image, never copied; query row n belongs to
        image n // r. ``coverage`` and ``word`` as for ``AdditiveAttention``.
        """
        batch, locations, width = keys.shape
        if query.shape[0] % batch:
            raise ValueError(f"{query.shape[0]} queries for {batch} images: expected a multiple")
        per_image, heads = query.shape[0] // batch, self.heads
        q = query if self.query_proj is None else self.query_proj(query)  # q, (B·r, d)
        if self.word_proj is not None:
            if word is None:
                raise ValueError("this attention reads the word just emitted: pass E y_{t-1}")
            q = q + self.word_proj(word)  # q + W_y E y_{t-1}
        q = q.view(batch, per_image, heads, width // heads).transpose(1, 2)  # (B, K, r, d/K)
        k = keys.view(batch, locations, heads, width // heads).permute(0, 2, 3, 1)  # (B, K, d/K, L)
        scores = torch.matmul(q, k)  # qᵀ k_i, (B, K, r, L)
        if self.scale != 1.0:
            scores = scores * self.scale
        if self.coverage_proj is not None:
            if coverage is None:
                raise ValueError("this attention reads coverage: pass c_t, the attention summed over past steps")
            # + w_c c_ti, one w_c per head: (1, K, 1, 1) · (B, 1, r, L)
            scores = scores + self.coverage_proj.weight.view(1, heads, 1, 1) * coverage.view(
                batch, 1, per_image, locations)
        alpha = scores.softmax(dim=-1).transpose(1, 2).reshape(batch * per_image, heads, locations)  # α = softmax(e)
        return alpha.squeeze(1) if heads == 1 else alpha


ATTENTION_SCORES = ("additive",) + ProductAttention.SCORES


def annotation_attention(score: str, annotation_dim: int, query_dim: int, attention_dim: int, *, heads: int = 4,
                         coverage: bool = False, word_dim: int = 0) -> AdditiveAttention | ProductAttention:
    """The captioner's attention for ``score`` (one of ``ATTENTION_SCORES``); ``heads`` is read by multihead."""
    if score == "additive":
        return AdditiveAttention(annotation_dim, query_dim, attention_dim, coverage=coverage, word_dim=word_dim)
    return ProductAttention(score, annotation_dim, query_dim, attention_dim, heads=heads, coverage=coverage,
                            word_dim=word_dim)
