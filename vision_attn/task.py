"""What both LightningModules share, written once (torchgeo's ``BaseTask``): the guarded training step,
warm-up and cosine, the checkpoint's model kind, version and random streams, and two callbacks every task
brings along, the skipped-image report and the validation overlays.

A task subclasses ``BaseTask``, names its ``kind`` and defines ``training_loss``, ``overlay_figures`` and
``configure_optimizers`` (which returns ``self.warmup_cosine(optimizer, ...)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from PIL import Image
from torch import Tensor
from torch.optim import Optimizer

from vision_attn.checkpoint import (
    KIND_KEY,
    RNG_KEY,
    capture_rng_state,
    load_file,
    local_path,
    require_kind,
    restore_rng_state,
    stamp,
    upgrade,
)
from vision_attn.datamodules.base import SplitDataModule
from vision_attn.overlay import log_figures
from vision_attn.schedule import warmup_cosine

log = logging.getLogger(__name__)


def budget_timer(trainer: L.Trainer) -> Timer | None:
    """Lightning's Timer when the trainer has a time budget (``max_time``), else None."""
    timer = next((callback for callback in trainer.callbacks if isinstance(callback, Timer)), None)
    return timer if timer is not None and timer.time_remaining("train") is not None else None


class SkippedImagesReport(L.Callback):
    """At each epoch's end (not the sanity check), log how many unreadable images the DataModule skipped."""

    @staticmethod
    def _report(trainer: L.Trainer, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if isinstance(datamodule, SplitDataModule) and not trainer.sanity_checking:
            datamodule.report_skipped(f"{stage} epoch {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "train")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, "test")


class ValidationOverlays(L.Callback):
    """After each validation epoch (not the sanity check), rank 0 logs the task's attention figures of the first
    ``count`` images of the first validation batch: to TensorBoard, or as PNGs beside a CSV log."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pending: tuple[Any, Any] | None = None

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch is not None and batch_idx == 0 and self.count > 0 and not trainer.sanity_checking \
                and trainer.is_global_zero:
            self._pending = (batch, outputs)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is None:
            return
        batch, outputs = self._pending
        self._pending = None
        figures = pl_module.overlay_figures(batch, outputs, self.count)
        log_figures(pl_module.loggers, figures, step=pl_module.global_step, fallback_dir=trainer.default_root_dir)


class BaseTask(L.LightningModule):
    """The part of a LightningModule that every vision-attn task repeats; see the module docstring."""

    kind: ClassVar[str]  # the model family written into checkpoints: checkpoint.VIT or checkpoint.CAPTIONER

    def training_loss(self, batch: Any) -> Tensor:
        """The loss of one training batch (never None: ``training_step`` skips empty batches)."""
        raise NotImplementedError

    def overlay_figures(self, batch: Any, outputs: Any, count: int) -> list[tuple[str, Image.Image]]:
        """(tag, figure) of the attention of the first ``count`` images of a validation batch and its step output."""
        raise NotImplementedError

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> BaseTask:
        """Lightning's ``load_from_checkpoint``, for local files only and always weights-only (a remote path, or a
        file whose pickle carries code, is refused in one line)."""
        path = local_path(checkpoint_path)
        load_file(path)  # refuses folders, missing files and pickled code before Lightning reads it
        return super().load_from_checkpoint(path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=True, **kwargs)

    def configure_callbacks(self) -> list[L.Callback]:
        return [SkippedImagesReport(), ValidationOverlays(self.hparams.get("log_overlays", 0))]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if batch is None:  # every image of the batch was unreadable (skipped and counted by the DataModule)
            return None
        loss = self.training_loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {self.global_step}; stopping "
                                     "(the checkpoints written so far are intact)")
        return loss

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        stamp(checkpoint, self.kind)
        checkpoint[RNG_KEY] = capture_rng_state()  # for an exact resume: augmentation and dropout continue

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        upgrade(checkpoint)
        require_kind(checkpoint.get(KIND_KEY), self.kind, training=True)
        restore_rng_state(checkpoint.get(RNG_KEY))

    def warmup_cosine(self, optimizer: Optimizer, *, warmup_epochs: float, min_lr_ratio: float = 0.0,
                      by_time: bool = False) -> dict[str, Any]:
        """Lightning's optimiser config: linear warm-up over ``warmup_epochs``, then cosine to ``min_lr_ratio``
        over the run's steps, or (``by_time``) over its ``max_time`` budget when that is further along."""
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        steps_per_epoch = total_steps / max(1, self.trainer.max_epochs or 1)
        warmup_steps = max(1, round(warmup_epochs * steps_per_epoch))
        schedule = warmup_cosine(optimizer, warmup_steps=warmup_steps, total_steps=total_steps,
                                 min_lr_ratio=min_lr_ratio, time_progress=self._time_budget_used() if by_time else None)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _time_budget_used(self) -> Callable[[], float] | None:
        """The fraction of the trainer's ``max_time`` used by training so far, or None without a time cap."""
        timer = budget_timer(self.trainer)
        if timer is None:
            log.warning("the schedule follows a time budget, but the trainer has no max_time: it follows the steps")
            return None

        def used() -> float:
            elapsed, remaining = timer.time_elapsed("train"), timer.time_remaining("train")
            return elapsed / max(1e-9, elapsed + remaining)

        return used
