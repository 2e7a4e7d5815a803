"""Training aids: losses that are not the paper's, and that inference never runs. They teach the annotation vectors
what is where, and α where to look (``TrainingAidsOptions`` in ``options.py`` turns each on):

- the concept loss, multiple-instance learning of the captions' words over the locations (Fang et al. 2015);
- the object loss, each training object's class and colour from the annotation vectors under its box (as a
  detector's region features are trained, Anderson et al. 2018);
- the grounding loss, α at each step whose word names an object against that object's box (Liu et al. 2017).

``TrainingAids`` holds their heads; each of its methods returns the weighted term with what to log, or None when
that aid is off (or the batch lacks what it reads).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.boxes import box_cell_coverage, box_cell_weights
from vision_attn.captioning.options import ObjectNames, TrainingAidsOptions
from vision_attn.checkpoint import extract_state_dict, load_file
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary
from vision_attn.errors import CheckpointError


def concept_targets(captions: Tensor, caption_images: Tensor | None, images: int, vocab_size: int,
                    ignore: Tensor) -> Tensor:
    """The words of each image's captions as a multi-hot (B, V): 1 where some caption of the image has the
    word. ``captions`` (N, T) are ids, caption n of image ``caption_images[n]`` (default n); the ids in
    ``ignore`` (<pad>, <start>, <end>) are never targets."""
    rows = caption_images if caption_images is not None else torch.arange(len(captions), device=captions.device)
    targets = captions.new_zeros(images, vocab_size, dtype=torch.float32)
    targets[rows.unsqueeze(1).expand_as(captions), captions] = 1.0
    targets[:, ignore] = 0.0
    return targets


def concept_loss(location_logits: Tensor, targets: Tensor, ignore: Tensor) -> Tensor:
    """Multiple-instance learning of the caption words from the image's locations (Fang et al. 2015): with
    s_iw the score of word w at location i, p_w = 1 − Π_i (1 − σ(s_iw)) (noisy-OR), and the loss is the binary
    cross-entropy of p_w against whether some caption has w, averaged over the words and images.

    ``location_logits`` is (B, L, V). Some location must light up for every word that is there, and none for
    the words that are not, so the annotation vectors learn to say what is where.
    """
    # −log Π_i (1 − σ(s_iw)) = −log(1 − p_w), in fp32 under autocast too (a sum of L terms, then log(1 − e^−x))
    none_total = F.softplus(location_logits.float()).sum(dim=1)
    log_absent = -none_total
    log_present = torch.log(-torch.expm1(-none_total.clamp_min(1e-6)))  # log p_w
    per_word = -(targets * log_present + (1 - targets) * log_absent)  # (B, V)
    keep = torch.ones(per_word.shape[1], dtype=torch.bool, device=per_word.device)
    keep[ignore] = False
    return per_word[:, keep].mean()


class ObjectLoss(NamedTuple):
    """The object loss (its class term plus its colour term) and the class accuracy, over the batch's objects."""

    loss: Tensor
    accuracy: Tensor
    objects: int


def object_loss(annotations: Tensor, grid: tuple[int, int], objects: Tensor, class_head: torch.nn.Module,
                colour_head: torch.nn.Module | None = None) -> ObjectLoss:
    """Each object's class (and colour) from the annotation vectors under its box: with w_ki the share of object
    k's box in cell i, a_k = Σ_i w_ki a_i, and the loss is the cross-entropy of softmax(W a_k + b) against its
    class, plus that of its colour where it has one (as an object detector's region features are trained,
    Anderson et al. 2018, on the boxes the training split holds).

    ``annotations`` (B, L, D) over ``grid``; ``objects`` (B, K, 6) rows [class, colour, x0, y0, x1, y1] with
    class −1 for padding and colour −1 where unknown (``data.coco.ObjectTargets``)."""
    classes, colours = objects[..., 0].long(), objects[..., 1].long()  # (B, K)
    present = classes >= 0
    if not present.any():
        zero = annotations.sum() * 0.0
        return ObjectLoss(zero, zero.detach(), 0)
    weights = box_cell_weights(objects[..., 2:].to(annotations.dtype), grid)  # (B, K, L)
    pooled = torch.bmm(weights, annotations)[present]  # a_k = Σ_i w_ki a_i, (B, K, D) -> (N, D)
    class_logits = class_head(pooled)
    loss = F.cross_entropy(class_logits.float(), classes[present])
    accuracy = (class_logits.argmax(-1) == classes[present]).float().mean()
    coloured = colours[present] >= 0
    if colour_head is not None and coloured.any():
        loss = loss + F.cross_entropy(colour_head(pooled[coloured]).float(), colours[present][coloured])
    return ObjectLoss(loss, accuracy, int(present.sum()))


