"""``vision-attn predict``: the tasks' ``predict_step`` over the test split, and the ``predictions.json`` rank 0
writes in the log dir as ``caption`` or ``classify`` would."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from vision_attn.api import ClassificationResult
from vision_attn.captioning.evaluation import all_ranks, caption_batch, gather_records
from vision_attn.data.caption_datasets import EvalCaptionBatch
from vision_attn.io import write_json_atomically
from vision_attn.results import write_results

log = logging.getLogger(__name__)
PREDICTIONS_FILE = "predictions.json"
TOP_K = 5  # the classes each classifier entry lists, as `vision-attn classify` does by default


def run_folder(trainer: L.Trainer) -> Path:
    """The first logger's log dir, else ``default_root_dir`` (a collective under DDP: every rank must ask)."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def write_run_results(trainer: L.Trainer, records: list[dict[str, Any]], name: str) -> Path | None:
    """Rank 0 writes the gathered ``records`` (if any) as the results JSON ``name`` in the run's folder; returns it."""
    path = run_folder(trainer) / name
    if not trainer.is_global_zero or not records:
        return None
    log.info("wrote %d results to %s", len(records), write_results(path, records))
    return path


class PredictionsWriter(BasePredictionWriter):
    """At the end of ``predict``, rank 0 writes every rank's predictions to ``<log dir>/predictions.json``."""

    def __init__(self) -> None:
        super().__init__(write_interval="epoch")

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        """Gather every rank's records; rank 0 writes them (a collective)."""
        records = pl_module.gather_predictions([record for batch in predictions for record in (batch or [])])
        path = run_folder(trainer) / PREDICTIONS_FILE
        if trainer.is_global_zero:
            written = pl_module.save_predictions(path, records)
            print(f"wrote {len(records)} predictions to {os.path.abspath(written)}", flush=True)


class Predicting:
    """What ``vision-attn predict`` needs of a task (a mixin before ``BaseTask``): ``predict_step`` returns a list of
    records per batch, ``gather_predictions`` puts every rank's in order, ``save_predictions`` writes them."""

    def configure_callbacks(self) -> list[L.Callback]:
        """The task's other callbacks and the ``PredictionsWriter``."""
        return [*super().configure_callbacks(), PredictionsWriter()]  # type: ignore[misc]

    def gather_predictions(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's records, in the predict set's order (a collective under DDP)."""
        raise NotImplementedError

    def save_predictions(self, path: Path, records: list[dict[str, Any]]) -> Path:
        """Write the gathered records to ``path`` atomically; returns it."""
        raise NotImplementedError


class CaptionPredictions(Predicting):
    """The captioner's predictions: a results record per image, as ``caption`` writes them."""

    def predict_step(self, batch: EvalCaptionBatch | None, batch_idx: int) -> list[dict[str, Any]]:
        """The beam-searched results records of the batch's images (none for a batch of skipped images)."""
        if batch is None:
            return []
        return caption_batch(self.model, batch.images, batch.image_ids,  # type: ignore[attr-defined]
                             file_names=list(batch.file_names) or None, features=batch.features)

    gather_predictions = staticmethod(gather_records)  # every rank's records, one per image id, sorted by it
    save_predictions = staticmethod(write_results)  # the results JSON


class ClassPredictions(Predicting):
    """The classifiers' predictions: ``classify``'s entry per image; a batch's last element is its images' places
    (index, and file or ``test/<index>``)."""

    def predict_step(self, batch: tuple[Any, ...] | None, batch_idx: int) -> list[dict[str, Any]]:
        """The batch's entries, each with its index in the predict set (``index``, for the order)."""
        if batch is None:
            return []
        images, (indices, names) = batch[0], batch[-1]
        logits: Tensor = self.model(images).float().cpu()  # type: ignore[attr-defined]
        classes = self.class_names or [str(i) for i in range(logits.shape[-1])]  # type: ignore[attr-defined]
        records = []
        for index, name, row in zip(torch.as_tensor(indices).tolist(), names, logits, strict=True):
            values, best = row.softmax(dim=-1).topk(min(TOP_K, len(classes)))
            top_k = tuple((classes[i], p) for p, i in zip(values.tolist(), best.tolist(), strict=True))
            records.append({"index": index, **ClassificationResult(str(name), top_k).to_record()})
        return records

    def gather_predictions(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's entries in the predict set's order, each once, without their ``index``."""
        ordered = {record["index"]: record for record in all_ranks(records)}
        return [{k: v for k, v in ordered[index].items() if k != "index"} for index in sorted(ordered)]

    save_predictions = staticmethod(write_json_atomically)  # classify's JSON: the list of entries
