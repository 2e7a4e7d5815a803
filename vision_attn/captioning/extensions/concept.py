"""The concept loss, an auxiliary objective: multiple-instance learning of the captions' words over the locations
(Fang et al. 2015), so the annotation vectors learn which words are where."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.captioning.seams import AuxiliaryTerm, TermResult, TrainingStep, WeightedOptions
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary


def concept_targets(captions: Tensor, caption_images: Tensor | None, images: int, vocab_size: int,
                    ignore: Tensor) -> Tensor:
    """Multi-hot (B, V): 1 where some caption (N, T) of the image (``caption_images[n]``, default n) has the word;
    the ids in ``ignore`` are never targets."""
    rows = caption_images if caption_images is not None else torch.arange(len(captions), device=captions.device)
    targets = captions.new_zeros(images, vocab_size, dtype=torch.float32)
    targets[rows.unsqueeze(1).expand_as(captions), captions] = 1.0
    targets[:, ignore] = 0.0
    return targets


def concept_loss(location_logits: Tensor, targets: Tensor, ignore: Tensor) -> Tensor:
    """Multiple-instance learning of the caption words over the locations (Fang et al. 2015): with s_iw (B, L, V)
    the score of word w at location i, p_w = 1 − Π_i (1 − σ(s_iw)) (noisy-OR), and the loss is the binary
    cross-entropy of p_w against ``targets``, averaged over the words and images."""
    # −log Π_i (1 − σ(s_iw)) = −log(1 − p_w), in fp32 under autocast too (a sum of L terms, then log(1 − e^−x))
    none_total = F.softplus(location_logits.float()).sum(dim=1)
    log_absent = -none_total
    log_present = torch.log(-torch.expm1(-none_total.clamp_min(1e-6)))  # log p_w
    per_word = -(targets * log_present + (1 - targets) * log_absent)  # (B, V)
    return per_word[:, ~torch.isin(torch.arange(per_word.shape[1], device=per_word.device), ignore)].mean()


class ConceptLoss(AuxiliaryTerm):
    """weight × the multiple-instance loss of the references' words over the locations; its head scores every word
    at every location."""

    def __init__(self, options: WeightedOptions, *, vocab: Vocabulary, annotation_dim: int, **_: object) -> None:
        super().__init__()
        self.weight = options.weight
        self.head = nn.Linear(annotation_dim, len(vocab))
        # σ(−5) per location: a noisy-OR over tens of locations starts near 0.2, not near 1 for every word (which
        # swamps the loss)
        nn.init.constant_(self.head.bias, -5.0)

    def forward(self, step: TrainingStep) -> TermResult:
        """The weighted loss, with concept_loss logged."""
        captions, annotations = step.captions, step.annotations
        ignore = torch.tensor([PAD_ID, START_ID, END_ID], device=captions.device)
        targets = concept_targets(captions, step.caption_images, len(annotations), self.head.out_features, ignore)
        loss = concept_loss(self.head(annotations), targets, ignore)
        return TermResult(self.weight * loss, {"concept_loss": (loss, len(annotations))})
