"""COCO-format caption and instances files (MS COCO, or the Fashion scenes) and the Karpathy splits
(``dataset_coco.json``) read into captioned images with their objects; the datasets on them are in
``caption_datasets.py``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from PIL import Image
from pycocotools.coco import COCO
from torch import Tensor

from vision_attn.data.formats import check_attributes, check_coco_captions, check_coco_instances, read_json
from vision_attn.data.images import open_image, to_tensor
from vision_attn.data.vocabulary import has_words
from vision_attn.errors import DatasetNotFoundError

log = logging.getLogger(__name__)

KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}  # restval joins train


class SceneObject(NamedTuple):
    """An object of an image: its class name, its box [x, y, w, h] in pixels, and its colour (attributes file)."""

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


def load_coco(path: Path, what: Literal["captions", "instances"]) -> COCO:
    """A pycocotools index of a COCO captions or instances file, built from its checked content, silently."""
    if not path.exists():
        raise DatasetNotFoundError(f"{path}: {what} file not found")
    data = read_json(path, f"a COCO {what} JSON")
    coco = COCO()
    coco.dataset = check_coco_captions(data, path) if what == "captions" else check_coco_instances(data, path)
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def read_coco_captions(captions_file: Path, image_dir: Path) -> list[CaptionedImage]:
    """The captioned images of a COCO captions file, in the file's order; images without captions are left out."""
    coco = load_coco(captions_file, "captions")  # unique image ids, every caption a string of one of them
    if not image_dir.is_dir():
        raise DatasetNotFoundError(f"{image_dir}: image folder not found (the images of {captions_file})")
    records, wordless = [], []
    for image_id in coco.imgs:  # the file's order
        captions = [annotation["caption"] for annotation in coco.imgToAnns.get(image_id, [])]
        wordless += [(image_id, caption) for caption in captions if not has_words(caption)]  # they teach nothing
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
    data = read_json(karpathy_file, "a Karpathy split file (dataset_coco.json)")
    entries = data.get("images") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{karpathy_file}: expected a Karpathy split file with an 'images' list")
    if not image_root.is_dir():
        raise DatasetNotFoundError(f"{image_root}: image folder not found (the images of {karpathy_file})")
    splits: dict[str, list[CaptionedImage]] = {"train": [], "val": [], "test": []}
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
        if not (isinstance(split, str) and isinstance(entry.get("filepath", ""), str)
                and isinstance(image_id, int | str) and not isinstance(image_id, bool)
                and all(isinstance(caption, str) for caption in captions)):
            raise ValueError(f"{where}: split, filepath and each sentence's raw must be strings, and cocoid (or "
                             "imgid) a number or a string")
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


def read_colours(path: Path, coco: COCO) -> tuple[dict[int, str | None], list[str]]:
    """Per instance id its colour, and the colour names, of the scenes' ``attributes_<split>.json`` of ``coco``."""
    data = check_attributes(read_json(path, "a scenes attributes JSON"), path, set(coco.anns))
    colour_of = {entry["id"]: entry.get("colour") for entry in data["instances"]}
    return colour_of, list(data.get("colours") or sorted({c for c in colour_of.values() if c is not None}))


class Instances(NamedTuple):
    """What a COCO instances file says: per image id its objects, and its (width, height) or None."""

    objects: dict[int | str, list[SceneObject]]
    sizes: dict[int | str, tuple[int, int] | None]
    index: COCO | None = None  # pycocotools' index of the file (category_mask reads its segmentations)


def read_instances(path: Path, attributes: Path | None = None) -> Instances:
    """The ``Instances`` of a COCO instances file, with colours from ``attributes`` (the scenes') when given."""
    coco = load_coco(path, "instances")
    names = {category["id"]: category["name"] for category in coco.cats.values()}
    colours = read_colours(attributes, coco)[0] if attributes is not None else {}
    objects = {image_id: [SceneObject(names[a["category_id"]], [float(v) for v in a["bbox"]], colours.get(a["id"]))
                          for a in coco.imgToAnns.get(image_id, [])]
               for image_id in coco.imgs}
    sizes = {image_id: (image["width"], image["height"]) if "width" in image and "height" in image else None
             for image_id, image in coco.imgs.items()}
    return Instances(objects, sizes, coco)


def category_mask(coco: COCO, image_id: int | str, category: str, *, source: str | os.PathLike = "") -> Tensor | None:
    """The union (H, W) of the segmentations of the image's instances of ``category`` (None: none has one); one
    pycocotools cannot read is refused in one line naming ``source``."""
    wanted = {key for key, entry in coco.cats.items() if entry["name"] == category}
    mask = None
    for annotation in coco.imgToAnns.get(image_id, []):
        if annotation["category_id"] not in wanted or not annotation.get("segmentation"):
            continue
        try:
            pixels = torch.from_numpy(coco.annToMask(annotation).astype(bool))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
            raise ValueError(f"{source}: annotation {annotation.get('id')!r} has a segmentation pycocotools cannot "
                             f"read: {type(error).__name__}") from None
        mask = pixels if mask is None else mask | pixels
    return mask


def read_objects(path: Path, attributes: Path | None = None) -> dict[int | str, list[SceneObject]]:
    """Per image id, the objects of a COCO instances file (``read_instances``)."""
    return read_instances(path, attributes).objects


class ObjectTargets(NamedTuple):
    """A training split's objects for an object loss: the category names in id order, the attributes file's colour
    names (or none), and per image id rows (K, 6) of [class, colour (−1: none), x0, y0, x1, y1], the box in
    fractions of the image's sides."""

    classes: list[str]
    colours: list[str]
    per_image: dict[int | str, Tensor]


def read_object_targets(path: Path, attributes: Path | None = None) -> ObjectTargets:
    """The ``ObjectTargets`` of a COCO instances file, with colours from ``attributes`` (the scenes') when given."""
    coco = load_coco(path, "instances")
    category_ids = sorted(coco.cats)
    if not category_ids:
        raise ValueError(f"{path}: no categories, so no object targets")
    for index, image in enumerate(coco.dataset["images"]):
        if "width" not in image or "height" not in image:
            raise ValueError(f"{path}: images[{index}] (id {image['id']}) has no width and height, which the object "
                             "targets need to place its boxes")
    class_index = {category_id: index for index, category_id in enumerate(category_ids)}
    colour_of, colours = read_colours(attributes, coco) if attributes is not None else ({}, [])
    colour_index = {name: index for index, name in enumerate(colours)}
    per_image: dict[int | str, Tensor] = {}
    for image_id, image in coco.imgs.items():
        width, height = float(image["width"]), float(image["height"])
        rows = []
        for annotation in coco.imgToAnns.get(image_id, []):
            x, y, w, h = (float(v) for v in annotation["bbox"])
            colour = colour_index.get(colour_of.get(annotation["id"]), -1)
            rows.append([class_index[annotation["category_id"]], colour, x / width, y / height,
                         (x + w) / width, (y + h) / height])
        per_image[image_id] = torch.tensor(rows, dtype=torch.float32).view(-1, 6)
    return ObjectTargets([coco.cats[i]["name"] for i in category_ids], colours, per_image)


def load_caption_image(path: Path, image_size: int) -> Tensor:
    """An image file as RGB uint8 (3, image_size, image_size), squashed to the square so nothing is cut off."""
    image = open_image(path, mode="RGB", max_side=image_size)
    return to_tensor(image.resize((image_size, image_size), Image.Resampling.BICUBIC))
