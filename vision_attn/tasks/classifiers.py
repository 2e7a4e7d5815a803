"""LightningModules for the image classifiers: the ViT, and the small CNN that can teach it (DeiT's distillation)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from PIL import Image
from torch import Tensor, nn

from vision_attn.boxes import box_cell_coverage
from vision_attn.checkpoint import CONVNET, VIT
from vision_attn.option_groups import ImageFormat, Optimiser, Schedule
from vision_attn.tasks.base import BaseTask, decay_groups
from vision_attn.tasks.predictions import ClassPredictions
from vision_attn.vit.classifier import Classifier, build_vit
from vision_attn.vit.classifier_options import (
    ClassifierTraining,
    ConvNetArchitecture,
    Distillation,
    ViTArchitecture,
    ViTTraining,
)
from vision_attn.vit.convnet import ConvNet
from vision_attn.vit.distillation import distillation_loss, load_teacher
from vision_attn.vit.map_figures import validation_figures
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.vit.rollout import attention_rollout, explain, pooled_weights
from vision_attn.vit.rollout_mass import map_scores

log = logging.getLogger(__name__)
MAP_SCORES = ("rollout_mass", "rollout_pointing", "last_layer_mass", "last_layer_pointing")
OPTIMISER, SCHEDULE = Optimiser(weight_decay=0.05), Schedule(warmup_epochs=1.0)  # the classifiers' defaults


class ClassifierTask(ClassPredictions, BaseTask):
    """What the image classifiers share: top-1 accuracy (micro) and the mean loss, ``classify``'s entries as
    predictions, AdamW without decay on norms, biases and ``no_weight_decay``. Subclasses build ``self.model``."""

    def __init__(self, *, num_classes: int, class_names: list[str] | None, image: ImageFormat | None,
                 training: ClassifierTraining, optimiser: Optimiser, schedule: Schedule, log_overlays: int) -> None:
        super().__init__(optimiser=Optimiser.coerce(optimiser, OPTIMISER), schedule=Schedule.coerce(schedule, SCHEDULE),
                         log_overlays=log_overlays)
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        self.num_classes, self.class_names, self.image = num_classes, class_names, ImageFormat.coerce(image)
        self.training_options = training  # a group of the subclass's kind, checked
        # top-1 accuracy over images (micro): torchmetrics' default would average the per-class recalls
        self.train_accuracy, self.val_accuracy, self.test_accuracy = (
            torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro") for _ in range(3))
        # the mean loss over images, summed and counted across DDP ranks (not a mean of the ranks' means)
        self.val_loss, self.test_loss = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()

    def save_options(self, **options: Any) -> None:
        """Save the classifiers' shared arguments and the subclass's ``options`` as the hyper-parameters."""
        super().save_options(num_classes=self.num_classes, class_names=self.class_names, image=self.image,
                             training=self.training_options, optimiser=self.optimiser,
                             schedule=self.schedule.options, log_overlays=self.log_overlays, **options)

    def forward(self, images: Tensor) -> Tensor:
        """The model's logits (B, classes) of normalised images (B, C, H, W)."""
        return self.model(images)

    def classification_loss(self, images: Tensor, labels: Tensor, boxes: Tensor | None = None,
                            origins: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(loss, logits) of a training batch: cross-entropy with label smoothing. ``boxes`` (B, 4) [x, y, w, h] and
        ``origins`` (B, 2), the windows' places, come from ``FashionMNISTCanvasDataModule``; a convnet ignores them."""
        logits = self.model(images)
        return F.cross_entropy(logits, labels, label_smoothing=self.training_options.label_smoothing), logits

    def training_loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        """``classification_loss``, logged as train/loss, with the epoch's top-1 accuracy as train/acc."""
        images, labels, *places = batch
        loss, logits = self.classification_loss(images, labels, *places)
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def evaluation_logits(self, images: Tensor, masks: list[Tensor], stage: str) -> Tensor:
        """The logits (B, classes) of an evaluation batch (``masks``, the objects', unused here)."""
        return self.model(images)

    def _evaluate(self, batch: tuple[Tensor, ...] | None, stage: str, accuracy: torchmetrics.Metric,
                  mean_loss: torchmetrics.Metric) -> None:
        if batch is None:
            return
        images, labels, *masks = batch
        logits = self.evaluation_logits(images, masks, stage)
        accuracy(logits, labels)
        mean_loss(F.cross_entropy(logits, labels, reduction="none"))
        self.log(f"{stage}/loss", mean_loss)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, ...] | None, batch_idx: int) -> None:
        """val/loss, the mean cross-entropy over images (no label smoothing), and val/acc, top-1 accuracy."""
        self._evaluate(batch, "val", self.val_accuracy, self.val_loss)

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        """test/loss, the mean cross-entropy over images (no label smoothing), and test/acc, top-1 accuracy."""
        self._evaluate(batch, "test", self.test_accuracy, self.test_loss)

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The trainable parameters, weight decay on matrices only and never on the model's ``no_weight_decay``."""
        skip = self.model.no_weight_decay() if hasattr(self.model, "no_weight_decay") else set()
        return decay_groups(self.model, self.optimiser.weight_decay, skip=skip)


