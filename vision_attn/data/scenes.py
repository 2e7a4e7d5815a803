"""Fashion scenes: the embedded captioning dataset, generated from Fashion-MNIST and written in COCO format.

Each scene is a black S×S RGB canvas holding 2 or 3 Fashion-MNIST items of different classes, each on its
own cell of a G×G grid (at a random offset inside the cell) and tinted with one colour. Five captions per
scene name every item with its colour, and relation phrases ("to the left of", "above", ...) follow from
the grid cells, so every one is true of the bounding boxes. Layout is decided per split from
``(seed, split)``; the same arguments always write the same bytes.

Files under ``<root>/`` (SPEC §3):

- ``images/<split>/<id>.png``
- ``annotations/captions_<split>.json``: COCO captions.
- ``annotations/instances_<split>.json``: COCO instances; ``bbox`` is the tight box of the item's
  non-zero pixels, ``area`` their count, ``category_id`` the Fashion-MNIST label + 1 (COCO ids start at 1).
- ``annotations/attributes_<split>.json``: per instance its ``colour``, grid ``cell`` [row, col] and source
  Fashion-MNIST image; per caption the relation phrases it states, as (subject instance id, relation,
  object instance id), so each phrase can be checked against the boxes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from PIL import Image

from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
from vision_attn.io import output_folder

log = logging.getLogger(__name__)

CLASS_WORDS = ["top", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
           "white": (255, 255, 255)}
RELATIONS = ("to the left of", "to the right of", "above", "below")
DEFAULT_COUNTS = {"train": 20000, "val": 1000, "test": 1000}
ITEM_SIZE = 28
MAX_OBJECTS = 3
CAPTIONS_PER_IMAGE = 5
# Where each split draws its items: (Fashion-MNIST split, slice of it). Val and test share the official
# test set, in two fixed disjoint halves.
SOURCES = {"train": ("train", slice(0, 60000)), "val": ("test", slice(0, 5000)), "test": ("test", slice(5000, 10000))}
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}  # mixed into the seed so each split's layout is independent
PNG_COMPRESS_LEVEL = 1  # PNG encoding is the cost; level 1 is ~6× smaller than raw and as fast


def category_id(label: int) -> int:
    """COCO category id of a Fashion-MNIST label (COCO ids start at 1)."""
    return label + 1


def relation(subject_cell: tuple[int, int], object_cell: tuple[int, int], *, prefer_vertical: bool) -> str:
    """The relation phrase true of two distinct grid cells (row, col); diagonal pairs take either axis."""
    rows, cols = subject_cell[0] - object_cell[0], subject_cell[1] - object_cell[1]
    if cols and not (rows and prefer_vertical):
        return "to the left of" if cols < 0 else "to the right of"
    if rows:
        return "above" if rows < 0 else "below"
    raise ValueError(f"cells {subject_cell} and {object_cell} are the same cell: no relation holds")


class _Captioner:
    """Writes one scene's captions and records the relation phrases each one states."""

    def __init__(self, names: list[str], cells: list[tuple[int, int]], instance_ids: list[int]) -> None:
        self.names = names  # "red sneaker", one per object
        self.cells = cells
        self.instance_ids = instance_ids
        self.stated: list[tuple[int, str, int]] = []

    def rel(self, subject: int, obj: int, prefer_vertical: bool) -> str:
        """The phrase relating object ``subject`` to object ``obj``, recorded as stated."""
        phrase = relation(self.cells[subject], self.cells[obj], prefer_vertical=prefer_vertical)
        self.stated.append((self.instance_ids[subject], phrase, self.instance_ids[obj]))
        return phrase

    def caption(self, form: int, order: list[int], flags: tuple[bool, bool]) -> str:
        """Caption ``form`` (0..4) naming the objects in ``order``; ``flags`` choose the axis of diagonal pairs."""
        n, rel = self.names, self.rel
        if len(order) == 2:
            a, b = order
            if form in (0, 1):
                return f"a {n[a]} {rel(a, b, flags[0])} a {n[b]}"
            if form == 2:
                return f"there is a {n[a]} and a {n[b]}"
            if form == 3:
                return f"a {n[a]} next to a {n[b]}"
            return f"the {n[a]} is {rel(a, b, flags[0])} the {n[b]}"
        a, b, c = order
        if form == 0:
            return f"a {n[a]} {rel(a, b, flags[0])} a {n[b]} and a {n[c]} {rel(c, b, flags[1])} the {n[b]}"
        if form == 1:
            return f"there is a {n[a]}, a {n[b]} and a {n[c]}"
        if form == 2:
            return f"a {n[a]} {rel(a, b, flags[0])} a {n[b]} and {rel(a, c, flags[1])} a {n[c]}"
        if form == 3:
            return f"a {n[a]} next to a {n[b]} and a {n[c]}"
        return f"the {n[a]} is {rel(a, b, flags[0])} the {n[b]} and the {n[c]} is {rel(c, a, flags[1])} the {n[a]}"

    def captions(self, orders: list[list[int]], flags: list[tuple[bool, bool]]) -> list[tuple[str, list]]:
        """The five (caption, relations it states as (subject id, phrase, object id)).

        Caption k names the objects in ``orders[k]``, a permutation of the three object slots (slots past the
        scene's object count are dropped), with the axis flags ``flags[k]``.
        """
        orders = [[slot for slot in order if slot < len(self.names)] for order in orders]
        if len(self.names) == 2:
            orders[1] = orders[0][::-1]  # caption 1 restates caption 0 the other way round
        result = []
        for form, (order, flag_pair) in enumerate(zip(orders, flags, strict=True)):
            self.stated = []
            text = self.caption(form, order, flag_pair)
            result.append((text, self.stated))
        return result


