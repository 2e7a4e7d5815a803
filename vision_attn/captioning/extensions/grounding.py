"""The grounding loss, an auxiliary objective: α at each step whose word names an object, against that object's box
(supervised attention, Liu et al. 2017). Needs the DataModule's object_targets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vision_attn.boxes import box_cell_coverage, box_cell_weights
from vision_attn.captioning.extensions.concept import WeightedOptions
from vision_attn.captioning.seams import AuxiliaryTerm, TermResult, TrainingStep
from vision_attn.data.vocabulary import Vocabulary
from vision_attn.option_groups import require


@dataclass(frozen=True)
class GroundingOptions(WeightedOptions):
    """The grounding loss's options."""

    target: str = "box"
    """box: α's target is the share of the box's area in each cell; inside: that share times the share of the cell
    the box fills (cells the box only grazes, mostly background, get little)"""

    def check(self) -> None:
        """Refuse a negative weight or an unknown target."""
        super().check()
        require(self.target in ("box", "inside"), self.name, f"target must be box or inside, got {self.target!r}")


def grounding_targets(tokens: Tensor, objects: Tensor, grid: tuple[int, int], class_word_ids: Tensor,
                      colour_word_ids: Tensor | None = None, *, inside: bool = False) -> tuple[Tensor, Tensor]:
    """Where each word that names an object should look: its object's box as cell weights, the share of the box's
    area in each cell; with ``inside``, each share times the share of the cell the box fills, renormalised, so a
    cell the box only grazes (mostly background, clutter in a cluttered scene) is asked for little. A word names
    object k when it is k's class word, or k's colour word just before that class word ("a *red* *sneaker*").

    ``tokens`` (N, T) are the words emitted at each step (``captions[:, 1:]`` in teacher forcing); ``objects``
    (N, K, 6) the object rows of each caption's image (``data.coco.ObjectTargets``, class −1 for padding);
    ``class_word_ids`` (C,) the vocabulary id of each object class's word, or (C, W) the ids of the W words that
    may name it (−1: none, or not one word of the vocabulary); ``colour_word_ids`` (one per colour) likewise.
    Returns the target weights (N, T, L) and the mask of the words that name an object (N, T)."""
    classes, colours = objects[..., 0].long(), objects[..., 1].long()  # (N, K)
    present = classes >= 0
    by_class = class_word_ids if class_word_ids.dim() == 2 else class_word_ids.unsqueeze(-1)  # (C, W)
    object_words = torch.where(present.unsqueeze(-1), by_class[classes.clamp_min(0)], -1)  # (N, K, W); −1: none
    named = ((tokens[:, :, None, None] == object_words.unsqueeze(1))
             & (object_words.unsqueeze(1) >= 0)).any(-1)  # (N, T, K)
    if colour_word_ids is not None and len(colour_word_ids):
        colour_words = torch.where(present & (colours >= 0), colour_word_ids[colours.clamp_min(0)], -1)  # (N, K)
        before = torch.zeros_like(named)
        before[:, :-1] = named[:, 1:]  # the step before a class word of object k ...
        said = (tokens.unsqueeze(-1) == colour_words.unsqueeze(1)) & (colour_words.unsqueeze(1) >= 0)
        named = named | (before & said)  # ... that says k's colour
    weights = box_cell_weights(objects[..., 2:], grid) * present.unsqueeze(-1)  # (N, K, L)
    if inside:  # w_ki ∝ (box area in cell i) × (share of cell i the box fills)
        weights = weights * box_cell_coverage(objects[..., 2:], grid)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
    target = torch.bmm(named.to(weights.dtype), weights)  # (N, T, L)
    mask = named.any(-1)
    return target / target.sum(-1, keepdim=True).clamp_min(1e-12), mask


def grounding_loss(alphas: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Supervised attention (Liu et al. 2017, "Attention correctness"): at each step whose word names an object,
    the cross-entropy −Σ_i w_ti log α_ti of α_t against that object's box weights w_t, averaged over those steps.
    The attention then covers the object it names, so the context z_t reads the whole object."""
    steps = mask.sum()
    if not steps:
        return alphas.sum() * 0.0
    cross_entropy = -(target * alphas.float().clamp_min(1e-12).log()).sum(-1)  # (N, T)
    return (cross_entropy * mask).sum() / steps


class Grounding(AuxiliaryTerm):
    """weight × the cross-entropy of α against the box of the object each said word names."""

    Options = GroundingOptions

    def __init__(self, options: GroundingOptions, *, objects: object, vocab: Vocabulary, **_: object) -> None:
        super().__init__()
        if not objects.classes:
            raise ValueError("objective.auxiliary.grounding needs the training images' objects: set the DataModule's "
                             "object_targets: true (it reads the train split's instances file)")
        self.weight, self.inside = options.weight, options.target == "inside"
        # the vocabulary ids of the words that name each class (its object-words table's single words, else its
        # name), (C, W) padded with −1, and of the colours' words (−1: not a word of the vocabulary)
        words = objects.class_words or [[name] for name in objects.classes]
        ids = [[vocab.id(word) for word in names if word in vocab] or [-1] for names in words]
        width = max(len(row) for row in ids)
        self.register_buffer("class_word_ids", torch.tensor([row + [-1] * (width - len(row)) for row in ids],
                                                            dtype=torch.long), persistent=False)
        self.register_buffer("colour_word_ids", torch.tensor(
            [vocab.id(name) if name in vocab else -1 for name in objects.colours], dtype=torch.long), persistent=False)

    def forward(self, step: TrainingStep) -> TermResult | None:
        """The weighted loss with grounding_loss logged (None when the batch carries no objects)."""
        if step.objects is None:
            return None
        objects = step.objects if step.token_images is None else step.objects[step.token_images]  # (N, K, 6)
        target, mask = grounding_targets(step.tokens, objects, step.grid, self.class_word_ids, self.colour_word_ids,
                                         inside=self.inside)
        loss = grounding_loss(step.alphas, target, mask)
        return TermResult(self.weight * loss, {"grounding_loss": (loss, len(step.tokens))})
