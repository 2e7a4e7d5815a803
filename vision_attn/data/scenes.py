"""Fashion scenes: the embedded captioning dataset, generated from Fashion-MNIST and written in COCO format.

A default scene is a black canvas holding 2 or 3 tinted Fashion-MNIST items of different classes; five captions
name each item with its colour, and their relation phrases ("to the left of", "above", ...) are true of the items'
boxes. The same ``(seed, split)`` always writes the same bytes; a ``SceneStyle`` (``scene_style.py``) says how a
split is drawn. The files under ``<root>/`` are described in ``docs/formats/scenes.md``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from PIL import Image

from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
from vision_attn.data.scene_clutter import compose, distinguish, free_positions, mask_rle, place_free
from vision_attn.data.scene_style import COLOURS, ITEM_SIZE, LAYOUTS, PALETTES, SceneStyle, draw_item
from vision_attn.io import OwnedFolder

__all__ = ["CLASS_WORDS", "COLOURS", "ITEM_SIZE", "LAYOUTS", "PALETTES", "SceneStyle", "draw_item", "make_scenes"]

log = logging.getLogger(__name__)

CLASS_WORDS = ["top", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
RELATIONS = ("to the left of", "to the right of", "above", "below")
DEFAULT_COUNTS = {"train": 20000, "val": 1000, "test": 1000}
MAX_OBJECTS = 3
CAPTIONS_PER_IMAGE = 5
# Where each split draws its items: (Fashion-MNIST split, slice); val and test take two halves of the test set
SOURCES = {"train": ("train", slice(0, 60000)), "val": ("test", slice(0, 5000)), "test": ("test", slice(5000, 10000))}
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}  # mixed into the seed so each split's layout is independent
PNG_COMPRESS_LEVEL = 1  # PNG encoding is the cost; level 1 is far smaller than raw and as fast
# The most a split, a canvas and a grid may be: five training sets; 28-pixel items as specks; 64 cells for 5 items
MAX_SCENES, MAX_CANVAS_SIZE, MAX_GRID_SIZE = 100_000, 1024, 8
# Caption forms 0..4 of two and of three objects: a template of their names in the caption's order ({0}, {1},
# {2}) and of relation phrases {r0}, {r1}, with the (subject, object) places in that order each phrase relates.
CAPTION_FORMS = {
    2: (("a {0} {r0} a {1}", ((0, 1),)), ("a {0} {r0} a {1}", ((0, 1),)), ("there is a {0} and a {1}", ()),
        ("a {0} next to a {1}", ()), ("the {0} is {r0} the {1}", ((0, 1),))),
    3: (("a {0} {r0} a {1} and a {2} {r1} the {1}", ((0, 1), (2, 1))), ("there is a {0}, a {1} and a {2}", ()),
        ("a {0} {r0} a {1} and {r1} a {2}", ((0, 1), (0, 2))), ("a {0} next to a {1} and a {2}", ()),
        ("the {0} is {r0} the {1} and the {2} is {r1} the {0}", ((0, 1), (2, 0)))),
}
ONE_ITEM_FORMS = ("a {}", "there is a {}", "a single {}", "a {} on its own", "just a {}")


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


def box_relation(subject_box: list[float], object_box: list[float], *, prefer_vertical: bool) -> str:
    """The relation phrase true of two [x, y, w, h] boxes' centres, along an axis on which they are clearly
    apart: one whose centre distance is at least half the larger of the two (both: ``prefer_vertical`` picks)."""
    dx = (subject_box[0] + subject_box[2] / 2) - (object_box[0] + object_box[2] / 2)
    dy = (subject_box[1] + subject_box[3] / 2) - (object_box[1] + object_box[3] / 2)
    apart = max(abs(dx), abs(dy))
    if apart == 0:
        raise ValueError(f"boxes {subject_box} and {object_box} share a centre: no relation holds")
    horizontal, vertical = abs(dx) >= apart / 2, abs(dy) >= apart / 2
    if horizontal and not (vertical and prefer_vertical):
        return "to the left of" if dx < 0 else "to the right of"
    return "above" if dy < 0 else "below"


class _Captioner:
    # Writes one scene's captions and records the relation phrases each one states.
    def __init__(self, names: list[str], relate: Callable[[int, int, bool], str], instance_ids: list[int]) -> None:
        self.names = names  # "red sneaker", one per object
        self.relate = relate  # (subject, object, prefer_vertical) -> a phrase true of the two
        self.instance_ids = instance_ids

    def caption(self, form: int, order: list[int], flags: tuple[bool, bool], stated: list) -> str:
        # Caption ``form`` (0..4) of the objects in ``order``, its relations added to ``stated`` (phrase k takes
        # ``flags[k]``); forms 0, 2 and 4 of four or five objects: the first three's form, ", with" the rest
        if len(order) == 1:
            return ONE_ITEM_FORMS[form].format(self.names[order[0]])
        if len(order) > MAX_OBJECTS:
            if form == 1:
                return f"there is {self.listing(order)}"
            if form == 3:
                return f"a {self.names[order[0]]} next to {self.listing(order[1:])}"
            return f"{self.caption(form, order[:3], flags, stated)}, with {self.listing(order[3:])}"
        template, pairs = CAPTION_FORMS[len(order)][form]
        phrases = {}
        for k, (a, b) in enumerate(pairs):
            phrases[f"r{k}"] = self.relate(order[a], order[b], flags[k])
            stated.append((self.instance_ids[order[a]], phrases[f"r{k}"], self.instance_ids[order[b]]))
        return template.format(*(self.names[slot] for slot in order), **phrases)

    def listing(self, order: list[int]) -> str:  # "a A, a B and a C"
        named = [f"a {self.names[slot]}" for slot in order]
        return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"

    def captions(self, orders: list[list[int]], flags: list[tuple[bool, bool]]) -> list[tuple[str, list]]:
        # The five (caption, its (subject id, phrase, object id)): caption k names the objects in ``orders[k]``
        orders = [[slot for slot in order if slot < len(self.names)] for order in orders]
        if len(self.names) == 2:
            orders[1] = orders[0][::-1]  # caption 1 restates caption 0 the other way round
        return [(self.caption(form, order, pair, stated := []), stated)
                for form, (order, pair) in enumerate(zip(orders, flags, strict=True))]


def _tight_box(drawn: np.ndarray) -> tuple[int, int, int, int]:  # (top, left, bottom, right), end-exclusive
    rows, cols = np.flatnonzero(drawn.any(axis=1)), np.flatnonzero(drawn.any(axis=0))
    return int(rows[0]), int(cols[0]), int(rows[-1]) + 1, int(cols[-1]) + 1


def _check_arguments(counts: Mapping[str, int], canvas_size: int, grid_size: int,
                     styles: Mapping[str, SceneStyle]) -> None:
    for split, count in counts.items():
        if split not in SOURCES:
            raise ValueError(f"scene split '{split}' is not one of {list(SOURCES)}")
        if not isinstance(count, int) or not 0 <= count <= MAX_SCENES:
            raise ValueError(f"scene count for '{split}' must be a whole number from 0 to {MAX_SCENES}, got "
                             f"{count!r}")
    if not canvas_size <= MAX_CANVAS_SIZE or not grid_size <= MAX_GRID_SIZE:
        raise ValueError(f"canvas_size is at most {MAX_CANVAS_SIZE} and grid_size at most {MAX_GRID_SIZE}, got "
                         f"{canvas_size} and {grid_size}")
    if grid_size < 2:
        raise ValueError(f"grid_size must be at least 2 (3 items need 3 cells), got {grid_size}")
    most = max((int(style.objects[1]) for style in styles.values() if style.layout != "free"), default=0)
    if grid_size * grid_size < most:
        raise ValueError(f"a grid of {grid_size}x{grid_size} cells cannot hold {most} objects; use a larger grid_size")
    if canvas_size // grid_size < ITEM_SIZE:
        raise ValueError(f"canvas_size // grid_size must be at least {ITEM_SIZE} (the item size), got "
                         f"{canvas_size} // {grid_size} = {canvas_size // grid_size}; use a larger canvas_size")
    for style in styles.values():
        style.check(canvas_size, grid_size)


def _sample_layouts(rng: np.random.Generator, labels: np.ndarray, count: int, grid_size: int,
                    max_offset: int, objects: tuple[int, int] = (2, MAX_OBJECTS)) -> dict[str, np.ndarray]:
    # One row per scene, a column per object slot (three, or more for more objects: default draws stay as they were)
    slots = max(MAX_OBJECTS, int(objects[1]))
    n_objects = rng.integers(int(objects[0]), int(objects[1]) + 1, size=count)  # (N,)
    classes = rng.random((count, len(CLASS_WORDS))).argsort(axis=1)[:, :slots]  # (N, 3) distinct
    cells = rng.random((count, grid_size * grid_size)).argsort(axis=1)[:, :slots]  # (N, 3) distinct
    colours = rng.integers(0, len(COLOURS), size=(count, slots))
    offsets = rng.integers(0, max_offset + 1, size=(count, slots, 2))  # (dy, dx)
    # An item of the chosen class: a uniform pick among the split's images of that class.
    by_class = np.argsort(labels, kind="stable")
    class_start = np.searchsorted(labels[by_class], np.arange(len(CLASS_WORDS)))
    class_count = np.bincount(labels, minlength=len(CLASS_WORDS))
    pick = (rng.random((count, slots)) * class_count[classes]).astype(np.int64)
    sources = by_class[class_start[classes] + pick]  # (N, 3) indices into the split's images
    orders = rng.random((count, CAPTIONS_PER_IMAGE, slots)).argsort(axis=2)  # per caption, naming order
    flags = rng.random((count, CAPTIONS_PER_IMAGE, 2)) < 0.5  # per caption, the axis used for diagonal pairs
    return {"n_objects": n_objects, "classes": classes, "cells": cells, "colours": colours, "offsets": offsets,
            "sources": sources, "orders": orders, "flags": flags}


def _make_split(root: Path, split: str, count: int, *, images: np.ndarray, labels: np.ndarray, seed: int,
                canvas_size: int, grid_size: int, style: SceneStyle) -> dict[str, int]:
    cell_size = canvas_size // grid_size
    rng = np.random.default_rng([seed, SPLIT_CODES[split]])
    layout = _sample_layouts(rng, labels, count, grid_size, cell_size - ITEM_SIZE, style.objects)
    style_rng = np.random.default_rng([seed, SPLIT_CODES[split], 1])  # the style's own draws, after the layout's
    background_rng = np.random.default_rng([seed, SPLIT_CODES[split], 2])  # the backgrounds' draws
    background = style.background_spec()
    clutter = style.background != "black" or bool(style.overlap)  # instances then carry their visible masks
    smallest, largest = style.item_sizes()
    colour_names = list(COLOURS)
    source_split, source_slice = SOURCES[split]
    image_dir = root / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    info = {"description": f"Fashion scenes, {split} split", "seed": seed, "canvas_size": canvas_size,
            "grid_size": grid_size, "category_ids": "Fashion-MNIST label + 1"}
    if style != SceneStyle():  # the default style is left out, so default scenes keep their bytes
        info["style"] = style.recorded()
    if style.background != "black":  # its scenes' backgrounds are written alone too (backgrounds/<split>/)
        (root / "backgrounds" / split).mkdir(parents=True, exist_ok=True)
        info["backgrounds"] = True
    image_entries, captions, instances, attributes, relations = [], [], [], [], []
    for index in range(count):
        image_id = index + 1
        under, kind = background.draw(background_rng, canvas_size, fragments=images)  # black draws nothing
        n_objects = int(layout["n_objects"][index])
        free = style.layout == "free" or (style.layout == "mixed" and style_rng.random() < 0.5)
        items, sizes, tints = [], [], []
        for slot in range(n_objects):
            sizes.append(int(style_rng.integers(smallest, largest + 1)) if style.scaled else ITEM_SIZE)
            tints.append(style.tint(style_rng, colour_names[int(layout["colours"][index, slot])]))
            items.append(draw_item(images[int(layout["sources"][index, slot])], tints[-1], sizes[-1]))
        tight = [_tight_box(item.any(axis=2)) for item in items]
        cells: list[tuple[int, int] | None] = [None] * n_objects
        if free and (style.overlap or int(style.objects[1]) > MAX_OBJECTS):
            corners = place_free(style_rng, items, tight, canvas_size, style.overlap)
        elif free:
            corners = free_positions(style_rng, sizes, tight, canvas_size)
        else:  # a 28-pixel item at its drawn offset in its cell, a resized one at an offset drawn for its size
            cells = [divmod(int(cell), grid_size) for cell in layout["cells"][index, :n_objects]]
            offsets = [layout["offsets"][index, slot] if size == ITEM_SIZE
                       else style_rng.integers(0, cell_size - size + 1, size=2) for slot, size in enumerate(sizes)]
            corners = [(row * cell_size + int(dy), col * cell_size + int(dx))
                       for (row, col), (dy, dx) in zip(cells, offsets, strict=True)]
        canvas, visible = compose(under, items, corners, outline=bool(style.overlap))
        boxes = [[x0 + left, y0 + top, right - left, bottom - top]
                 for (y0, x0), (top, left, bottom, right) in zip(corners, tight, strict=True)]
        instance_ids = [len(instances) + 1 + slot for slot in range(n_objects)]
        names = []
        for slot, (instance_id, box, cell) in enumerate(zip(instance_ids, boxes, cells, strict=True)):
            label, colour = int(layout["classes"][index, slot]), int(layout["colours"][index, slot])
            instances.append({"id": instance_id, "image_id": image_id, "category_id": category_id(label),
                              "bbox": box, "area": int(visible[slot].sum()), "iscrowd": 0})
            if clutter:  # the visible pixels: under a background or a later item, no longer the non-zero ones
                instances[-1]["segmentation"] = mask_rle(visible[slot])
            attributes.append({"id": instance_id, "image_id": image_id, "colour": colour_names[colour],
                               "rgb": [int(v) for v in tints[slot]], "cell": list(cell) if cell else None,
                               "source_split": source_split,
                               "source_index": source_slice.start + int(layout["sources"][index, slot])})
            names.append(f"{colour_names[colour]} {CLASS_WORDS[label]}")
        places, judge = (boxes, box_relation) if free else (cells, relation)
        captioner = _Captioner(names, lambda s, o, v, at=places, judge=judge: judge(at[s], at[o], prefer_vertical=v),
                               instance_ids)
        flags = [tuple(pair) for pair in layout["flags"][index].tolist()]
        for text, stated in captioner.captions(layout["orders"][index].tolist(), flags):
            caption_id = len(captions) + 1
            captions.append({"id": caption_id, "image_id": image_id, "caption": text})
            relations += [{"caption_id": caption_id, "subject_id": subject, "relation": phrase, "object_id": obj}
                          for subject, phrase, obj in stated]
        file_name = f"{image_id}.png"
        Image.fromarray(canvas).save(image_dir / file_name, compress_level=PNG_COMPRESS_LEVEL)
        if kind != "black":  # the background alone, each item's pixels distinct from what lies under them
            Image.fromarray(distinguish(under, canvas, visible)).save(root / "backgrounds" / split / file_name,
                                                                      compress_level=PNG_COMPRESS_LEVEL)
        image_entries.append({"id": image_id, "file_name": file_name, "width": canvas_size, "height": canvas_size})
    annotations = root / "annotations"
    annotations.mkdir(parents=True, exist_ok=True)
    categories = [{"id": category_id(label), "name": word, "supercategory": "fashion"}
                  for label, word in enumerate(CLASS_WORDS)]
    for what, content in (("instances", {"images": image_entries, "annotations": instances, "categories": categories}),
                          ("attributes", {"colours": colour_names, "relation_phrases": list(RELATIONS),
                                          "instances": attributes, "relations": relations}),
                          ("captions", {"images": image_entries, "annotations": captions})):
        (annotations / f"{what}_{split}.json").write_text(json.dumps({"info": info, **content}, separators=(",", ":")))
    return {"images": count, "captions": len(captions), "instances": len(instances)}


def make_scenes(root: str | Path, *, counts: Mapping[str, int] | None = None, seed: int = 0, canvas_size: int = 96,
                grid_size: int = 3, style: SceneStyle | Mapping | None = None,
                styles: Mapping[str, SceneStyle | Mapping] | None = None,
                fashion_mnist_root: str | Path = "data/fashion_mnist", overwrite: bool = False,
                ) -> dict[str, dict[str, int]]:
    """Write the Fashion scenes splits under ``root``; returns, per split, how many images, captions and objects.

    ``style`` (a ``SceneStyle`` or a mapping of its fields) draws every split, ``styles`` overrides it per split.
    ``root`` must be new or empty unless ``overwrite`` (which replaces only the dataset's files); the splits are
    staged and moved into place at the end, so a failure leaves the old dataset, or nothing."""
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    split_styles = {split: SceneStyle.of((styles or {}).get(split, style)) for split in counts}
    unknown = set(styles or {}) - set(counts)
    if unknown:
        raise ValueError(f"styles name split(s) {sorted(unknown)} that are not written: {list(counts)}")
    _check_arguments(counts, canvas_size, grid_size, split_styles)
    owner = OwnedFolder(root, "make-scenes", overwrite=overwrite, exclusive=True, legacy=dataset_files)
    directory = find_fashion_mnist(fashion_mnist_root)
    load = functools.cache(lambda name: [tensor.numpy() for tensor in load_fashion_mnist(directory, name)])
    written = {}
    with owner.staged() as staging:
        for split, count in counts.items():
            source_split, source_slice = SOURCES[split]
            images, labels = (array[source_slice] for array in load(source_split))  # each source split read once
            log.info("writing %d %s scenes under %s (%s)", count, split, owner.path, split_styles[split])
            written[split] = _make_split(staging, split, count, images=images, labels=labels, seed=seed,
                                         canvas_size=canvas_size, grid_size=grid_size, style=split_styles[split])
    return written


def dataset_files(root: Path) -> list[str]:
    """The files (relative to ``root``) of a Fashion scenes dataset written before ``make-scenes`` kept a manifest."""
    splits = set(SPLIT_CODES) | {path.stem.removeprefix("captions_") for path in root.glob("annotations/captions_*")}
    names = [f"annotations/{kind}_{split}.json" for split in sorted(splits)
             for kind in ("captions", "instances", "attributes")]
    names = [name for name in names if (root / name).is_file()]
    return names + [f"{kind}/{split}/{path.name}" for kind in ("images", "backgrounds") for split in sorted(splits)
                    for path in sorted((root / kind / split).glob("*.png")) if path.stem.isdigit()]
