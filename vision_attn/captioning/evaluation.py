"""Captioner evaluation in one place: decode → SPEC §4 records → gather across ranks → score → write.

``ShowAttendTell``'s validation and test hooks, and the ``caption`` command, all go through here, so a
caption scored in ``vision-attn test`` and one written by ``vision-attn caption`` are made the same way.
Nothing here needs Lightning: the ranks are gathered with ``torch.distributed`` when it is initialised.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from PIL import Image
from torch import Tensor

from vision_attn.captioning.model import Captioner
from vision_attn.data.coco import EvalCaptionBatch, load_caption_image, read_coco_captions
from vision_attn.data.images import BadImageCounter, OnBadImage, denormalize, normalize, readable_batches, to_pil
from vision_attn.data.vocabulary import Vocabulary, tokenize, word_ids
from vision_attn.errors import Interrupted
from vision_attn.io import output_file
from vision_attn.metrics import CiderD, caption_scores, deduplicate, pointing_scores
from vision_attn.overlay import caption_overlay
from vision_attn.results import caption_record, write_results


def caption_batch(captioner: Captioner, images: Tensor, image_ids: Sequence[Any], *, beam_size: int | None = None,
                  file_names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """SPEC §4 records of a batch of normalised images (B, 3, S, S), one per image, in order."""
    decoded = captioner.decode(images, beam_size=beam_size)
    size = (images.shape[-2], images.shape[-1])
    names = file_names or [""] * len(image_ids)
    return [caption_record(image_id, captioner.words(hypothesis), hypothesis.alphas, hypothesis.betas,
                           grid=decoded.grid, image_size=size, file_name=name)
            for image_id, name, hypothesis in zip(image_ids, names, decoded.hypotheses, strict=True)]


def coco_inputs(annotations: str | os.PathLike, image_dir: str | os.PathLike) -> list[tuple[int | str, Path]]:
    """(COCO image id, path) for every captioned image of a COCO captions file."""
    return [(record.image_id, record.path) for record in read_coco_captions(Path(annotations), Path(image_dir))]


@torch.inference_mode()
def caption_files(
    captioner: Captioner,
    inputs: Sequence[tuple[Any, Path]],
    *,
    beam_size: int | None = None,
    batch_size: int = 32,
    on_bad_image: OnBadImage = "error",
    bad_images: BadImageCounter | None = None,
) -> Iterator[dict[str, Any]]:
    """SPEC §4 records, one per readable (image id, path), in order. An unreadable image raises
    BadImageError naming it, or with ``on_bad_image="skip"`` is left out with a warning and counted."""
    size = captioner.image_size
    for chunk, pixels in readable_batches(inputs, lambda item: load_caption_image(item[1], size),
                                          batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        images = normalize(pixels.to(captioner.device), captioner.mean, captioner.std)  # (B, 3, S, S)
        yield from caption_batch(captioner, images, [image_id for image_id, _ in chunk], beam_size=beam_size,
                                 file_names=[str(path) for _, path in chunk])


class CaptionedFiles(NamedTuple):
    """What ``write_captions`` did: the results JSON, how many captions it holds, and the note on skipped images."""

    path: Path
    count: int
    skipped_note: str


def write_captions(checkpoint: str | os.PathLike, inputs: Sequence[tuple[Any, Path]], out: str | os.PathLike, *,
                   beam_size: int | None = None, batch_size: int = 32, on_bad_image: OnBadImage = "error",
                   device: str = "cpu", on_record: Callable[[dict[str, Any]], None] | None = None) -> CaptionedFiles:
    """Caption (image id, path) inputs with a checkpoint and write the SPEC §4 results JSON to ``out``;
    ``on_record`` sees each record as it is made (the CLI prints it). ``out`` is checked before any work."""
    output_file(out, inputs=[checkpoint, *(path for _, path in inputs)])
    captioner = Captioner.from_checkpoint(checkpoint, device=device)
    records, bad_images = [], BadImageCounter()
    try:
        for record in caption_files(captioner, inputs, beam_size=beam_size, batch_size=batch_size,
                                    on_bad_image=on_bad_image, bad_images=bad_images):
            records.append(record)  # kept before it is shown: an interrupt never loses a printed caption
            if on_record is not None:
                on_record(record)
    except KeyboardInterrupt:  # keep every caption made so far, as a valid results JSON
        path = write_results(out, records)
        raise Interrupted(f"interrupted: wrote the {len(records)} of {len(inputs)} captions finished so far to "
                          f"{path}") from None
    return CaptionedFiles(write_results(out, records), len(records), bad_images.skipped_note())


def gather_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records, one per image id (DDP may repeat images), sorted by image id."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[list[dict[str, Any]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        records = [record for part in gathered for record in (part or [])]
    return sorted(deduplicate(records), key=lambda record: str(record["image_id"]))


class EvaluationRecords:
    """The records of one evaluation pass on this rank, each with its image's ``references`` and ``objects``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def add(self, captioner: Captioner, batch: EvalCaptionBatch) -> list[dict[str, Any]]:
        """Decode a batch and keep its records (returned too, for the overlay of the first batch)."""
        records = caption_batch(captioner, batch.images, batch.image_ids)
        for record, references, objects in zip(records, batch.references, batch.objects, strict=True):
            record.update(references=list(references), objects=objects)
        self.records += records
        return records

    def gather(self) -> list[dict[str, Any]]:
        """Every rank's records (a collective under DDP), one per image; this rank's are cleared."""
        records, self.records = gather_records(self.records), []
        return records


def score_records(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """BLEU-1..4, METEOR, ROUGE-L and CIDEr-D of records that carry their ``references``; pointing accuracy
    and α mass in the box too when they carry their ``objects`` (SPEC §5); and the number of images."""
    scores = caption_scores({r["image_id"]: r["caption"] for r in records},
                            {r["image_id"]: r["references"] for r in records})
    boxes = {r["image_id"]: r["objects"] for r in records if r.get("objects") is not None}
    if boxes:
        scores.update(pointing_scores(records, boxes))
    scores["images"] = float(len(records))
    return scores


def caption_figures(images: Tensor, records: Sequence[dict[str, Any]], mean: Sequence[float],
                    std: Sequence[float]) -> list[tuple[str, Image.Image]]:
    """(tag, the paper's figure: the image, then α_t per word) for normalised images and their records."""
    return [(f"val_overlay/{index}", caption_overlay(to_pil(denormalize(image, list(mean), list(std))), record,
                                                     panel_size=128, columns=6))
            for index, (image, record) in enumerate(zip(images, records, strict=False))]


def reference_reward(references: Sequence[Sequence[str]], vocab: Vocabulary, max_length: int) -> CiderD:
    """The self-critical reward: CIDEr-D whose document frequencies are those of ``references`` (every training
    image's captions), on word ids as the decoder emits them (at most ``max_length`` words)."""
    return CiderD([[word_ids(vocab.encode(tokenize(caption), max_length)) for caption in captions]
                   for captions in references])
