"""Captioning data without Lightning: COCO-format caption and instances files (MS COCO itself, or the
generated Fashion scenes), the Karpathy splits (``dataset_coco.json``), and the datasets built on them.

Training yields one (image, caption) item per caption, so an epoch sees every caption once (or one image
with all its captions); validation and test yield one item per image with all its reference captions and,
where an instances file gives them, its objects. Images are decoded to RGB whatever their mode and resized
to ``image_size`` squares. ``vision_attn.datamodules.CocoCaptionsDataModule`` puts them behind Lightning.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image
from pycocotools.coco import COCO
from torch import Tensor
from torch.utils.data import Dataset

from vision_attn.data.feature_cache import FeatureCache
from vision_attn.data.images import BadImageCounter, OnBadImage, load_or_skip, open_image, to_tensor
from vision_attn.data.vocabulary import Vocabulary, has_words, word_ids
from vision_attn.errors import DatasetNotFoundError

log = logging.getLogger(__name__)

ROLES = ("train", "val", "test")
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}  # restval joins train

class SceneObject(NamedTuple):
    """An object of an image: its class name, its box [x, y, w, h] in the image file's pixels, and its colour
    where an attributes file gives one."""

    name: str
    box: list[float]
    colour: str | None = None



@dataclass(frozen=True)
class CaptionedImage:
    """One image with its reference captions as written, and its objects where an instances file gives them."""

    image_id: int | str
    path: Path
    captions: list[str]
    objects: list[SceneObject] | None = None


class CaptionItem(NamedTuple):
    """A training item: the image uint8 (3, S, S), its caption ids (T,) and length; or, grouped, all its
    captions (n, T) and their lengths (n,). ``objects`` are the image's object targets (K, 6) when the dataset
    has them (``ObjectTargets``)."""

    image: Tensor
    captions: Tensor
    lengths: Tensor
    objects: Tensor | None = None


class EvalCaptionItem(NamedTuple):
    """An evaluation item: the image uint8 (3, S, S), its id, its reference captions, its objects or None, and
    its file (the results' ``file_name``)."""

    image: Tensor
    image_id: int | str
    references: list[str]
    objects: list[SceneObject] | None
    file_name: str = ""


class CaptionBatch(NamedTuple):
    """A training batch: images (B, 3, H, W) (or, with ``features``, what the frozen encoder part made of them,
    read from a feature cache), captions (N, T) = <start> w1..wn <end> <pad>.., lengths (N,) counting <start> and
    <end>. Caption n belongs to image ``caption_images[n]``; None means caption n to image n (N = B)."""

    images: Tensor
    captions: Tensor
    lengths: Tensor
    caption_images: Tensor | None = None
    objects: Tensor | None = None  # (B, K, 6) object targets of each image, rows of class −1 pad (ObjectTargets)
    features: bool = False  # ``images`` are cached encoder features (fp16), not pixels (uint8)

    def word_ids_per_image(self) -> list[list[list[int]]]:
        """Each image's captions as word ids (no <start>, <end>, <pad>): its references, in a grouped batch."""
        images = self.caption_images.tolist() if self.caption_images is not None else range(len(self.captions))
        references: list[list[list[int]]] = [[] for _ in range(len(self.images))]
        for image, caption in zip(images, self.captions.tolist(), strict=True):
            references[image].append(word_ids(caption))
        return references


class EvalCaptionBatch(NamedTuple):
    """A validation/test batch, one entry per image: images (B, 3, H, W) (or, with ``features``, cached encoder
    features), ids, raw reference captions, each image's objects (None without an instances file), and its file."""

    images: Tensor
    image_ids: list[int | str]
    references: list[list[str]]
    objects: list[list[SceneObject] | None]
    file_names: tuple[str, ...] = ()
    features: bool = False


def resolve_inside(root: Path, relative: str, *, source: Path) -> Path:
    """``root / relative``, refusing names from ``source`` that would leave ``root`` ("../..", absolute)."""
    if not isinstance(relative, str) or not relative:
        raise ValueError(f"{source}: image file name {relative!r} is not a non-empty string")
    base = os.path.abspath(root)  # normalised, symlinks kept (image folders are often links)
    candidate = os.path.normpath(os.path.join(base, relative))
    if os.path.isabs(relative) or os.path.commonpath([base, candidate]) != base or candidate == base:
        raise ValueError(f"{source}: image path '{relative}' points outside the image folder {root}; "
                         "file names must be relative paths inside it")
    return Path(candidate)


def load_coco(path: Path, what: str) -> COCO:
    """A pycocotools index of a COCO JSON file, with its progress prints silenced and errors named."""
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: {what} file not found")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return COCO(str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None
    except (AssertionError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a COCO {what} file (problem: {type(error).__name__} {error})") from None


def read_coco_captions(captions_file: Path, image_dir: Path) -> list[CaptionedImage]:
    """The captioned images of a COCO captions file, in the file's order; images without captions are left out."""
    coco = load_coco(captions_file, "captions")
    if not image_dir.is_dir():
        raise DatasetNotFoundError(f"{image_dir}: image folder not found (the images of {captions_file})")
    seen: set = set()
    for entry in coco.dataset.get("images", []):
        if entry["id"] in seen:
            raise ValueError(f"{captions_file}: image id {entry['id']!r} appears twice in 'images'; ids must be unique")
        seen.add(entry["id"])
    orphans = set(coco.imgToAnns) - set(coco.imgs)
    if orphans:
        raise ValueError(f"{captions_file}: captions refer to {len(orphans)} image ids missing from 'images' "
                         f"(e.g. {sorted(orphans, key=str)[0]})")
    records, wordless = [], []
    for image_id in coco.imgs:  # the file's order
        captions = [annotation.get("caption") for annotation in coco.imgToAnns.get(image_id, [])]
        if not all(isinstance(caption, str) for caption in captions):
            raise ValueError(f"{captions_file}: an annotation of image {image_id} has no 'caption' string")
        if not all(map(has_words, captions)):  # empty or punctuation-only captions teach nothing
            wordless += [(image_id, caption) for caption in captions if not has_words(caption)]
            captions = [caption for caption in captions if has_words(caption)]
        if not captions:
            continue
        path = resolve_inside(image_dir, coco.imgs[image_id].get("file_name"), source=captions_file)
        records.append(CaptionedImage(image_id, path, captions))
    if wordless:
        log.warning("%s: %d captions without any word left out (e.g. %r of image %s)", captions_file, len(wordless),
                    wordless[0][1], wordless[0][0])
    if not records:
        raise ValueError(f"{captions_file}: holds no captioned images")
    skipped = len(coco.imgs) - len(records)
    if skipped:
        log.info("%s: %d images without captions left out", captions_file, skipped)
    return records


def read_karpathy(karpathy_file: Path, image_root: Path) -> dict[str, list[CaptionedImage]]:
    """The Karpathy splits of ``dataset_coco.json`` as {"train", "val", "test"}; restval joins train."""
    if not karpathy_file.is_file():
        raise DatasetNotFoundError(f"{karpathy_file}: Karpathy split file (dataset_coco.json) not found")
    try:
        entries = json.loads(karpathy_file.read_text())["images"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{karpathy_file}: not a readable JSON file ({error})") from None
    except (KeyError, TypeError):
        raise ValueError(f"{karpathy_file}: expected a Karpathy split file with an 'images' list") from None
    if not image_root.is_dir():
        raise DatasetNotFoundError(f"{image_root}: image folder not found (the images of {karpathy_file})")
    splits: dict[str, list[CaptionedImage]] = {role: [] for role in ROLES}
    wordless = 0
    for index, entry in enumerate(entries):
        where = f"{karpathy_file}: images[{index}]"
        try:
            split, filename, sentences = entry["split"], entry["filename"], entry["sentences"]
            image_id = entry.get("cocoid", entry.get("imgid", filename))
            captions = [s["raw"] if "raw" in s else " ".join(s["tokens"]) for s in sentences]
        except (KeyError, TypeError) as error:
            raise ValueError(f"{where}: missing or malformed field {error} (need split, filename, "
                             "sentences[].raw or sentences[].tokens)") from None
        if split not in KARPATHY_SPLITS:
            raise ValueError(f"{where}: unknown split {split!r}; expected one of {sorted(KARPATHY_SPLITS)}")
        path = resolve_inside(image_root, os.path.join(entry.get("filepath", ""), filename), source=karpathy_file)
        wordless += sum(not has_words(caption) for caption in captions)
        captions = [caption for caption in captions if has_words(caption)]
        if captions:
            splits[KARPATHY_SPLITS[split]].append(CaptionedImage(image_id, path, captions))
    if wordless:
        log.warning("%s: %d captions without any word left out", karpathy_file, wordless)
    return splits


def read_objects(path: Path, attributes: Path | None = None) -> dict[int | str, list[SceneObject]]:
    """Per image id, the objects of a COCO instances file, with their colours when ``attributes`` (the Fashion
    scenes' ``attributes_<split>.json``: ``{"instances": [{"id", "colour"}]}``) is given."""
    coco = load_coco(path, "instances")
    names = {category["id"]: category["name"] for category in coco.cats.values()}
    colours: dict = {}
    if attributes is not None:
        try:
            colours = {entry["id"]: entry.get("colour") for entry in json.loads(attributes.read_text())["instances"]}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{attributes}: not an attributes file with instances[].id ({error})") from None
    try:
        return {image_id: [SceneObject(names[a["category_id"]], [float(v) for v in a["bbox"]], colours.get(a["id"]))
                           for a in coco.imgToAnns.get(image_id, [])]
                for image_id in coco.imgs}
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: an annotation lacks an id, a known category_id or a bbox ({error})") from None


class ObjectTargets(NamedTuple):
    """What a training split's instances say of each image's objects, for an object loss on the annotation vectors:
    the category names (``classes``, in category id order), the colour names of its attributes file (``colours``;
    empty without one) and, per image id, a float tensor (K, 6) of rows [class index, colour index (−1: none),
    x0, y0, x1, y1], the box as fractions of the image's width and height."""

    classes: list[str]
    colours: list[str]
    per_image: dict[int | str, Tensor]


def read_object_targets(path: Path, attributes: Path | None = None) -> ObjectTargets:
    """The ``ObjectTargets`` of a COCO instances file, with colours when ``attributes`` (the Fashion scenes'
    ``attributes_<split>.json``: ``{"colours": [...], "instances": [{"id", "colour"}]}``) is given."""
    coco = load_coco(path, "instances")
    category_ids = sorted(coco.cats)
    if not category_ids:
        raise ValueError(f"{path}: no categories, so no object targets")
    class_index = {category_id: index for index, category_id in enumerate(category_ids)}
    colours: list[str] = []
    colour_of: dict = {}
    if attributes is not None:
        try:
            data = json.loads(attributes.read_text())
            colour_of = {entry["id"]: entry.get("colour") for entry in data["instances"]}
            colours = list(data.get("colours") or sorted({c for c in colour_of.values() if c is not None}))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{attributes}: not an attributes file with instances[].id ({error})") from None
    colour_index = {name: index for index, name in enumerate(colours)}
    per_image: dict[int | str, Tensor] = {}
    try:
        for image_id, image in coco.imgs.items():
            width, height = float(image["width"]), float(image["height"])
            rows = []
            for annotation in coco.imgToAnns.get(image_id, []):
                x, y, w, h = (float(v) for v in annotation["bbox"])
                colour = colour_index.get(colour_of.get(annotation["id"]), -1)
                rows.append([class_index[annotation["category_id"]], colour, x / width, y / height,
                             (x + w) / width, (y + h) / height])
            per_image[image_id] = torch.tensor(rows, dtype=torch.float32).view(-1, 6)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: an image lacks its width and height, or an annotation an id, a known "
                         f"category_id or a bbox ({type(error).__name__} {error})") from None
    return ObjectTargets([coco.cats[i]["name"] for i in category_ids], colours, per_image)


def load_caption_image(path: Path, image_size: int) -> Tensor:
    """An image file as RGB uint8 (3, image_size, image_size), squashed to the square so nothing is cut off."""
    image = open_image(path, mode="RGB", max_side=image_size)
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return to_tensor(image)


class CaptionTrainDataset(Dataset):
    """One item per caption: (image uint8 (3, S, S), caption ids padded to the longest caption, length).

    With ``group_captions`` one item per image instead: (image, all its captions (n, T), their lengths (n,)),
    so the encoder sees each image once per epoch while the decoder still sees every caption.
    """

    def __init__(self, records: list[CaptionedImage], vocab: Vocabulary, *, max_caption_length: int,
                 image_size: int, group_captions: bool = False, on_bad_image: OnBadImage = "skip",
                 bad_images: BadImageCounter | None = None, objects: ObjectTargets | None = None) -> None:
        self.group_captions = group_captions
        empty = torch.zeros(0, 6)  # an image the instances file has no object of
        self.objects = None if objects is None else [objects.per_image.get(r.image_id, empty) for r in records]
        self.on_bad_image = on_bad_image
        self.bad_images = bad_images
        counts = torch.tensor([len(record.captions) for record in records])
        self.caption_starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])  # (images + 1,)
        self.paths = [record.path for record in records]
        self.image_size = image_size
        self.image_index = torch.tensor([index for index, record in enumerate(records)
                                         for _ in record.captions], dtype=torch.int64)  # (N,)
        captions, self.lengths = vocab.encode_batch([c for record in records for c in record.captions],
                                                    max_caption_length)
        if vocab.truncated:
            log.warning("%d training captions are longer than max_caption_length=%d words and were cut to it",
                        vocab.truncated, max_caption_length)
        self.captions = captions.to(torch.int32)  # (N, T), half the memory of int64 on COCO's 600k captions

    def __len__(self) -> int:
        return len(self.paths) if self.group_captions else len(self.lengths)

    features: FeatureCache | None = None  # set by the DataModule when a frozen encoder's output is cached

    def _image(self, image_index: int) -> Tensor | None:
        """The image, uint8 (3, S, S); or, with a feature cache, its cached features (fp16)."""
        if self.features is not None:
            return self.features[image_index]
        path = self.paths[image_index]
        return load_or_skip(lambda: load_caption_image(path, self.image_size), self.on_bad_image, self.bad_images)

    def __getitem__(self, index: int) -> CaptionItem | None:
        """The item, or None for an unreadable image under the "skip" policy (the collate drops it)."""
        if self.group_captions:
            start, end = int(self.caption_starts[index]), int(self.caption_starts[index + 1])
            image = self._image(index)
            return None if image is None else CaptionItem(image, self.captions[start:end], self.lengths[start:end],
                                                          self._objects(index))
        image_index = int(self.image_index[index])
        image = self._image(image_index)
        return None if image is None else CaptionItem(image, self.captions[index], self.lengths[index],
                                                      self._objects(image_index))

    def _objects(self, image_index: int) -> Tensor | None:
        return None if self.objects is None else self.objects[image_index]


