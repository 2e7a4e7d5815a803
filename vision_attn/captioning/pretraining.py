"""The Lightning task that pretrains the captioner's encoder on a classification set, as the paper's encoder
was: "the Oxford VGGnet pretrained on ImageNet ... we use the 14×14×512 feature map of the fourth
convolutional layer before max pooling" (Xu et al. 2015, §4.3). On Fashion scenes the set is single
Fashion-MNIST items drawn as the scenes draw them (``FashionSceneItemsDataModule``), with their class and
colour as targets. The classifier is ``encoder.EncoderClassifier``; a captioner starts from its trunk with
``pretrained_encoder: <this run's checkpoint>``, and the heads are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from vision_attn.captioning.encoder import EncoderClassifier
from vision_attn.checkpoint import ENCODER
from vision_attn.data.scenes import COLOURS
from vision_attn.schedule import decay_groups
from vision_attn.task import BaseTask


class EncoderPretraining(BaseTask):
    """Trains ``EncoderClassifier`` with AdamW, label smoothing and warm-up + cosine (over ``max_time`` with
    ``schedule_by_time``); logs top-1 accuracy of the class (``<stage>/acc``) and of the colour
    (``<stage>/colour_acc``). Targets are labels (B,), or ``[label, colour]`` pairs (B, 2) as
    ``FashionSceneItemsDataModule`` gives them; ``num_colours: 0`` leaves colours out.

    ``backbone``, ``encoder_width`` and ``encoder_stride`` must be the captioner's. ``num_classes``,
    ``class_names``, ``image_size``, ``in_chans``, ``mean`` and ``std`` are linked from the DataModule and kept
    with the checkpoint: a captioner refuses an encoder pretrained under another normalisation.
    """

    kind = ENCODER

    def __init__(
        self, *, backbone: str = "small", encoder_width: int = 32, encoder_stride: int = 16, num_classes: int = 10,
        num_colours: int = len(COLOURS), lr: float = 3e-3, weight_decay: float = 0.05, label_smoothing: float = 0.1,
        warmup_epochs: float = 0.1, schedule_by_time: bool = False, class_names: list[str] | None = None,
        image_size: int = 32, in_chans: int = 3, mean: list[float] | None = None, std: list[float] | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        if in_chans != 3:
            raise ValueError(f"the captioner's encoder reads RGB images (in_chans 3), but the data has {in_chans}")
        self.model = EncoderClassifier(backbone=backbone, encoder_width=encoder_width, encoder_stride=encoder_stride,
                                       num_classes=num_classes, num_colours=num_colours,
                                       channels_last=channels_last)
        # top-1 accuracies per stage, keyed "<stage>_" ("train" is taken by nn.Module.train)
        self.accuracy = nn.ModuleDict({f"{stage}_": MulticlassAccuracy(num_classes, average="micro")
                                       for stage in ("train", "val", "test")})
        self.colour_accuracy = nn.ModuleDict({f"{stage}_": MulticlassAccuracy(max(num_colours, 2), average="micro")
                                              for stage in ("train", "val", "test")}) if num_colours else None

    def _step(self, batch: tuple[Tensor, Tensor] | None, stage: str) -> Tensor | None:
        if batch is None:
            return None
        images, targets = batch
        labels, colours = (targets[:, 0], targets[:, 1]) if targets.ndim == 2 else (targets, None)
        class_logits, colour_logits = self.model(images)
        training = stage == "train"
        smoothing = self.hparams.label_smoothing if training else 0.0
        loss = F.cross_entropy(class_logits, labels, label_smoothing=smoothing)
        self._count(self.accuracy[f"{stage}_"], class_logits, labels, f"{stage}/acc", training=training)
        if colour_logits is not None:
            if colours is None:
                raise ValueError("num_colours is set, but the data gives no colours: use num_colours: 0")
            loss = loss + F.cross_entropy(colour_logits, colours, label_smoothing=smoothing)
            self._count(self.colour_accuracy[f"{stage}_"], colour_logits, colours, f"{stage}/colour_acc",
                        training=training, prog_bar=False)
        self.log(f"{stage}/loss", loss, prog_bar=training, batch_size=len(images), sync_dist=not training)
        return loss

    def _count(self, accuracy: MulticlassAccuracy, logits: Tensor, targets: Tensor, name: str, *, training: bool,
               prog_bar: bool = True) -> None:
        """Add a batch to an epoch's accuracy. Training batches are only counted (``on_train_epoch_end`` logs the
        epoch's figure): logging the two metrics at every step cost ~1.5 ms of each ~30 ms step on 2 cores,
        steps the 4-minute pretraining did not take. Validation and test log them as Lightning does."""
        if training:
            accuracy.update(logits.detach(), targets)
        else:
            accuracy(logits, targets)
            self.log(name, accuracy, prog_bar=prog_bar, on_step=False, on_epoch=True)

    def on_train_epoch_end(self) -> None:
        counted = [("train/acc", self.accuracy["train_"])]
        if self.colour_accuracy is not None:
            counted.append(("train/colour_acc", self.colour_accuracy["train_"]))
        for name, accuracy in counted:
            if accuracy.update_called:  # an epoch of only skipped batches counts nothing
                self.log(name, accuracy.compute(), sync_dist=True)  # computed over every rank's counts already
            accuracy.reset()

    def training_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> None:
        self._step(batch, "test")

    def overlay_figures(self, batch: tuple[Tensor, Tensor], outputs: None, count: int) -> list:
        return []  # classifiers on pooled features: no attention to draw

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        optimizer = torch.optim.AdamW(decay_groups(self.model, self.hparams.weight_decay), lr=self.hparams.lr)
        return self.warmup_cosine(optimizer, warmup_epochs=self.hparams.warmup_epochs,
                                  by_time=self.hparams.schedule_by_time)
