"""Hard attention's REINFORCE (Xu et al. 2015, §4.1, eq. 12): the sampled locations s are rewarded by
log p(y | s, a), less a moving-average baseline b, with an entropy bonus that keeps the sampling exploratory.
``ObjectiveOptions`` (``options.py``) sets the weights and b's decay.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vision_attn.captioning.decoder import DecoderOutput
from vision_attn.captioning.likelihood import TokenLikelihood
from vision_attn.captioning.options import ObjectiveOptions


def reinforce_surrogate(sequence_log_likelihood: Tensor, location_log_probs: Tensor, location_entropy: Tensor,
                        mask: Tensor, *, baseline: float, reinforce_weight: float = 1.0,
                        entropy_weight: float = 0.01) -> Tensor:
    """Hard attention's REINFORCE surrogate (eq. 12), (B,), whose gradient is the paper's estimate: reward
    log p(y | s, a) for the sampled s, less its moving average b (``baseline``), plus the entropy bonus λ_e H[s]."""
    advantage = (sequence_log_likelihood - baseline).detach()  # (log p(y|s,a) − b)
    location_log_likelihood = (location_log_probs * mask).sum(dim=1)  # Σ_t log p(s_t | a)
    entropy = (location_entropy * mask).sum(dim=1)
    return reinforce_weight * advantage * location_log_likelihood + entropy_weight * entropy


class HardAttentionReinforce(nn.Module):
    """REINFORCE for the locations hard attention sampled, with its baseline b, the moving average of
    log p(y | s, a) (a buffer: it is saved with the checkpoint, so a resumed run continues it)."""

    def __init__(self, options: ObjectiveOptions) -> None:
        super().__init__()
        self.options = options
        self.register_buffer("baseline", torch.zeros(()))  # b

    def forward(self, output: DecoderOutput, likelihood: TokenLikelihood) -> Tensor:
        """The surrogate summed over the captions (to subtract from the loss, scaled as its NLL), and b's update,
        b ← decay·b + (1 − decay)·log p(y | s, a). Only for a teacher-forced pass that sampled locations."""
        surrogate = reinforce_surrogate(-likelihood.per_caption, output.location_log_probs, output.location_entropy,
                                        likelihood.mask, baseline=float(self.baseline),
                                        reinforce_weight=self.options.reinforce_weight,
                                        entropy_weight=self.options.entropy_weight)
        decay = self.options.baseline_decay
        self.baseline.mul_(decay).add_((1 - decay) * -likelihood.per_caption.detach().mean())
        return surrogate.sum()
