"""What the command line adds to every Trainer it builds (``trainer_cli.VisionAttnCLI.instantiate_trainer``):
checkpoints written atomically and read weights-only, whatever CheckpointIO the config names
(``SafeCheckpointIO``), a progress bar redrawn at most a few times a second (``PacedProgressBar``), a ``last``
checkpoint that holds the weights the fit ended with (``FinalWeightsInLast``), and the Trainer class itself
(``BatchCountTrainer``: a whole-number batch limit is a count of batches). Each is built on Lightning's public
classes and hooks only.
"""

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
    """Checkpoints read only through ``checkpoint.load_file`` (weights-only, local, sound), and written to a
    temporary file beside the target, then renamed: a crash (even SIGKILL) mid-write leaves the previous checkpoint
    whole. Remote paths (``s3://`` ...) keep Lightning's own writer; they are never read.

    ``writer``: a CheckpointIO the config names (``trainer.plugins``), which writes and removes the checkpoints in
    its place; reading stays ours, so that no plugin opens a path to a checkpoint that carries code."""

    def __init__(self, writer: CheckpointIO | None = None) -> None:
        super().__init__()
        self.writer = writer
        if writer is not None and getattr(writer, "checkpoint_io", False) is None:  # a wrapper (AsyncCheckpointIO)
            writer.checkpoint_io = SafeCheckpointIO()  # with no writer of its own: the strategy gives none to ours

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: object | None = None) -> None:
        """Write ``checkpoint`` with the ``writer``, else to a local ``path`` atomically (a remote one with
        Lightning's writer)."""
        if self.writer is not None:
            return self.writer.save_checkpoint(checkpoint, path, storage_options)
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        replace_atomically(path, lambda file: torch.save(checkpoint, file))
        return None

    def remove_checkpoint(self, path: str | Path) -> None:
        """Remove a checkpoint with the ``writer`` (which may keep its files elsewhere), else Lightning's way."""
        (self.writer or super()).remove_checkpoint(path)

    def teardown(self) -> None:
        """Let the ``writer`` finish (an asynchronous one waits for its last save)."""
        if self.writer is not None:
            self.writer.teardown()

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """Read a local checkpoint weights-only with ``checkpoint.load_file`` (on the CPU unless told otherwise)."""
        return load_file(path, map_location=map_location or "cpu")


class PacedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bars, redrawn at most every ``interval`` seconds (and at each bar's last batch) instead of
    at every batch: redrawing a bar and its metrics at each of a fast model's steps takes a share of a
    time-budgeted fit's steps on a CPU. The CLI uses it in place of Lightning's default bar; a progress bar set in
    the config is kept as it is.

    The pacing is done in the public batch-end hooks: a batch that comes less than ``interval`` after the last
    redraw is not passed on to ``TQDMProgressBar``'s hook, which sets the bar to the batch's count when it is."""

    def __init__(self, interval: float = 0.2) -> None:
        super().__init__()
        self.interval = interval
        self.drawn_at = float("-inf")

    def due(self, batch_idx: int, bar: Any) -> bool:
        """Whether the batch ``batch_idx`` of ``bar`` is to be drawn: the bar's last batch, or ``interval`` seconds
        after the last batch drawn. A batch that is drawn restarts the interval."""
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
    """``last.ckpt`` holds the weights the fit ended with. Lightning (2.6) writes a ModelCheckpoint's ``last``
    only at a validation where its monitored top-k checkpoint is written too, so a fit that ``max_time`` stops
    after a validation that did not improve on the best kept an earlier step as "last". At the end of fitting,
    when no checkpoint was written at the final step, each ModelCheckpoint with ``save_last: true`` writes its
    ``last`` again (a ``save_last: link`` is a link to a top-k file, left as it is)."""

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

    Lightning types ``limit_{train,val,test,predict}_batches`` ``float | int``, so jsonargparse (which LightningCLI
    builds the Trainer's options with, from this signature and, through ``**kwargs``, from Lightning's) reads ``1``
    as ``1.0``, which Lightning takes as all the batches, and the run's ``config.yaml`` records ``1.0``. Typed
    ``int | float`` here, ``1`` is one batch in the run and in its ``config.yaml``; ``1.0`` or ``0.5`` is a fraction.
    """

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
