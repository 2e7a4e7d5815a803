"""The product scores, e_i = qᵀ k_i · s with k_i computed once per image and q once per step (Luong et al. 2015,
Vaswani et al. 2017): alternatives to the paper's additive score, behind the same interface (``AttentionScore``).

====================  =====================  ==========================  ===========
score                 k_i (once per image)   q (every step)              s
====================  =====================  ==========================  ===========
dot (Luong)           W_a a_i  (to |h|)      h                           1
general (Luong)       a_i                    Wᵀ h  (so qᵀk_i = hᵀ W a_i)   1
scaled_dot (Vaswani)  W_k a_i                W_q h                       1/√d
multihead             W_k a_i, K slices      W_q h, K slices             1/√(d/K)
====================  =====================  ==========================  ===========

dot and general score the same bilinear family (a bias on W_a adds hᵀb to every e_i, which the softmax ignores),
at different costs per step. An input's query term is added to q; a location term, one scalar per head, to e_ti.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from vision_attn.captioning.seams import Attended, AttentionScore, LocationTerm, ScoreWidths, queries_per_image


class ProductAttention(AttentionScore):
    """A product ``score`` (dot, general, scaled_dot or multihead) of annotations by h; the multihead score's K
    ``heads`` each have their own α over the k-th slice of the widths."""

    def __init__(self, annotation_dim: int, query_dim: int, attention_dim: int, *, heads: int = 1,
                 score: str = "dot") -> None:
        super().__init__()
        if score != "multihead":
            heads = 1
        elif heads < 1 or attention_dim % heads or annotation_dim % heads:
            raise ValueError(f"multihead attention needs attention_dim ({attention_dim}) and the annotation width "
                             f"({annotation_dim}) to be multiples of attention_heads, got {heads}")
        self.heads = heads
        key_dim = {"dot": query_dim, "general": annotation_dim}.get(score, attention_dim)
        self.scale = (key_dim // heads) ** -0.5 if score in ("scaled_dot", "multihead") else 1.0
        # W_a (dot) or W_k: a_i -> k_i; general keeps a_i as it is
        self.annotation_proj = None if score == "general" else nn.Linear(annotation_dim, key_dim)
        # W_q (scaled_dot, multihead) or Wᵀ (general): h -> q; dot reads h as it is
        self.query_proj = None if score == "dot" else nn.Linear(query_dim, key_dim, bias=score != "general")
        self.widths = ScoreWidths(key_dim, heads)

    def keys(self, annotations: Tensor) -> Tensor:
        """k_i for all i, once per image: (B, L, D) -> (B, L, d)."""
        return annotations if self.annotation_proj is None else self.annotation_proj(annotations)

    def forward(self, keys: Tensor, query: Tensor, query_terms: Sequence[Tensor] = (),
                location_terms: Sequence[LocationTerm] = ()) -> Attended:
        """α (B·r, L), and each head's (B·r, K, L) when K > 1, for r queries per image (B·r, H)."""
        batch, locations, width = keys.shape
        per_image, heads = queries_per_image(keys, query), self.heads
        q = query if self.query_proj is None else self.query_proj(query)  # q, (B·r, d)
        for term in query_terms:  # q + W_y E y_{t−1}, ...
            q = q + term
        q = q.view(batch, per_image, heads, width // heads).transpose(1, 2)  # (B, K, r, d/K)
        k = keys.view(batch, locations, heads, width // heads).permute(0, 2, 3, 1)  # (B, K, d/K, L)
        scores = torch.matmul(q, k)  # qᵀ k_i, (B, K, r, L)
        if self.scale != 1.0:
            scores = scores * self.scale
        for values, weight in location_terms:  # + w_c c_ti, one w_c per head: (1, K, 1, 1) · (B, 1, r, L)
            scores = scores + weight.view(1, heads, 1, 1) * values.view(batch, 1, per_image, locations)
        alpha = scores.softmax(dim=-1).transpose(1, 2).reshape(batch * per_image, heads, locations)  # α = softmax(e)
        return Attended(alpha.squeeze(1)) if heads == 1 else Attended(alpha.mean(dim=1), alpha)


PRODUCT_SCORES: dict[str, Callable[..., ProductAttention]] = {
    score: partial(ProductAttention, score=score) for score in ("dot", "general", "scaled_dot", "multihead")}