def _tight_boxes(images: np.ndarray) -> np.ndarray:
    """(top, left, bottom, right) of the non-zero pixels of each item (N, 28, 28), end-exclusive."""
    rows, cols = images.any(axis=2), images.any(axis=1)  # (N, 28) each
    top, left = rows.argmax(axis=1), cols.argmax(axis=1)
    bottom = ITEM_SIZE - rows[:, ::-1].argmax(axis=1)
    right = ITEM_SIZE - cols[:, ::-1].argmax(axis=1)
    return np.stack([top, left, bottom, right], axis=1)  # (N, 4)


def _check_arguments(counts: Mapping[str, int], canvas_size: int, grid_size: int) -> None:
    for split, count in counts.items():
        if split not in SOURCES:
            raise ValueError(f"scene split '{split}' is not one of {list(SOURCES)}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"scene count for '{split}' must be a whole number >= 0, got {count!r}")
    if grid_size < 2:
        raise ValueError(f"grid_size must be at least 2 (3 items need 3 cells), got {grid_size}")
    if canvas_size // grid_size < ITEM_SIZE:
        raise ValueError(f"canvas_size // grid_size must be at least {ITEM_SIZE} (the item size), got "
                         f"{canvas_size} // {grid_size} = {canvas_size // grid_size}; use a larger canvas_size")


def _sample_layouts(rng: np.random.Generator, labels: np.ndarray, count: int, grid_size: int,
                    max_offset: int) -> dict[str, np.ndarray]:
    """Random layouts of ``count`` scenes, all in arrays with one row per scene and a column per object slot."""
    n_objects = rng.integers(2, MAX_OBJECTS + 1, size=count)  # (N,)
    classes = rng.random((count, len(CLASS_WORDS))).argsort(axis=1)[:, :MAX_OBJECTS]  # (N, 3) distinct
    cells = rng.random((count, grid_size * grid_size)).argsort(axis=1)[:, :MAX_OBJECTS]  # (N, 3) distinct
    colours = rng.integers(0, len(COLOURS), size=(count, MAX_OBJECTS))
    offsets = rng.integers(0, max_offset + 1, size=(count, MAX_OBJECTS, 2))  # (dy, dx)
    # An item of the chosen class: a uniform pick among the split's images of that class.
    by_class = np.argsort(labels, kind="stable")
    class_start = np.searchsorted(labels[by_class], np.arange(len(CLASS_WORDS)))
    class_count = np.bincount(labels, minlength=len(CLASS_WORDS))
    pick = (rng.random((count, MAX_OBJECTS)) * class_count[classes]).astype(np.int64)
    sources = by_class[class_start[classes] + pick]  # (N, 3) indices into the split's images
    orders = rng.random((count, CAPTIONS_PER_IMAGE, MAX_OBJECTS)).argsort(axis=2)  # per caption, naming order
    flags = rng.random((count, CAPTIONS_PER_IMAGE, 2)) < 0.5  # per caption, the axis used for diagonal pairs
    return {"n_objects": n_objects, "classes": classes, "cells": cells, "colours": colours, "offsets": offsets,
            "sources": sources, "orders": orders, "flags": flags}


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` compactly, via a temporary file so a reader never sees half a file."""
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(data, separators=(",", ":")))
    temporary.replace(path)


def _make_split(root: Path, split: str, count: int, *, images: np.ndarray, labels: np.ndarray, seed: int,
                canvas_size: int, grid_size: int) -> dict[str, int]:
    """Draw and write one split's scenes from its pool of Fashion-MNIST ``images`` (M, 28, 28) and ``labels``."""
    cell_size = canvas_size // grid_size
    rng = np.random.default_rng([seed, SPLIT_CODES[split]])
    layout = _sample_layouts(rng, labels, count, grid_size, cell_size - ITEM_SIZE)
    boxes = _tight_boxes(images)  # (M, 4)
    colour_names = list(COLOURS)
    colour_rgb = np.array(list(COLOURS.values()), dtype=np.uint16)  # (5, 3)
    source_split, source_slice = SOURCES[split]
    image_dir = root / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    info = {"description": f"Fashion scenes, {split} split", "seed": seed, "canvas_size": canvas_size,
            "grid_size": grid_size, "category_ids": "Fashion-MNIST label + 1"}
    image_entries, captions, instances, attributes, relations = [], [], [], [], []
    for index in range(count):
        image_id = index + 1
        canvas = np.zeros((canvas_size, canvas_size, 3), dtype=np.uint8)
        n_objects = int(layout["n_objects"][index])
        names, cells, instance_ids = [], [], []
        for slot in range(n_objects):
            label, cell = int(layout["classes"][index, slot]), int(layout["cells"][index, slot])
            colour, source = int(layout["colours"][index, slot]), int(layout["sources"][index, slot])
            row, col = divmod(cell, grid_size)
            y0 = row * cell_size + int(layout["offsets"][index, slot, 0])
            x0 = col * cell_size + int(layout["offsets"][index, slot, 1])
            item = images[source]  # (28, 28)
            tinted = item[:, :, None].astype(np.uint16) * colour_rgb[colour] // 255  # (28, 28, 3)
            canvas[y0 : y0 + ITEM_SIZE, x0 : x0 + ITEM_SIZE] = tinted.astype(np.uint8)
            top, left, bottom, right = (int(v) for v in boxes[source])
            instance_id = len(instances) + 1
            instances.append({"id": instance_id, "image_id": image_id, "category_id": category_id(label),
                              "bbox": [x0 + left, y0 + top, right - left, bottom - top],
                              "area": int(np.count_nonzero(item)), "iscrowd": 0})
            attributes.append({"id": instance_id, "image_id": image_id, "colour": colour_names[colour],
                               "cell": [row, col], "source_split": source_split,
                               "source_index": source_slice.start + source})
            names.append(f"{colour_names[colour]} {CLASS_WORDS[label]}")
            cells.append((row, col))
            instance_ids.append(instance_id)
        captioner = _Captioner(names, cells, instance_ids)
        flags = [tuple(pair) for pair in layout["flags"][index].tolist()]
        for text, stated in captioner.captions(layout["orders"][index].tolist(), flags):
            caption_id = len(captions) + 1
            captions.append({"id": caption_id, "image_id": image_id, "caption": text})
            relations += [{"caption_id": caption_id, "subject_id": subject, "relation": phrase, "object_id": obj}
                          for subject, phrase, obj in stated]
        file_name = f"{image_id}.png"
        # A new file rather than an overwrite: ext4 flushes truncated files on close, ~10x slower here.
        (image_dir / file_name).unlink(missing_ok=True)
        Image.fromarray(canvas).save(image_dir / file_name, compress_level=PNG_COMPRESS_LEVEL)
        image_entries.append({"id": image_id, "file_name": file_name, "width": canvas_size, "height": canvas_size})
    annotations = root / "annotations"
    annotations.mkdir(parents=True, exist_ok=True)
    categories = [{"id": category_id(label), "name": word, "supercategory": "fashion"}
                  for label, word in enumerate(CLASS_WORDS)]
    _write_json(annotations / f"instances_{split}.json",
                {"info": info, "images": image_entries, "annotations": instances, "categories": categories})
    _write_json(annotations / f"attributes_{split}.json",
                {"info": info, "colours": colour_names, "relation_phrases": list(RELATIONS),
                 "instances": attributes, "relations": relations})
    # The captions file last: its presence is what marks a split as complete.
    _write_json(annotations / f"captions_{split}.json", {"info": info, "images": image_entries,
                                                         "annotations": captions})
    return {"images": count, "captions": len(captions), "instances": len(instances)}


def make_scenes(
    root: str | Path,
    *,
    counts: Mapping[str, int] | None = None,
    seed: int = 0,
    canvas_size: int = 96,
    grid_size: int = 3,
    fashion_mnist_root: str | Path = "data/fashion_mnist",
) -> dict[str, dict[str, int]]:
    """Write the Fashion scenes splits under ``root``; returns, per split, how many images, captions and objects.

    ``counts`` maps split names (``train``, ``val``, ``test``) to scene counts (default 20000/1000/1000).
    Existing files of the same names are overwritten.
    """
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    _check_arguments(counts, canvas_size, grid_size)
    root = output_folder(root)
    directory = find_fashion_mnist(fashion_mnist_root)
    loaded: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    written = {}
    for split, count in counts.items():
        source_split, source_slice = SOURCES[split]
        if source_split not in loaded:
            images, labels = load_fashion_mnist(directory, source_split)
            loaded[source_split] = (images.numpy(), labels.numpy())
        images, labels = (array[source_slice] for array in loaded[source_split])
        log.info("writing %d %s scenes under %s", count, split, root)
        written[split] = _make_split(root, split, count, images=images, labels=labels, seed=seed,
                                     canvas_size=canvas_size, grid_size=grid_size)
    return written
