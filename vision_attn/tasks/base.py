"""What every task shares (torchgeo's ``BaseTask``): the guarded training step, the optimiser and schedule, the
checkpoint's kind, version and random streams, and the callbacks. A task names its ``kind``, builds ``self.model``,
calls ``save_options``, and defines ``training_loss``, ``parameter_groups`` and maybe ``overlay_figures``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from PIL import Image
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

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
    without_initial_weights,
)
from vision_attn.datamodules.split_datamodule import SplitDataModule
from vision_attn.option_groups import Optimiser, Schedule, plain
from vision_attn.overlay import log_figures
from vision_attn.tasks.schedule import RunSchedule


class SkippedImagesReport(L.Callback):
    """At each epoch's end (not the sanity check), log how many unreadable images the DataModule skipped."""

    @staticmethod
    def _report(trainer: L.Trainer, stage: str) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if isinstance(datamodule, SplitDataModule) and not trainer.sanity_checking:
            datamodule.report_skipped(f"{stage} epoch {trainer.current_epoch}")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Log the images skipped in this training epoch."""
        self._report(trainer, "train")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Log the images skipped in this validation epoch."""
        self._report(trainer, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Log the images skipped in the test epoch."""
        self._report(trainer, "test")


class DataFilesBesideCheckpoints(L.Callback):
    """As a fit starts, rank 0 has the DataModule write its ``save_files(folder)`` (``vocab.json``) in the checkpoint
    folder."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Rank 0 has the DataModule save its files."""
        folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        save = getattr(getattr(trainer, "datamodule", None), "save_files", None)
        if trainer.is_global_zero and folder and save is not None:
            save(Path(folder))


class ValidationOverlays(L.Callback):
    """After each validation (not the sanity check), rank 0 logs the task's attention figures of the first ``count``
    images of the first validation batch: to TensorBoard, or as PNGs beside a CSV log."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pending: tuple[Any, Any] | None = None

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """Keep the first validation batch and its step output."""
        if batch is not None and batch_idx == 0 and self.count > 0 and not trainer.sanity_checking \
                and trainer.is_global_zero:
            self._pending = (batch, outputs)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Log the task's ``overlay_figures`` of the kept batch at the current step."""
        if self._pending is not None:
            (batch, outputs), self._pending = self._pending, None
            log_figures(pl_module.loggers, pl_module.overlay_figures(batch, outputs, self.count),
                        step=pl_module.global_step, fallback_dir=trainer.default_root_dir)


def decay_groups(model: nn.Module, weight_decay: float, skip: set[str] = frozenset()) -> list[dict]:
    """Weight decay on matrices only; biases, norms and the names in ``skip`` are left undecayed."""
    trained = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    decay = [parameter for name, parameter in trained if parameter.ndim >= 2 and name not in skip]
    no_decay = [parameter for name, parameter in trained if parameter.ndim < 2 or name in skip]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class BaseTask(L.LightningModule):
    """The part of a LightningModule that every vision-attn task repeats; see the module docstring."""

    kind: ClassVar[str]  # the model family written into checkpoints: checkpoint.VIT, CAPTIONER, ENCODER or CONVNET

    def __init__(self, *, optimiser: Optimiser, schedule: Schedule | None = None, log_overlays: int = 0) -> None:
        super().__init__()
        if log_overlays < 0:
            raise ValueError(f"log_overlays must be 0 or more, got {log_overlays}")
        self.optimiser, self.schedule, self.log_overlays = optimiser, RunSchedule(schedule), log_overlays

    def save_options(self, **options: Any) -> None:
        """Save the task's arguments (its groups as plain dicts) as the checkpoint's hyper-parameters."""
        self.save_hyperparameters(plain(options))

    def training_loss(self, batch: Any) -> Tensor:
        """The loss of one training batch (never None: ``training_step`` skips empty batches)."""
        raise NotImplementedError

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The optimiser's parameter groups."""
        raise NotImplementedError

    def overlay_figures(self, batch: Any, outputs: Any, count: int) -> list[tuple[str, Image.Image]]:
        """(tag, figure) of the attention of a validation batch's first ``count`` images (none by default)."""
        return []

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> BaseTask:
        """Lightning's ``load_from_checkpoint``, local files and weights-only (else refused in one line); the files
        its fit started from are not read (``checkpoint.INITIAL_WEIGHTS``): it holds those weights."""
        path = local_path(checkpoint_path)
        hparams = load_file(path).get("hyper_parameters")  # refuses folders, missing files and pickled code first
        if isinstance(hparams, dict):
            cleared = without_initial_weights(getattr(cls, "kind", ""), hparams)
            kwargs = {**{key: value for key, value in cleared.items() if value != hparams.get(key)}, **kwargs}
        return super().load_from_checkpoint(path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=True, **kwargs)

    def configure_callbacks(self) -> list[L.Callback]:
        """The skipped-image report, the data files, the overlays and the schedule."""
        return [SkippedImagesReport(), DataFilesBesideCheckpoints(), ValidationOverlays(self.log_overlays),
                self.schedule]

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over ``parameter_groups``, its rate following the run's schedule at every step."""
        options = self.optimiser
        optimizer = torch.optim.AdamW(self.parameter_groups(), lr=options.lr, betas=tuple(options.betas),
                                      weight_decay=options.weight_decay)
        self.schedule.attach(self.trainer)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": LambdaLR(optimizer, self.schedule.lr_factor), "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """``training_loss`` of the batch (None for an empty batch); a non-finite loss stops the run."""
        if batch is None:  # every image of the batch was unreadable (skipped and counted by the DataModule)
            return None
        loss = self.training_loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {self.global_step}; stopping "
                                     "(the checkpoints written so far are intact)")
        return loss

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Stamp the model kind and version, and keep the random streams for an exact resume."""
        stamp(checkpoint, self.kind)
        checkpoint[RNG_KEY] = capture_rng_state()  # augmentation and dropout continue where they were

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Upgrade an older checkpoint, refuse another model kind's, and restore its random streams."""
        upgrade(checkpoint)
        require_kind(checkpoint.get(KIND_KEY), self.kind, training=True)
        restore_rng_state(checkpoint.get(RNG_KEY))
