"""Captioner evaluation in one place: decode → results records (``docs/formats/results.md``) → gather across ranks
(``torch.distributed``, no Lightning) → score → write. ``CaptionerTask``'s validation and test and the ``caption``
command all go through here, so a caption scored by ``test`` and one written by ``caption`` are made alike."""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from PIL import Image
from torch import Tensor

from vision_attn.captioning.beam_search import Hypothesis
from vision_attn.captioning.captioner import Captioner
from vision_attn.data.caption_datasets import EvalCaptionBatch
from vision_attn.data.coco import category_mask, load_caption_image, load_coco, read_coco_captions, read_instances
from vision_attn.data.images import (
    BadImageCounter,
    OnBadImage,
    denormalize,
    expand_inputs,
    normalize,
    readable_batches,
    to_pil,
)
from vision_attn.data.object_words import ObjectWords, object_words
from vision_attn.data.vocabulary import tokenize
from vision_attn.errors import Interrupted
from vision_attn.io import output_file, write_json_atomically
from vision_attn.metrics import (
    caption_scores,
    deduplicate,
    hallucination_scores,
    pointing_scores,
    scene_scores,
    word_order_rates,
)
from vision_attn.overlay import caption_overlay
from vision_attn.results import caption_record, read_scored_results, write_results

log = logging.getLogger(__name__)


def caption_batch(captioner: Captioner, images: Tensor, image_ids: Sequence[Any], *, beam_size: int | None = None,
                  file_names: Sequence[str] | None = None, all_beams: bool = False,
                  features: bool = False) -> list[dict[str, Any]]:
    """Results records of normalised images (B, 3, S, S) (``features``: the encoder's frozen part's output), in
    order; ``all_beams``: each lists every beam, best first, under ``beams``."""
    decoded = captioner.decode(images, beam_size=beam_size, all_beams=all_beams, features=features)
    size = (captioner.image_size, captioner.image_size) if features else (images.shape[-2], images.shape[-1])
    names = file_names or [""] * len(image_ids)
    for image_id, name, hypothesis in zip(image_ids, names, decoded.hypotheses, strict=True):
        if not math.isfinite(hypothesis.score):  # its words are not a search's: JSON would get NaN, or <pad>s
            raise FloatingPointError(f"{name or image_id}: the captioner's score for this image is "
                                     f"{hypothesis.score}, not a finite number; its weights or this input overflow")
    records = [caption_record(image_id, captioner.words(hypothesis), hypothesis.alphas, hypothesis.betas,
                              grid=decoded.grid, image_size=size, file_name=name, head_alphas=hypothesis.head_alphas)
               for image_id, name, hypothesis in zip(image_ids, names, decoded.hypotheses, strict=True)]
    for record, beams in zip(records, decoded.beams or [], strict=False):
        record["beams"] = [beam_entry(captioner, beam) for beam in beams]
    return records


def beam_entry(captioner: Captioner, hypothesis: Hypothesis) -> dict[str, Any]:
    """One of a record's ``beams``: caption, tokens, α, β (and ``head_alphas``) as in a record, log_prob and score."""
    entry = caption_record(None, captioner.words(hypothesis), hypothesis.alphas, hypothesis.betas, grid=(0, 0),
                           image_size=(0, 0), head_alphas=hypothesis.head_alphas)
    kept = {key: entry[key] for key in ("caption", "tokens", "alphas", "betas", "head_alphas") if key in entry}
    return {**kept, "log_prob": round(hypothesis.log_prob, 6), "score": round(hypothesis.score, 6)}


def caption_inputs(paths: Sequence[str | os.PathLike], *, coco_annotations: str | os.PathLike | None = None,
                   image_dir: str | os.PathLike | None = None) -> list[tuple[Any, Path]]:
    """(image id, path) to caption: image files and folders' images (id: the file name), then a COCO captions
    file's images in ``image_dir`` (id: COCO's)."""
    inputs = expand_inputs(paths) if paths else []
    if coco_annotations:
        inputs += [(record.image_id, record.path)
                   for record in read_coco_captions(Path(coco_annotations), Path(image_dir or "."))]
    return inputs