def grounding_targets(tokens: Tensor, objects: Tensor, grid: tuple[int, int], class_word_ids: Tensor,
                      colour_word_ids: Tensor | None = None, *, inside: bool = False) -> tuple[Tensor, Tensor]:
    """Where each word that names an object should look: its object's box as cell weights, the share of the box's
    area in each cell; with ``inside``, each share times the share of the cell the box fills, renormalised, so a
    cell the box only grazes (mostly background, clutter in a cluttered scene) is asked for little. A word names
    object k when it is k's class word, or k's colour word just before that class word ("a *red* *sneaker*").

    ``tokens`` (N, T) are the words emitted at each step (``captions[:, 1:]`` in teacher forcing); ``objects``
    (N, K, 6) the object rows of each caption's image (``data.coco.ObjectTargets``, class −1 for padding);
    ``class_word_ids`` (C,) the vocabulary id of each object class's word (−1: not one word of the vocabulary);
    ``colour_word_ids`` likewise per colour. Returns the target weights (N, T, L) and the mask of the words that
    name an object (N, T)."""
    classes, colours = objects[..., 0].long(), objects[..., 1].long()  # (N, K)
    present = classes >= 0
    object_words = torch.where(present, class_word_ids[classes.clamp_min(0)], -1)  # (N, K); −1 never matches
    named = (tokens.unsqueeze(-1) == object_words.unsqueeze(1)) & (object_words.unsqueeze(1) >= 0)  # (N, T, K)
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


class AidTerm(NamedTuple):
    """One aid's weighted loss, and what to log: name -> (value, how many items it averages)."""

    loss: Tensor
    logs: dict[str, tuple[Tensor, int]]


