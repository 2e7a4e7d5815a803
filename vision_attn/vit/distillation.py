"""DeiT's distillation (Touvron et al. 2021): a trained classifier, frozen, teaches the ViT on every batch."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.checkpoint import (
    CONVNET,
    KIND_NAMES,
    VIT,
    checkpoint_kind,
    load_file,
    load_weights,
    read_model_checkpoint,
)
from vision_attn.errors import CheckpointError
from vision_attn.option_groups import ImageFormat
from vision_attn.vit.classifier import vit_from_hparams
from vision_attn.vit.classifier_options import ConvNetArchitecture, Distillation
from vision_attn.vit.convnet import ConvNet

log = logging.getLogger(__name__)


def load_teacher(path: str, num_classes: int, image: ImageFormat) -> torch.nn.Module:
    """The frozen classifier of a ConvNet or ViT checkpoint, in eval mode; refused in one line when it does not
    read the student's images (its classes, size, channels and normalisation)."""
    loaded = load_file(path)
    kind = checkpoint_kind(loaded)
    if kind not in (CONVNET, VIT):
        raise CheckpointError(f"{path}: a teacher is a {KIND_NAMES[CONVNET]} or {KIND_NAMES[VIT]} checkpoint, "
                              f"not {KIND_NAMES.get(kind, 'an unmarked one')}")
    saved = read_model_checkpoint(path, kind=kind, loaded=loaded)
    theirs = ImageFormat.coerce(saved.hparams.get("image"))
    for name, their, our in (("num_classes", saved.hparams.get("num_classes"), num_classes),
                             ("image size", theirs.size, image.size), ("channels", theirs.channels, image.channels),
                             ("mean", theirs.mean, image.mean), ("std", theirs.std, image.std)):
        if their is not None and our is not None and torch.tensor(their).flatten().tolist() != \
                torch.tensor(our).flatten().tolist():
            raise CheckpointError(f"{path}: the teacher's {name} is {their}, the student's {our}: it must be "
                                  "trained on the same images")
    if kind == CONVNET:
        architecture = ConvNetArchitecture.coerce(saved.hparams.get("architecture"))
        model = ConvNet(in_chans=theirs.channels, num_classes=saved.hparams["num_classes"],
                        widths=architecture.widths)
    else:
        model = vit_from_hparams(saved.hparams)
    load_weights(model, saved.state_dict, source=path)
    log.info("distilling from %s (%s)", path, KIND_NAMES[kind])
    return model.eval().requires_grad_(False)


def distillation_loss(options: Distillation, logits: Tensor, distilled: Tensor, teacher_logits: Tensor,
                      labels: Tensor, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """(the loss, the teacher's term): (1 − λ) CE(ψ(Z_s), y) + λ L_teacher, with L_teacher = CE(ψ(Z_d), argmax Z_t)
    (hard) or τ² KL(ψ(Z_t / τ) ‖ ψ(Z_d / τ)) (soft)."""
    if options.mode == "hard":  # y_t = argmax_c Z_t(c)
        teacher_loss = F.cross_entropy(distilled, teacher_logits.argmax(dim=-1), label_smoothing=label_smoothing)
    else:
        tau = options.tau
        teacher_loss = tau ** 2 * F.kl_div(F.log_softmax(distilled / tau, dim=-1),
                                           F.log_softmax(teacher_logits / tau, dim=-1), reduction="batchmean",
                                           log_target=True)
    student_loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
    return (1 - options.weight) * student_loss + options.weight * teacher_loss, teacher_loss
