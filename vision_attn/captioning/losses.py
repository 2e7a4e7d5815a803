"""Training objectives of "Show, Attend and Tell" (Xu et al. 2015, eqs. 9-12 and 14)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def caption_nll(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Per-caption negative log-likelihood −log p(y | a), (B,), over real tokens only (``mask`` (B, T))."""
    token_nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, V, T) -> (B, T)
    return (token_nll * mask).sum(dim=1)


def doubly_stochastic_penalty(alphas: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (1 − Σ_t α_ti)², (B,): pushes every location to receive attention over the caption (eq. 14)."""
    attention_per_location = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # Σ_t α_ti over real steps, (B, L)
    return ((1.0 - attention_per_location) ** 2).sum(dim=1)


def reinforce_surrogate(
    sequence_log_likelihood: Tensor,
    location_log_probs: Tensor,
    location_entropy: Tensor,
    mask: Tensor,
    *,
    baseline: float,
    reinforce_weight: float = 1.0,
    entropy_weight: float = 0.01,
) -> Tensor:
    """Hard attention's REINFORCE surrogate (eq. 12), (B,); its gradient is the paper's estimate.

    log p(y | s, a) is the reward for the sampled locations s; ``baseline`` is its moving average b, and
    the entropy bonus λ_e H[s] keeps the sampling exploratory.
    """
    advantage = (sequence_log_likelihood - baseline).detach()  # (log p(y|s,a) − b)
    location_log_likelihood = (location_log_probs * mask).sum(dim=1)  # Σ_t log p(s_t | a)
    entropy = (location_entropy * mask).sum(dim=1)
    return reinforce_weight * advantage * location_log_likelihood + entropy_weight * entropy