class ConvNetTask(ClassifierTask):
    """Trains the small CNN of ``vit/convnet.py``, the ViT's teacher for DeiT's distillation (``ViTTask``'s
    ``distillation.teacher``), with the ViT's optimiser, schedule, label smoothing and data links.

    Args:
        log_overlays: unused (a CNN has no attention to draw); kept for the tasks' common signature
    """

    kind = CONVNET

    def __init__(self, *, num_classes: int = 10, class_names: list[str] | None = None, image: ImageFormat | None = None,
                 architecture: ConvNetArchitecture = ConvNetArchitecture(),
                 training: ClassifierTraining = ClassifierTraining(), optimiser: Optimiser = OPTIMISER,
                 schedule: Schedule = SCHEDULE, log_overlays: int = 0) -> None:
        super().__init__(num_classes=num_classes, class_names=class_names, image=image,
                         training=ClassifierTraining.coerce(training), optimiser=optimiser, schedule=schedule,
                         log_overlays=log_overlays)
        architecture = ConvNetArchitecture.coerce(architecture)
        self.model = ConvNet(in_chans=self.image.channels, num_classes=num_classes, widths=architecture.widths,
                             drop_rate=self.training_options.drop_rate)
        self.save_options(architecture=architecture)


class ViTTask(ClassifierTask):
    """Trains ``VisionTransformer`` with AdamW, warm-up + cosine and label smoothing; logs top-1 accuracy.

    With object masks in the evaluation batches (``FashionMNISTCanvasDataModule``), validation and test also log
    where rollout and the last layer's attention fall.

    Args:
        pretrained: the first weights: a local ViT weights file (timm's or a fit's) or timm:<model>[.<tag>] from the
            Hugging Face cache (head and position embedding adapted); read when a fit starts
        compile: run the model through torch.compile (the same parameters and checkpoints)
        log_overlays: after each validation, log the rollout overlays of this many validation images (0: none)
    """

    kind = VIT

    def __init__(self, *, num_classes: int = 10, class_names: list[str] | None = None, image: ImageFormat | None = None,
                 architecture: ViTArchitecture = ViTArchitecture(), training: ViTTraining = ViTTraining(),
                 distillation: Distillation = Distillation(), optimiser: Optimiser = OPTIMISER,
                 schedule: Schedule = SCHEDULE, pretrained: str | None = None, compile: bool = False,
                 log_overlays: int = 4) -> None:
        super().__init__(num_classes=num_classes, class_names=class_names, image=image,
                         training=ViTTraining.coerce(training), optimiser=optimiser, schedule=schedule,
                         log_overlays=log_overlays)
        architecture, self.distillation = ViTArchitecture.coerce(architecture), Distillation.coerce(distillation)
        training = self.training_options
        if architecture.dist_token and not self.distillation.teacher:
            log.info("dist_token without a teacher: the distillation head learns the labels too")
        if training.attention_grounding and self.distillation.teacher:
            raise ValueError("training.attention_grounding is not combined with a teacher (distillation.teacher "
                             f"{self.distillation.teacher})")
        self._teacher: list[nn.Module] = []  # a list: the teacher is not a submodule, so not in checkpoints
        self.model = build_vit(self.image, num_classes, architecture, training)
        if pretrained:
            fresh = load_pretrained(self.model, pretrained)
            log.info("loaded %s (fresh: %s)", pretrained, ", ".join(fresh) or "nothing")
        # where the maps fall, when the evaluation batches carry object masks (FashionMNISTCanvasDataModule)
        self.map_scores = nn.ModuleDict({f"{stage}_{name}": torchmetrics.MeanMetric() for stage in ("val", "test")
                                         for name in MAP_SCORES})
        if compile:
            self.model.compile()  # in place: parameter names and checkpoints stay the same
        self.save_options(architecture=architecture, distillation=self.distillation, pretrained=pretrained,
                          compile=compile)

    def setup(self, stage: str) -> None:
        """For a fit with a ``distillation.teacher``: load it (a distillation token's head then learns it)."""
        if stage == "fit" and self.distillation.teacher and not self._teacher:
            self._teacher.append(load_teacher(self.distillation.teacher, self.num_classes, self.image))
            self.model.distilled_training = self.model.dist_token is not None

    def on_train_start(self) -> None:
        """Move the teacher (not a submodule) to the task's device."""
        for teacher in self._teacher:
            teacher.to(self.device)

    def classification_loss(self, images: Tensor, labels: Tensor, boxes: Tensor | None = None,
                            origins: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(loss, logits): cross-entropy, the grounded loss, or DeiT's distillation loss (train/teacher_loss);
        PatchDropout's rate follows the run's progress when scheduled (train/patch_drop_rate)."""
        options = self.training_options
        if options.patch_drop_rate_end is not None:  # p = p_0 + (p_end − p_0) · (the share of the run done)
            start, end = options.patch_drop_rate, options.patch_drop_rate_end
            self.model.patch_drop_rate = start + (end - start) * self.schedule.progress()
            self.log("train/patch_drop_rate", self.model.patch_drop_rate, on_step=False, on_epoch=True)
        if options.attention_grounding:
            return self.grounded_loss(images, labels, boxes, origins)
        if origins is not None and self._teacher:
            raise ValueError("a teacher reads whole images: train without windows (train_window) to distil")
        if not self._teacher:
            logits = self.model.forward_head(self.model.forward_features(images, window_origin=origins))
            return F.cross_entropy(logits, labels, label_smoothing=options.label_smoothing), logits
        with torch.no_grad():
            teacher_logits = self._teacher[0](images).float()
        output = self.model(images)
        logits, distilled = output if isinstance(output, tuple) else (output, output)
        loss, teacher_loss = distillation_loss(self.distillation, logits, distilled, teacher_logits, labels,
                                               options.label_smoothing)
        self.log("train/teacher_loss", teacher_loss)
        return loss, (logits + distilled) / 2

    def grounded_loss(self, images: Tensor, labels: Tensor, boxes: Tensor | None,
                      origins: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Cross-entropy + ``attention_grounding`` × −log(the share of the rollout on the object's box), each patch
        counting by how much of it the box covers."""
        if boxes is None:
            raise ValueError("training.attention_grounding needs training batches that carry the objects' boxes, as "
                             "FashionMNISTCanvasDataModule's do")
        tokens, attentions, kept = self.model.forward_intermediates(images, window_origin=origins)
        logits = self.model.forward_head(tokens)
        height, width = images.shape[-2:]
        corners = torch.cat([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], dim=1).to(images.dtype)  # x0 y0 x1 y1
        corners = corners / corners.new_tensor([width, height, width, height])
        patch = self.model.patch_embed.patch_size
        coverage = box_cell_coverage(corners, (height // patch, width // patch))  # (B, N): each patch's share in it
        if kept is not None:
            coverage = coverage.gather(1, kept)  # the patches PatchDropout kept, (B, K)
        weights = pooled_weights(attention_rollout(attentions), self.model.global_pool,
                                 self.model.num_prefix_tokens)  # (B, K)
        share = (weights * coverage).sum(-1) / weights.sum(-1).clamp_min(1e-12)
        grounding = -share.clamp_min(1e-6).log().mean()
        self.log("train/grounding", grounding)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.training_options.label_smoothing)
        return loss + self.training_options.attention_grounding * grounding, logits

    def evaluation_logits(self, images: Tensor, masks: list[Tensor], stage: str) -> Tensor:
        """The logits; with the objects' masks, where rollout and the last layer fall ({stage}/``MAP_SCORES``)."""
        if not masks:
            return self.model(images)
        maps = explain(self.model, images)  # scored as docs/formats/metrics.md says
        for name, (mass, hits) in map_scores(maps, masks[0]).items():  # rollout and the last layer
            key = f"{stage}_{name.replace(' ', '_')}"
            self.map_scores[f"{key}_mass"](mass)
            self.map_scores[f"{key}_pointing"](hits.float())
        for name in MAP_SCORES:
            self.log(f"{stage}/{name}", self.map_scores[f"{stage}_{name}"])
        return maps.logits

    def overlay_figures(self, batch: tuple[Tensor, Tensor], outputs: None, count: int) -> list[tuple[str, Image.Image]]:
        """Rollout and last-layer overlays of a validation batch's first ``count`` images, with their labels."""
        classifier = Classifier.from_hparams(self.model, self.hparams)
        return validation_figures(classifier, batch[0][:count].detach(), batch[1][:count].detach())
