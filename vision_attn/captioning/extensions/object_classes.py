"""The object loss, an auxiliary objective: each training object's class and colour from the annotation vectors under
its box (as a detector's region features are trained, Anderson et al. 2018). Needs the DataModule's object_targets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.boxes import box_cell_weights
from vision_attn.captioning.seams import AuxiliaryTerm, TermResult, TrainingStep, WeightedOptions
from vision_attn.checkpoint import extract_state_dict, load_file
from vision_attn.errors import CheckpointError


@dataclass(frozen=True)
class ObjectLossOptions(WeightedOptions):
    """The object loss's options."""

    heads_from_encoder: bool = False
    """start the class and colour heads from the encoder pretraining's heads (LP-FT; needs an encoder pretraining
    checkpoint as encoder.pretrained)"""


class ObjectLoss(NamedTuple):
    """The object loss (its class term plus its colour term) and the class accuracy, over the batch's objects."""

    loss: Tensor
    accuracy: Tensor
    objects: int


def object_loss(annotations: Tensor, grid: tuple[int, int], objects: Tensor, class_head: torch.nn.Module,
                colour_head: torch.nn.Module | None = None) -> ObjectLoss:
    """The cross-entropy of softmax(W a_k + b) against each object's class (and known colour), a_k = Σ_i w_ki a_i
    with w_ki the share of its box in cell i; ``objects`` (B, K, 6) rows [class, colour, x0, y0, x1, y1], −1:
    padding or no colour."""
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


class ObjectClasses(AuxiliaryTerm):
    """weight × the object loss; its heads read a class and a colour from the vectors pooled under each box."""

    Options = ObjectLossOptions

    def __init__(self, options: ObjectLossOptions, *, objects: object, annotation_dim: int,
                 pretrained: str | os.PathLike | None = None, pretrained_with: dict | None = None, **_: object) -> None:
        super().__init__()
        if not objects.classes:
            raise ValueError("objective.auxiliary.object needs the training images' objects: set the DataModule's "
                             "object_targets: true (it reads the train split's instances file)")
        self.weight, self.objects = options.weight, objects
        self.head = nn.Linear(annotation_dim, len(objects.classes))
        self.colour_head = nn.Linear(annotation_dim, len(objects.colours)) if objects.colours else None
        if options.heads_from_encoder:
            self.start_from_pretraining(pretrained, pretrained_with or {})

    def start_from_pretraining(self, source: str | os.PathLike | None, pretrained_with: dict) -> None:
        """Start the heads from the encoder pretraining's (``pretrained_with``: its hyper-parameters), which read
        pooled vectors alike: a probe keeps more of the pretrained features than random heads, whose first
        gradients reach the encoder as noise (LP-FT, Kumar et al. 2022); refused when they differ."""
        if not source:
            raise ValueError("objective.auxiliary.object.heads_from_encoder needs encoder.pretrained: an encoder "
                             "pretraining checkpoint")
        state = extract_state_dict(load_file(source))  # the heads, which the trunk's loading leaves out
        if "head.weight" not in state or pretrained_with.get("class_names") is None:
            raise CheckpointError(f"{source}: not an encoder pretraining checkpoint with class heads, so "
                                  "objective.auxiliary.object.heads_from_encoder has no heads to start from")
        if list(pretrained_with["class_names"]) != list(self.objects.classes):
            raise CheckpointError(f"{source}: the pretrained head's classes {list(pretrained_with['class_names'])} "
                                  f"are not this captioner's object classes {list(self.objects.classes)}")
        self.head.load_state_dict({"weight": state["head.weight"], "bias": state["head.bias"]})
        if self.colour_head is not None:
            theirs = list(pretrained_with.get("colour_names") or [])
            if theirs != list(self.objects.colours) or "colour_head.weight" not in state:
                raise CheckpointError(f"{source}: the pretrained colour head's colours {theirs} are not this "
                                      f"captioner's object colours {list(self.objects.colours)}")
            self.colour_head.load_state_dict({"weight": state["colour_head.weight"], "bias": state["colour_head.bias"]})

    def forward(self, step: TrainingStep) -> TermResult | None:
        """The weighted loss with object_loss and object_acc logged (None when the batch carries no objects)."""
        if step.objects is None:
            return None
        result = object_loss(step.annotations, step.grid, step.objects, self.head, self.colour_head)
        logs = {"object_loss": (result.loss, result.objects), "object_acc": (result.accuracy, result.objects)} \
            if result.objects else {}
        return TermResult(self.weight * result.loss, logs)