@torch.inference_mode()
def caption_files(captioner: Captioner, inputs: Sequence[tuple[Any, ...]], *, beam_size: int | None = None,
                  batch_size: int = 32, on_bad_image: OnBadImage = "error", bad_images: BadImageCounter | None = None,
                  all_beams: bool = False, load: Callable[[Any], Tensor] | None = None) -> Iterator[dict[str, Any]]:
    """Results records, one per readable (image id, path, ...) in order; ``load`` reads an item's uint8 (3, S, S)
    pixels. An unreadable image raises BadImageError, or with ``on_bad_image="skip"`` is counted and left out."""
    size = captioner.image_size
    for chunk, pixels in readable_batches(inputs, load or (lambda item: load_caption_image(item[1], size)),
                                          batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        images = normalize(pixels.to(captioner.device), captioner.mean, captioner.std)  # (B, 3, S, S)
        yield from caption_batch(captioner, images, [item[0] for item in chunk], beam_size=beam_size,
                                 file_names=[str(item[1]) for item in chunk], all_beams=all_beams)


class CaptionedFiles(NamedTuple):
    """What ``write_captions`` did: the results JSON, how many captions it holds, and the note on skipped images."""

    path: Path
    count: int
    skipped_note: str


def write_captions(checkpoint: str | os.PathLike, inputs: Sequence[tuple[Any, Path]], out: str | os.PathLike, *,
                   beam_size: int | None = None, batch_size: int = 32, on_bad_image: OnBadImage = "error",
                   device: str = "cpu", on_record: Callable[[dict[str, Any]], None] | None = None,
                   all_beams: bool = False) -> CaptionedFiles:
    """Caption (image id, path) inputs with a checkpoint into the results JSON ``out`` (checked before any work);
    ``on_record`` sees each record as it is made."""
    output_file(out, inputs=[checkpoint, *(path for _, path in inputs)])
    captioner = Captioner.from_checkpoint(checkpoint, device=device)
    records, bad_images = [], BadImageCounter()
    try:
        for record in caption_files(captioner, inputs, beam_size=beam_size, batch_size=batch_size,
                                    on_bad_image=on_bad_image, bad_images=bad_images, all_beams=all_beams):
            records.append(record)  # kept before it is shown: an interrupt never loses a printed caption
            if on_record is not None:
                on_record(record)
    except KeyboardInterrupt:  # keep every caption made so far, as a valid results JSON
        path = write_results(out, records)
        raise Interrupted(f"interrupted: wrote the {len(records)} of {len(inputs)} captions finished so far to "
                          f"{path}") from None
    return CaptionedFiles(write_results(out, records), len(records), bad_images.skipped_note())


def all_ranks(records: list[Any]) -> list[Any]:
    """Every rank's ``records`` in rank order (a collective under DDP; this rank's alone otherwise)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[list[Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        return [record for part in gathered for record in (part or [])]
    return list(records)


def gather_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's records, one per image id (DDP may repeat images), sorted by image id."""
    return sorted(deduplicate(all_ranks(records)), key=lambda record: str(record["image_id"]))


class EvaluationRecords:
    """The records of one evaluation pass on this rank, each with its image's ``references`` and ``objects``."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def add(self, captioner: Captioner, batch: EvalCaptionBatch) -> list[dict[str, Any]]:
        """Decode a batch and keep its records (returned too, for the overlay of the first batch)."""
        records = caption_batch(captioner, batch.images, batch.image_ids, file_names=list(batch.file_names) or None,
                                features=batch.features)
        for record, references, objects in zip(records, batch.references, batch.objects, strict=True):
            record.update(references=list(references), objects=objects)
        self.records += records
        return records

    def gather(self) -> list[dict[str, Any]]:
        """Every rank's records (a collective under DDP), one per image; this rank's are cleared."""
        records, self.records = gather_records(self.records), []
        return records


def score_records(records: Sequence[dict[str, Any]], *, pointing: bool = True,
                  box_scale: dict[Any, tuple[float, float]] | None = None, words: ObjectWords | None = None,
                  masks: Callable[[Any, str], Tensor | None] | None = None) -> dict[str, float]:
    """BLEU-1..4, METEOR, ROUGE-L, CIDEr-D, the share of unfinished captions and the image count of records with
    ``references``; with ``objects`` the scene metrics, and with ``pointing`` the pointing ones
    (``docs/formats/metrics.md``; ``box_scale`` maps boxes to the input, ``masks`` adds α's mass in each category's
    mask). ``words``, an object-words table, names objects in captions and adds CHAIR, counting each image's
    categories once and those its references name as present (Rohrbach et al.)."""
    scores = caption_scores({r["image_id"]: r["caption"] for r in records},
                            {r["image_id"]: r["references"] for r in records})
    scores.update(word_order_rates(records))
    boxes = {r["image_id"]: r["objects"] for r in records if r.get("objects") is not None}
    if boxes:
        if pointing:
            scores.update(pointing_scores(records, boxes, box_scale=box_scale, words=words, masks=masks))
        scenes = {image_id: [(entry[0], entry[2] if len(entry) > 2 else None) for entry in objects]
                  for image_id, objects in boxes.items()}
        with_objects = [r for r in records if r["image_id"] in boxes]
        if words is not None:  # categories, each once per image, without colours
            scenes = {image_id: [(name, None) for name in dict.fromkeys(name for name, _ in scene)]
                      for image_id, scene in scenes.items()}
            present = {r["image_id"]: {name for name, _ in scenes[r["image_id"]]} | words.named_in(r["references"])
                       for r in with_objects}
            scores.update(hallucination_scores(with_objects, present, words))
        scores.update(scene_scores(with_objects, scenes, words))
    scores["images"] = float(len(records))
    return scores


def caption_figures(images: Tensor, records: Sequence[dict[str, Any]], mean: Sequence[float],
                    std: Sequence[float]) -> list[tuple[str, Image.Image]]:
    """(tag, the paper's figure: the image, then α_t per word) for normalised images and their records."""
    return [(f"val_overlay/{index}", caption_overlay(to_pil(denormalize(image, list(mean), list(std))), record,
                                                     panel_size=128, columns=6))
            for index, (image, record) in enumerate(zip(images, records, strict=False))]


def evaluate_results(results: str | os.PathLike, annotations: str | os.PathLike, *,
                     instances: str | os.PathLike | None = None, attributes: str | os.PathLike | None = None,
                     words: str | os.PathLike | None = None, out: str | os.PathLike | None = None) -> dict[str, float]:
    """Score any COCO results file (``[{"image_id", "caption"}]``) against a COCO captions file; with ``instances``
    (and ``attributes`` for colours) the scene metrics, and pointing when every record has its attention.
    ``words`` names an object-words table (``data/object_words.py``): objects are the instances' categories as it
    names them, with CHAIR and α's mass in each category's mask. Every file is checked before scoring (each image
    in the annotations with references, and in the instances; an image id that is a file name: ``by_file_name``);
    the scores go to ``out`` (checked first) when given, NaN as null."""
    inputs = [path for path in (results, annotations, instances, attributes, words) if path]
    target = output_file(out, inputs=inputs) if out is not None else None
    if words is not None and instances is None:
        raise ValueError("--words names the objects of the instances: give --instances too")
    table = object_words(words) if words is not None else None
    records = read_scored_results(results)
    coco = load_coco(Path(annotations), "captions")
    records = by_file_name(results, records, coco.imgs, annotations)
    _all_in(results, records, coco.imgs, annotations)
    unreferenced = [r["image_id"] for r in records if not coco.imgToAnns.get(r["image_id"])]
    if unreferenced:
        raise ValueError(f"{annotations}: {len(unreferenced)} images of {results} have no reference captions to "
                         f"score against: image ids {', '.join(map(repr, unreferenced[:5]))}"
                         + (", ..." if len(unreferenced) > 5 else ""))
    found = read_instances(Path(instances), Path(attributes) if attributes else None) if instances else None
    attention = [r for r in records if r.get("alphas") is not None]
    if found is not None and attention and len(attention) < len(records):
        log.warning("%s: %d of %d records carry no attention, so the pointing metrics are left out", results,
                    len(records) - len(attention), len(records))
    pointing = found is not None and len(attention) == len(records)
    scale = None
    if found is not None:
        _all_in(results, records, found.objects, instances)
    if pointing:  # boxes are in the image file's pixels, α over the network input
        unsized = [r["image_id"] for r in records if found.sizes[r["image_id"]] is None]
        if unsized:
            raise ValueError(f"{instances}: images without a width and height, which pointing needs to place "
                             f"their boxes under the attention: image ids {', '.join(map(repr, unsized[:5]))}")
        scale = {}
        for record in records:
            width, height = found.sizes[record["image_id"]]
            if record.get("image_size") is None:  # the grid covers the whole image: place it in the file's pixels
                record["image_size"] = [height, width]
            scale[record["image_id"]] = (record["image_size"][1] / width, record["image_size"][0] / height)
    for record in records:
        record["references"] = [a["caption"] for a in coco.imgToAnns[record["image_id"]]]
        record.setdefault("tokens", tokenize(record["caption"]))
        if found is not None:
            record["objects"] = found.objects[record["image_id"]]
    masks = functools.partial(category_mask, found.index, source=instances) if table is not None and pointing else None
    scores = score_records(records, pointing=pointing, box_scale=scale, words=table, masks=masks)
    if target is not None:
        write_json_atomically(target, nulls_for_nan(scores))
    return scores


def nulls_for_nan(value: Any) -> Any:
    """``value`` with every NaN float in its dicts and lists as None: JSON has no NaN for a measure with nothing
    to count."""
    if isinstance(value, dict):
        return {key: nulls_for_nan(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [nulls_for_nan(item) for item in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def by_file_name(results: str | os.PathLike, records: Sequence[dict[str, Any]], images: dict[Any, dict[str, Any]],
                 annotations: str | os.PathLike) -> list[dict[str, Any]]:
    """``records`` with each string image id that is no id of ``images`` (``caption`` names a file's image by its
    name) as the id of the one image whose ``file_name`` is it or ends in ``/`` and it. A name of two images, or
    two records then of one image, is refused in one line; a name of none is left for ``_all_in``."""
    by_name: dict[str, list[Any]] = {}
    for image_id, image in images.items():
        name = str(image.get("file_name") or "")
        for key in dict.fromkeys((name, name.rpartition("/")[2])):
            by_name.setdefault(key, []).append(image_id)
    matched, seen = [], {}
    for index, record in enumerate(records):
        image_id = record["image_id"]
        if isinstance(image_id, str) and image_id not in images and image_id in by_name:
            found = by_name[image_id]
            if len(found) > 1:
                raise ValueError(f"{results}: image {image_id!r:.80} is the file name of {len(found)} images of "
                                 f"{annotations} (ids {', '.join(map(repr, found[:5]))}): give it by its image id")
            record = {**record, "image_id": found[0]}
        if record["image_id"] in seen:
            raise ValueError(f"{results}: records {seen[record['image_id']]} and {index} are both image "
                             f"{record['image_id']!r} of {annotations} (an image id or its file name)")
        seen[record["image_id"]] = index
        matched.append(record)
    return matched


def _all_in(results: str | os.PathLike, records: Sequence[dict[str, Any]], images: Any,
            source: str | os.PathLike) -> None:
    missing = [r["image_id"] for r in records if r["image_id"] not in images]
    if missing:
        raise ValueError(f"{results}: {len(missing)} image ids are not in {source}, e.g. "
                         f"{', '.join(map(repr, missing[:5]))}"
                         + (" (neither an image id nor an image's file_name there)"
                            if any(isinstance(image_id, str) for image_id in missing) else ""))


def scores_table(scores: dict[str, float]) -> str:
    """The scores as aligned ``name  value`` lines (NaN: the measure had nothing to count)."""
    return "\n".join(f"{name:<22} {value:.4f}" for name, value in scores.items())