class CaptionEvalDataset(Dataset):
    """One item per image: (image uint8 (3, S, S), image id, raw reference captions, objects or None)."""

    def __init__(self, records: list[CaptionedImage], *, image_size: int, on_bad_image: OnBadImage = "skip",
                 bad_images: BadImageCounter | None = None) -> None:
        self.records = records
        self.image_size = image_size
        self.on_bad_image = on_bad_image
        self.bad_images = bad_images

    def __len__(self) -> int:
        return len(self.records)

    features: FeatureCache | None = None  # set by the DataModule when a frozen encoder's output is cached

    def __getitem__(self, index: int) -> EvalCaptionItem | None:
        record = self.records[index]
        if self.features is not None:
            features = self.features[index]
            return None if features is None else EvalCaptionItem(features, record.image_id, record.captions,
                                                                 record.objects, str(record.path))
        image = load_or_skip(lambda: load_caption_image(record.path, self.image_size), self.on_bad_image,
                             self.bad_images)
        return None if image is None else EvalCaptionItem(image, record.image_id, record.captions, record.objects,
                                                          str(record.path))


def collate_captions(items: list[CaptionItem | None]) -> CaptionBatch | None:
    """Stack training items, trimming the caption padding to the batch's longest caption; skipped (None)
    items are left out, and a batch with nothing readable is None."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images, captions, lengths, objects = zip(*items, strict=True)
    objects = None if objects[0] is None else pad_objects(objects)
    if captions[0].ndim == 2:  # grouped: every caption of each image
        counts = torch.tensor([len(group) for group in lengths])
        lengths = torch.cat(lengths)  # (N,)
        captions = torch.cat(captions)[:, : int(lengths.max())].long()  # (N, T)
        caption_images = torch.repeat_interleave(torch.arange(len(images)), counts)  # (N,)
        return CaptionBatch(torch.stack(images), captions, lengths, caption_images, objects,
                            features=is_features(images[0]))
    lengths = torch.stack(lengths)  # (B,)
    captions = torch.stack(captions)[:, : int(lengths.max())].long()  # (B, T)
    return CaptionBatch(torch.stack(images), captions, lengths, objects=objects, features=is_features(images[0]))


def is_features(item: Tensor) -> bool:
    """Whether a dataset item is cached encoder features (a feature cache stores fp16) rather than an image's
    pixels (uint8)."""
    return item.dtype != torch.uint8


def pad_objects(objects: Sequence[Tensor]) -> Tensor:
    """Each image's object targets (K_b, 6) as one (B, max K_b, 6) tensor, padded with rows of class −1."""
    padded = torch.full((len(objects), max(1, max(len(rows) for rows in objects)), 6), -1.0)
    for index, rows in enumerate(objects):
        padded[index, : len(rows)] = rows
    return padded


def collate_references(items: list[EvalCaptionItem | None]) -> EvalCaptionBatch | None:
    """Stack evaluation items; ids, references and objects stay Python lists. Skipped (None) items are left out."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images, image_ids, references, objects, file_names = zip(*items, strict=True)
    return EvalCaptionBatch(torch.stack(images), list(image_ids), list(references), list(objects), file_names,
                            features=is_features(images[0]))
