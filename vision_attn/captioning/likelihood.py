"""The likelihood objective of "Show, Attend and Tell" (Xu et al. 2015, eq. 14): the negative log-likelihood of
the captions under teacher forcing, and the doubly stochastic penalty λ Σ_i (1 − Σ_t α_ti)², which asks every
location to be attended over the caption. ``ObjectiveOptions`` (``options.py``) sets λ and the normalisation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

from vision_attn.captioning.options import LossNormalisation
from vision_attn.data.vocabulary import PAD_ID


class TokenLikelihood(NamedTuple):
    """Teacher-forced likelihood: ``loss``, the mean −log p(y_t) over real tokens; ``per_caption`` −log p(y | a)
    (B,); ``mask`` (B, T), 1 on real tokens (<end> included); ``tokens``, their count (at least 1)."""

    loss: Tensor
    per_caption: Tensor
    mask: Tensor
    tokens: Tensor


def token_likelihood(logits: Tensor, captions: Tensor) -> TokenLikelihood:
    """The likelihood terms of ``logits`` (B, T, V) predicting ``captions[:, 1:]`` of (B, T+1) padded ids."""
    targets = captions[:, 1:]
    mask = (targets != PAD_ID).to(logits.dtype)  # (B, T): real tokens, <end> included
    tokens = mask.sum().clamp_min(1)
    nll = caption_nll(logits, targets, mask)  # (B,)
    return TokenLikelihood(nll.sum() / tokens, nll, mask, tokens)


def caption_nll(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Per-caption negative log-likelihood −log p(y | a), (B,), over real tokens only (``mask`` (B, T))."""
    batch, steps, words = logits.shape  # one row per token: the rows are contiguous, unlike (B, V, T)'s
    token_nll = F.cross_entropy(logits.reshape(-1, words), targets.reshape(-1), reduction="none").view(batch, steps)
    return (token_nll * mask).sum(dim=1)


def doubly_stochastic_penalty(alphas: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (1 − Σ_t α_ti)², (B,): pushes every location to receive attention over the caption (eq. 14)."""
    return attention_shortfall(alphas, mask).sum(dim=1)


def attention_shortfall(alphas: Tensor, mask: Tensor) -> Tensor:
    """(1 − Σ_t α_ti)² per caption and location, (B, L), summing α over real steps only (``mask`` (B, T))."""
    attention_per_location = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # Σ_t α_ti, (B, L)
    return (1.0 - attention_per_location) ** 2


class LikelihoodTerms(NamedTuple):
    """The NLL, the doubly stochastic penalty (before λ; None when λ = 0), and ``caption_scale``, what a sum over
    the captions is divided by at this normalisation (the captions, or the tokens)."""

    nll: Tensor
    penalty: Tensor | None
    caption_scale: Tensor | int


def likelihood_objective(likelihood: TokenLikelihood, alphas: Tensor, doubly_stochastic_weight: float,
                         normalisation: LossNormalisation = "paper") -> LikelihoodTerms:
    """The NLL term and the doubly stochastic penalty (eq. 14, before λ; None when λ = 0).

    ``paper``, the scale of the authors' code (arctic-captions' ``capgen.py``, λ = ``alpha_c``):
    NLL = (1/B) Σ_b Σ_t −log p(y_bt), penalty = (1/L) Σ_i Σ_b (1 − Σ_t α_bti)², summed over the captions and
    averaged over the locations, so λ weighs it alike at any L. ``token``: NLL per token, penalty
    (1/B) Σ_b Σ_i (1 − Σ_t α_bti)², which at L = 196 far outweighs the NLL per token.
    """
    paper = normalisation == "paper"
    scale = len(likelihood.per_caption) if paper else likelihood.tokens
    nll = likelihood.per_caption.mean() if paper else likelihood.loss
    if not doubly_stochastic_weight:
        return LikelihoodTerms(nll, None, scale)
    shortfall = attention_shortfall(alphas, likelihood.mask)  # (B, L)
    penalty = shortfall.mean(dim=1).sum() if paper else shortfall.sum(dim=1).mean()
    return LikelihoodTerms(nll, penalty, scale)
