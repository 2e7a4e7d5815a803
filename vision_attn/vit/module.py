"""LightningModule for the ViT classifier: loss, accuracy, optimiser and schedule."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Timer
from torch import Tensor

from vision_attn.checkpoint import KIND_KEY, RNG_KEY, capture_rng_state, require_kind, restore_rng_state
from vision_attn.data.base import report_skipped_images
from vision_attn.data.images import denormalize, to_pil
from vision_attn.overlay import fit_within, log_figures, vit_figure
from vision_attn.schedule import decay_groups, warmup_cosine
from vision_attn.vit.model import VisionTransformer
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.vit.rollout import explain

log = logging.getLogger(__name__)


class ViTClassifier(L.LightningModule):
    """Trains ``VisionTransformer`` with AdamW, warm-up + cosine, label smoothing; logs top-1 accuracy.

    ``num_classes``, ``in_chans``, ``image_size``, ``class_names``, ``mean`` and ``std`` are linked from the
    DataModule by the CLI, and stored with the checkpoint, so ``classify`` can preprocess new images alone.
    After each validation epoch (not the sanity check), rank 0 logs rollout overlays of the first
    ``log_overlays`` validation images (0: none). With ``schedule_by_time`` and a ``trainer.max_time``, the
    cosine decay runs over the time budget as well as the steps (whichever is further along), so a run capped
    by time always finishes its schedule; ``max_epochs`` is then an upper bound.
    """

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
        self.model = VisionTransformer(
            img_size=image_size,
            patch_size=patch_size,
            in_chans=in_chans,
            num_classes=num_classes,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate,
            patch_drop_rate=patch_drop_rate,
            global_pool=global_pool,
            pos_embed_init=pos_embed_init,
            zero_init_head=zero_init_head,
            fused_attention=fused_attention,
        )
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
        if compile:
            self.model.compile()  # in place: parameter names and checkpoints stay the same
        self._overlay_batch: tuple[Tensor, Tensor] | None = None

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> Tensor | None:
        if batch is None:  # every image of the batch was unreadable (skipped and counted by the DataModule)
            return None
        images, labels = batch
        logits = self.model(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {self.global_step}; stopping "
                                     "(the checkpoints written so far are intact)")
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor] | None, stage: str, accuracy: torchmetrics.Metric,
                  mean_loss: torchmetrics.Metric) -> None:
        if batch is None:
            return
        images, labels = batch
        logits = self.model(images)
        accuracy(logits, labels)
        mean_loss(F.cross_entropy(logits, labels, reduction="none"))
        self.log(f"{stage}/loss", mean_loss)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy, self.val_loss)
        if batch is not None and batch_idx == 0 and self.hparams.log_overlays > 0 and not self.trainer.sanity_checking \
                and self.trainer.is_global_zero:
            count = self.hparams.log_overlays
            self._overlay_batch = (batch[0][:count].detach(), batch[1][:count].detach())

    def on_train_epoch_end(self) -> None:
        report_skipped_images(self.trainer, "train")

    def on_test_epoch_end(self) -> None:
        report_skipped_images(self.trainer, "test")

    def on_validation_epoch_end(self) -> None:
        report_skipped_images(self.trainer, "val")
        if self._overlay_batch is None:
            return
        images, labels = self._overlay_batch
        self._overlay_batch = None
        names = self.hparams.class_names or [str(i) for i in range(self.hparams.num_classes)]
        channels = self.hparams.in_chans
        pixels = denormalize(images, self.hparams.mean or [0.5] * channels, self.hparams.std or [0.5] * channels)
        was_training = self.model.training
        self.model.eval()
        maps = explain(self.model, images)
        self.model.train(was_training)
        figures = []
        for index, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
            probability, predicted = maps["logits"][index].softmax(dim=-1).max(dim=0)
            title = f"{names[predicted]} {probability.item():.0%} (true: {names[label]})"
            shown = fit_within(to_pil(image), 112)
            figures.append((f"val_overlay/{index}", vit_figure(shown, maps, index, names, title=title)))
        log_figures(self.loggers, figures, step=self.global_step, fallback_dir=self.trainer.default_root_dir)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy, self.test_loss)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0]).softmax(dim=-1)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[KIND_KEY] = "vit"
        checkpoint[RNG_KEY] = capture_rng_state()  # for an exact resume: augmentation and dropout continue

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        require_kind(checkpoint.get(KIND_KEY), "vit", training=True)
        restore_rng_state(checkpoint.get(RNG_KEY))

    def _time_budget_used(self) -> Callable[[], float] | None:
        """The fraction of the trainer's ``max_time`` used by training so far, or None without a time cap."""
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)
        if timer is None or timer.time_remaining("train") is None:
            log.warning("schedule_by_time is set but the trainer has no max_time: the schedule follows the steps")
            return None

        def used() -> float:
            elapsed, remaining = timer.time_elapsed("train"), timer.time_remaining("train")
            return elapsed / max(1e-9, elapsed + remaining)

        return used

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        groups = decay_groups(self.model, self.hparams.weight_decay, skip=self.model.no_weight_decay())
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=self.hparams.betas)
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        steps_per_epoch = total_steps / max(1, self.trainer.max_epochs or 1)
        warmup_steps = max(1, round(self.hparams.warmup_epochs * steps_per_epoch))
        schedule = warmup_cosine(
            optimizer, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=self.hparams.min_lr_ratio,
            time_progress=self._time_budget_used() if self.hparams.schedule_by_time else None,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
