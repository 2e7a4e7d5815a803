"""The grounding loss, an auxiliary objective: α at each step whose word names an object, against that object's box
(supervised attention, Liu et al. 2017). Needs the DataModule's object_targets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from vision_attn.boxes import box_cell_coverage, box_cell_weights
from vision_attn.captioning.seams import AuxiliaryTerm, TermResult, TrainingStep, WeightedOptions
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
    """Where each word of ``tokens`` (N, T) that names an object should look, (N, T, L), and which do, (N, T): the
    share of its box's area in each cell (``inside``: times the share of the cell the box fills, renormalised).
    A word names object k of ``objects`` (N, K, 6) when it is one of k's class words (``class_word_ids`` (C,) or
    (C, W), −1: none) or k's colour word just before one ("a *red* *sneaker*")."""
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
    """Supervised attention (Liu et al. 2017): −Σ_i w_ti log α_ti against the named object's box weights w_t,
    averaged over the steps whose word names an object, so z_t reads the whole object."""
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
        ids = [torch.tensor([vocab.id(word) for word in names if word in vocab] or [-1]) for names in words]
        self.register_buffer("class_word_ids", pad_sequence(ids, batch_first=True, padding_value=-1), persistent=False)
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
