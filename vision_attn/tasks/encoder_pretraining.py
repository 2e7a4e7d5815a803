"""Pretraining the captioner's encoder on a classification set, as the paper's VGGnet was on ImageNet (Xu et al.
2015, §4.3); on Fashion scenes, single items with their class and colour. A captioner starts from it with
``encoder.pretrained``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from vision_attn.captioning.encoder import EncoderClassifier
from vision_attn.captioning.options import EncoderOptions
from vision_attn.checkpoint import ENCODER
from vision_attn.option_groups import ImageFormat, Optimiser, Schedule
from vision_attn.tasks.base import BaseTask, decay_groups

OPTIMISER, SCHEDULE = Optimiser(lr=3e-3, weight_decay=0.05), Schedule(warmup_epochs=0.1)


class EncoderPretrainingTask(BaseTask):
    """Trains ``EncoderClassifier``; logs top-1 accuracy of the class (``<stage>/acc``) and of the colour
    (``<stage>/colour_acc``). Targets are labels (B,), or ``[label, colour]`` pairs (B, 2) as
    ``FashionSceneItemsDataModule`` gives them with its ``colour_names``; without colour names, colours are left
    out. ``encoder`` must be the captioner's (its backbone, width and stride).

    Args:
        label_smoothing: the training cross-entropies' label smoothing (of the class and of the colour)
    """

    kind = ENCODER

    def __init__(self, *, encoder: EncoderOptions = EncoderOptions(), num_classes: int = 10,
                 class_names: list[str] | None = None, colour_names: list[str] | None = None,
                 image: ImageFormat | None = None, label_smoothing: float = 0.1, optimiser: Optimiser = OPTIMISER,
                 schedule: Schedule = SCHEDULE) -> None:
        super().__init__(optimiser=Optimiser.coerce(optimiser, OPTIMISER), schedule=Schedule.coerce(schedule, SCHEDULE))
        encoder, image, colours = EncoderOptions.coerce(encoder), ImageFormat.coerce(image), list(colour_names or [])
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        if image.channels != 3:
            raise ValueError(f"the captioner's encoder reads RGB images (3 channels), but the data has "
                             f"{image.channels}")
        self.label_smoothing = label_smoothing
        self.model = EncoderClassifier(encoder, num_classes=num_classes, num_colours=len(colours),
                                       image_size=image.size)
        # top-1 accuracies per stage, keyed "<stage>_" ("train" is taken by nn.Module.train)
        self.accuracy = nn.ModuleDict({f"{stage}_": MulticlassAccuracy(num_classes, average="micro")
                                       for stage in ("train", "val", "test")})
        self.colour_accuracy = nn.ModuleDict({f"{stage}_": MulticlassAccuracy(max(len(colours), 2), average="micro")
                                              for stage in ("train", "val", "test")}) if colours else None
        self.save_options(encoder=self.model.encoder.options, num_classes=num_classes, class_names=class_names,
                          colour_names=colours, image=image, label_smoothing=label_smoothing,
                          optimiser=self.optimiser, schedule=self.schedule.options)

    def _step(self, batch: tuple[Tensor, Tensor] | None, stage: str) -> Tensor | None:
        if batch is None:
            return None
        images, targets = batch
        labels, colours = (targets[:, 0], targets[:, 1]) if targets.ndim == 2 else (targets, None)
        class_logits, colour_logits = self.model(images)
        training = stage == "train"
        smoothing = self.label_smoothing if training else 0.0
        loss = F.cross_entropy(class_logits, labels, label_smoothing=smoothing)
        self._count(self.accuracy[f"{stage}_"], class_logits, labels, f"{stage}/acc", training=training)
        if colour_logits is not None:
            if colours is None:
                raise ValueError("the task has colour names, but the data gives no colours")
            loss = loss + F.cross_entropy(colour_logits, colours, label_smoothing=smoothing)
            self._count(self.colour_accuracy[f"{stage}_"], colour_logits, colours, f"{stage}/colour_acc",
                        training=training, prog_bar=False)
        self.log(f"{stage}/loss", loss, prog_bar=training, batch_size=len(images), sync_dist=not training)
        return loss

    def _count(self, accuracy: MulticlassAccuracy, logits: Tensor, targets: Tensor, name: str, *, training: bool,
               prog_bar: bool = True) -> None:
        # training batches are only counted (on_train_epoch_end logs them): logging each step took time
        if training:
            accuracy.update(logits.detach(), targets)
        else:
            accuracy(logits, targets)
            self.log(name, accuracy, prog_bar=prog_bar, on_step=False, on_epoch=True)

    def on_train_epoch_end(self) -> None:
        """Log the epoch's train/acc (and train/colour_acc) from the counted batches, and reset them."""
        counted = [("train/acc", self.accuracy["train_"])]
        if self.colour_accuracy is not None:
            counted.append(("train/colour_acc", self.colour_accuracy["train_"]))
        for name, accuracy in counted:
            if accuracy.update_called:  # an epoch of only skipped batches counts nothing
                self.log(name, accuracy.compute(), sync_dist=True)  # computed over every rank's counts already
            accuracy.reset()

    def training_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """The class (and colour) cross-entropy with label smoothing, logged as train/loss."""
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> None:
        """Log val/loss (without label smoothing), val/acc and val/colour_acc."""
        self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> None:
        """Log test/loss (without label smoothing), test/acc and test/colour_acc."""
        self._step(batch, "test")

    def parameter_groups(self) -> list[dict]:
        """The trainable parameters, weight decay on matrices only."""
        return decay_groups(self.model, self.optimiser.weight_decay)
