"""What the command line adds to every Trainer it builds (``trainer_cli.VisionAttnCLI.instantiate_trainer``), on
Lightning's public classes and hooks only: checkpoints written atomically and read weights-only, a paced progress
bar, a ``last`` checkpoint of the final weights, and a Trainer whose whole-number batch limits count batches."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vision_attn.checkpoint import load_file
from vision_attn.io import replace_atomically


class SafeCheckpointIO(TorchCheckpointIO):
    """Checkpoints read only by ``checkpoint.load_file`` (weights-only, local, sound), and written to a temporary
    file then renamed, so a crash mid-write leaves the previous one whole (remote paths: Lightning's writer).
    ``writer``: a CheckpointIO of ``trainer.plugins`` that writes and removes in its place; reading stays ours."""

    def __init__(self, writer: CheckpointIO | None = None) -> None:
        super().__init__()
        self.writer = writer
        if writer is not None and getattr(writer, "checkpoint_io", False) is None:  # a wrapper (AsyncCheckpointIO)
            writer.checkpoint_io = SafeCheckpointIO()  # with no writer of its own: the strategy gives none to ours

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: object | None = None) -> None:
        """Write ``checkpoint`` with the ``writer``, else to a local ``path`` atomically."""
        if self.writer is not None:
            return self.writer.save_checkpoint(checkpoint, path, storage_options)
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        replace_atomically(path, lambda file: torch.save(checkpoint, file))
        return None

    def remove_checkpoint(self, path: str | Path) -> None:
        """Remove a checkpoint with the ``writer``, else Lightning's way."""
        (self.writer or super()).remove_checkpoint(path)

    def teardown(self) -> None:
        """Let the ``writer`` finish (an asynchronous one waits for its last save)."""
        if self.writer is not None:
            self.writer.teardown()

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """Read a local checkpoint weights-only with ``checkpoint.load_file`` (on the CPU unless told otherwise)."""
        return load_file(path, map_location=map_location or "cpu")


class PacedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bars, redrawn at most every ``interval`` seconds and at each bar's last batch: redrawing at
    each of a fast model's steps takes a share of a time-budgeted fit's steps on a CPU. A batch-end hook passes
    only the batches ``due`` on to ``TQDMProgressBar``'s, which sets the bar to the batch's count."""

    def __init__(self, interval: float = 0.2) -> None:
        super().__init__()
        self.interval = interval
        self.drawn_at = float("-inf")

    def due(self, batch_idx: int, bar: Any) -> bool:
        """Whether batch ``batch_idx`` of ``bar`` is drawn (and restarts the interval): the last, or one ``interval``
        after the last drawn."""
        now = time.monotonic()
        last = bar.total is not None and batch_idx + 1 >= bar.total
        if last or now - self.drawn_at >= self.interval:
            self.drawn_at = now
            return True
        return False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Draw the training bar when ``due``."""
        if self.due(batch_idx, self.train_progress_bar):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """Draw the validation bar when ``due``."""
        if self.due(batch_idx, self.val_progress_bar):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        """Draw the test bar when ``due``."""
        if self.due(batch_idx, self.test_progress_bar):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        """Draw the predict bar when ``due``."""
        if self.due(batch_idx, self.predict_progress_bar):
            super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)


class FinalWeightsInLast(L.Callback):
    """``last.ckpt`` holds the weights the fit ended with: Lightning (2.6) writes it only with a top-k checkpoint,
    so a fit that ``max_time`` stops after a validation that did not improve kept an earlier step. Each
    ``save_last: true`` ModelCheckpoint writes it again when no checkpoint was written at the final step."""

    def __init__(self) -> None:
        self.saved_at_step = -1

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """Note the step of the checkpoint being written."""
        self.saved_at_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write each ``save_last: true`` checkpoint's ``last`` again unless one was written at the final step."""
        if trainer.fast_dev_run or self.saved_at_step == trainer.global_step:
            return
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "save_last", None) is True and getattr(callback, "last_model_path", ""):
                trainer.save_checkpoint(callback.last_model_path)


class BatchCountTrainer(L.Trainer):
    """Lightning's Trainer, where a whole-number batch limit counts batches (1 is one batch, not all of them).

    Lightning types the ``limit_*_batches`` ``float | int``, so jsonargparse reads ``1`` as ``1.0``, all the
    batches; typed ``int | float`` here, ``1`` is one batch in the run and its ``config.yaml``."""

    def __init__(self, *, limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
                 limit_test_batches: int | float | None = None, limit_predict_batches: int | float | None = None,
                 **kwargs: Any) -> None:
        """Lightning's Trainer with these four limits; ``kwargs`` are its other options.

        Args:
            limit_train_batches: training batches per epoch and device: a whole number of batches (1 is one), or a
                fraction written with a point (1.0 is all, 0.5 half). Default: all
            limit_val_batches: validation batches per run and device, a whole number or a fraction (as above)
            limit_test_batches: test batches per device, a whole number or a fraction (as above)
            limit_predict_batches: prediction batches per device, a whole number or a fraction (as above)
        """
        super().__init__(limit_train_batches=limit_train_batches, limit_val_batches=limit_val_batches,
                         limit_test_batches=limit_test_batches, limit_predict_batches=limit_predict_batches, **kwargs)
