"""LightningModule for the ViT classifier: the loss, accuracy, the optimiser and its schedule.

The checkpoint kind, the non-finite guard, warm-up + cosine and the overlay logging live in ``task.py``.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
import torchmetrics
from PIL import Image
from torch import Tensor

from vision_attn.checkpoint import VIT
from vision_attn.schedule import decay_groups
from vision_attn.task import BaseTask
from vision_attn.vit.inference import Classifier, map_scores, validation_figures, vit_from_hparams
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.vit.rollout import explain

log = logging.getLogger(__name__)

MAP_SCORES = ("rollout_mass", "rollout_pointing", "last_layer_mass", "last_layer_pointing")


class ViTClassifier(BaseTask):
    """Trains ``VisionTransformer`` with AdamW, warm-up + cosine, label smoothing; logs top-1 accuracy.

    ``num_classes``, ``in_chans``, ``image_size``, ``class_names``, ``mean`` and ``std`` are linked from the
    DataModule by the CLI, and stored with the checkpoint, so ``classify`` can preprocess new images alone.
    When the evaluation batches carry object masks, ``(images, labels, masks)`` as
    ``FashionMNISTCanvasDataModule``'s do, validation and test also log where rollout and the last layer's
    attention (its heads' mean) fall: ``{stage}/rollout_mass``, ``{stage}/rollout_pointing``,
    ``{stage}/last_layer_mass`` and ``{stage}/last_layer_pointing`` (SPEC §5; ``metrics.pointing_game``).
    After each validation epoch (not the sanity check), rank 0 logs rollout overlays of the first
    ``log_overlays`` validation images (0: none). With ``schedule_by_time`` and a ``trainer.max_time``, the
    cosine decay runs over the time budget as well as the steps (whichever is further along), so a run capped
    by time always finishes its schedule; ``max_epochs`` is then an upper bound. ``pretrained`` is a local
    weights file or ``timm:<model name>[.<tag>]`` (timm's weights from the Hugging Face cache), adapted to this
    ViT (``vit/pretrained.py``).
    """

    kind = VIT

    def __init__(
        self,
        *,
        num_classes: int = 10,
        image_size: int = 28,
        in_chans: int = 1,
        patch_size: int = 4,
        embed_dim: int = 64,
        depth: int = 6,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        patch_drop_rate: float = 0.0,
        global_pool: Literal["token", "avg"] = "token",
        pos_embed_init: Literal["trunc_normal", "sincos"] = "trunc_normal",
        zero_init_head: bool = False,
        fused_attention: bool = True,
        stem: Literal["patch", "conv"] = "patch",
        reg_tokens: int = 0,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.0,
        schedule_by_time: bool = False,
        label_smoothing: float = 0.0,
        pretrained: str | None = None,
        compile: bool = False,
        log_overlays: int = 4,
        class_names: list[str] | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        self.model = vit_from_hparams(self.hparams)
        if pretrained:
            fresh = load_pretrained(self.model, pretrained)
            log.info("loaded %s (fresh: %s)", pretrained, ", ".join(fresh) or "nothing")
        # top-1 accuracy over images (micro): torchmetrics' default would average the per-class recalls
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.test_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        # the mean loss over images, summed and counted across DDP ranks (a mean of rank means would weigh
        # ranks with fewer images too much)
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()
        # where the maps fall, when the evaluation batches carry object masks (FashionMNISTCanvasDataModule)
        self.map_scores = torch.nn.ModuleDict({f"{stage}_{name}": torchmetrics.MeanMetric() for stage in ("val", "test")
                                               for name in MAP_SCORES})
        if compile:
            self.model.compile()  # in place: parameter names and checkpoints stay the same

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, ...] | None, stage: str, accuracy: torchmetrics.Metric,
                  mean_loss: torchmetrics.Metric) -> None:
        if batch is None:
            return
        images, labels, *masks = batch
        if masks:  # items with masks: also score where rollout and the last layer's attention fall (SPEC §5)
            maps = explain(self.model, images)
            logits = maps.logits
            for name, (mass, hits) in map_scores(maps, masks[0]).items():  # rollout and the last layer
                key = f"{stage}_{name.replace(' ', '_')}"
                self.map_scores[f"{key}_mass"](mass)
                self.map_scores[f"{key}_pointing"](hits.float())
            for name in MAP_SCORES:
                self.log(f"{stage}/{name}", self.map_scores[f"{stage}_{name}"])
        else:
            logits = self.model(images)
        accuracy(logits, labels)
        mean_loss(F.cross_entropy(logits, labels, reduction="none"))
        self.log(f"{stage}/loss", mean_loss)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, ...] | None, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy, self.val_loss)

    def overlay_figures(self, batch: tuple[Tensor, Tensor], outputs: None, count: int) -> list[tuple[str, Image.Image]]:
        classifier = Classifier.from_hparams(self.model, self.hparams)
        return validation_figures(classifier, batch[0][:count].detach(), batch[1][:count].detach())

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy, self.test_loss)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0]).softmax(dim=-1)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        groups = decay_groups(self.model, self.hparams.weight_decay, skip=self.model.no_weight_decay())
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=self.hparams.betas)
        return self.warmup_cosine(optimizer, warmup_epochs=self.hparams.warmup_epochs,
                                  min_lr_ratio=self.hparams.min_lr_ratio, by_time=self.hparams.schedule_by_time)