class TrainingAids(nn.Module):
    """The aids' heads over annotation vectors of ``annotation_dim`` dimensions: the concept head (every word's
    score at every location), and the object class and colour heads. Only the aids turned on have a head."""

    def __init__(self, options: TrainingAidsOptions, objects: ObjectNames, vocab: Vocabulary,
                 annotation_dim: int) -> None:
        super().__init__()
        self.options = options
        for name in ("object_weight", "grounding_weight"):
            if getattr(options, name) > 0 and not objects.classes:
                raise ValueError(f"aids.{name} needs the training images' objects: set the DataModule's "
                                 "object_targets: true (it reads the train split's instances file)")
        self.concept_head = nn.Linear(annotation_dim, len(vocab)) if options.concept_weight > 0 else None
        if self.concept_head is not None:  # σ(−5) per location: a noisy-OR over tens of locations starts near 0.2,
            nn.init.constant_(self.concept_head.bias, -5.0)  # not near 1 for every word (which swamps the loss)
        self.object_head = nn.Linear(annotation_dim, len(objects.classes)) if options.object_weight > 0 else None
        self.object_colour_head = nn.Linear(annotation_dim, len(objects.colours)) \
            if options.object_weight > 0 and objects.colours else None
        self.objects = objects
        # the vocabulary ids of the object classes' and colours' words (−1: not a word of the vocabulary)
        self.register_buffer("class_word_ids", torch.tensor(
            [vocab.id(name) if name in vocab else -1 for name in objects.classes], dtype=torch.long), persistent=False)
        self.register_buffer("colour_word_ids", torch.tensor(
            [vocab.id(name) if name in vocab else -1 for name in objects.colours], dtype=torch.long), persistent=False)

    def heads(self) -> list[nn.Module]:
        """The heads there are, concept first: what the optimiser trains beside the decoder."""
        return [head for head in (self.concept_head, self.object_head, self.object_colour_head) if head is not None]

    def start_from_pretraining(self, source: str | os.PathLike | None, pretrained_with: dict) -> None:
        """Start the object heads from the classifier heads of the encoder's pretraining, which read a class and a
        colour from the pooled annotation vectors as the object loss does: a linear probe before fine-tuning keeps
        more of the pretrained features than a head started at random, whose first gradients reach the encoder as
        noise (LP-FT, Kumar et al. 2022). ``pretrained_with`` is the pretraining's hyper-parameters (the
        encoder keeps them when its trunk loads). One line of refusal when there are no such heads or they name
        other classes or colours."""
        if not source:
            raise ValueError("aids.object_heads_from_encoder needs encoder.pretrained: an encoder pretraining "
                             "checkpoint")
        state = extract_state_dict(load_file(source))  # the heads, which the trunk's loading leaves out
        if "head.weight" not in state or pretrained_with.get("class_names") is None:
            raise CheckpointError(f"{source}: not an encoder pretraining checkpoint with class heads, so "
                                  "aids.object_heads_from_encoder has no heads to start from")
        if list(pretrained_with["class_names"]) != list(self.objects.classes):
            raise CheckpointError(f"{source}: the pretrained head's classes {list(pretrained_with['class_names'])} "
                                  f"are not this captioner's object classes {list(self.objects.classes)}")
        heads = [(self.object_head, "head")]
        if self.object_colour_head is not None:
            theirs = list(pretrained_with.get("colour_names") or [])
            if theirs != list(self.objects.colours) or "colour_head.weight" not in state:
                raise CheckpointError(f"{source}: the pretrained colour head's colours {theirs} are not this "
                                      f"captioner's object colours {list(self.objects.colours)}")
            heads.append((self.object_colour_head, "colour_head"))
        with torch.no_grad():
            for head, prefix in heads:
                head.weight.copy_(state[f"{prefix}.weight"])
                head.bias.copy_(state[f"{prefix}.bias"])

    def concept(self, annotations: Tensor, captions: Tensor, caption_images: Tensor | None) -> AidTerm | None:
        """concept_weight × the multiple-instance loss of the captions' words over the locations."""
        if self.concept_head is None:
            return None
        ignore = torch.tensor([PAD_ID, START_ID, END_ID], device=captions.device)
        targets = concept_targets(captions, caption_images, len(annotations), self.concept_head.out_features, ignore)
        loss = concept_loss(self.concept_head(annotations), targets, ignore)
        return AidTerm(self.options.concept_weight * loss, {"concept_loss": (loss, len(annotations))})

    def object_classes(self, annotations: Tensor, grid: tuple[int, int], objects: Tensor | None) -> AidTerm | None:
        """object_weight × the loss of each object's class and colour from the vectors under its box (None when
        the batch carries no objects, as in validation)."""
        if self.object_head is None or objects is None:
            return None
        result = object_loss(annotations, grid, objects, self.object_head, self.object_colour_head)
        logs = {"object_loss": (result.loss, result.objects), "object_acc": (result.accuracy, result.objects)} \
            if result.objects else {}
        return AidTerm(self.options.object_weight * result.loss, logs)

    def grounding(self, tokens: Tensor, alphas: Tensor, objects: Tensor | None, caption_images: Tensor | None,
                  grid: tuple[int, int]) -> AidTerm | None:
        """grounding_weight × the cross-entropy of α against the box of the object each word names."""
        if not self.options.grounding_weight or objects is None:
            return None
        per_caption = objects if caption_images is None else objects[caption_images]  # (B, K, 6) -> (N, K, 6)
        target, mask = grounding_targets(tokens, per_caption, grid, self.class_word_ids, self.colour_word_ids,
                                         inside=self.options.grounding_target == "inside")
        loss = grounding_loss(alphas, target, mask)
        return AidTerm(self.options.grounding_weight * loss, {"grounding_loss": (loss, len(tokens))})
