"""Every JSON file the tools read, read one way (``read_json``: size and nesting bounded before decoding), and a
validator for COCO captions, COCO instances and the scenes' attributes (``docs/formats/``). Every refusal is one
line naming the file and, from a validator, the list, the entry's index and id, and the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from vision_attn.io import input_file

MAX_JSON_BYTES = 1 << 30  # 1 GiB: MS COCO's largest annotation file (instances_train2017.json) is 448 MB
MAX_JSON_DEPTH = 64  # every format we read nests at most 7 levels (a results record's beams' head_alphas)
MAX_JSON_CONTAINERS = 1 << 25  # arrays and objects in a file: decoded, each costs far more than its two bytes
MAX_ID = 2**63 - 1  # ids are 64-bit integers (pycocotools and numpy hold them so)
MAX_SIDE = 2**31 - 1  # an image's width or height: PNG's own limit
MAX_CAPTION_WORDS = 200  # decoding.max_length's bound: no decoder here writes a longer caption
MAX_CAPTION_CHARS = 4000  # 200 words of up to 19 characters, and the spaces between them

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string literal, escapes included
_NOT_BRACKET = bytes(code for code in range(256) if code not in b"[]{}")
_CHUNK = 1 << 22


def nesting_depth(data: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest (0 for a bare number or string), without recursion."""
    return _nesting(_brackets(data))


def _brackets(data: bytes) -> bytes:  # the brackets outside string literals, in order
    return _STRING.sub(b"", data).translate(None, _NOT_BRACKET)


def _nesting(brackets: bytes) -> int:  # running sums in chunks: memory bounded by the chunk
    depth = deepest = 0
    for start in range(0, len(brackets), _CHUNK):
        codes = np.frombuffer(brackets, dtype=np.uint8, count=min(_CHUNK, len(brackets) - start), offset=start)
        steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
        running = np.cumsum(steps) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def read_json(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The decoded content of the JSON file ``path``, ``what`` naming what it should be ("a COCO captions JSON");
    a file that is not one, too large, not UTF-8, nested too deeply or not JSON is refused in one line."""
    path = input_file(path, what)
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path}: {size} bytes, more than the {max_bytes} bytes a JSON file may have here "
                         f"(it should be {what})")
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a readable JSON file (not UTF-8 text: byte {error.start}); expected "
                         f"{what}") from None
    brackets = _brackets(data)
    depth = _nesting(brackets)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{path}: JSON nested {depth} levels deep, more than the {MAX_JSON_DEPTH} allowed; expected "
                         f"{what}")
    containers = len(brackets) // 2
    if containers > MAX_JSON_CONTAINERS:
        raise ValueError(f"{path}: {containers} JSON arrays and objects, more than the {MAX_JSON_CONTAINERS} a file "
                         f"may hold here (decoded, each takes far more memory than its text); expected {what}")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, or an integer of over 4300 digits
        raise ValueError(f"{path}: not a readable JSON file ({' '.join(str(error).split())}); expected "
                         f"{what}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # an object that gives a key twice would silently keep its last value: refused instead
    decoded = dict(pairs)
    if len(decoded) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return decoded


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_ID <= value <= MAX_ID


def caption_problem(caption: str, *, words: bool = True) -> str | None:
    """What makes a caption longer than a decoder writes (in characters, and with ``words`` in words), or None."""
    if len(caption) > MAX_CAPTION_CHARS:
        return (f"caption has {len(caption)} characters, more than the {MAX_CAPTION_CHARS} a caption may have (no "
                f"decoder writes over {MAX_CAPTION_WORDS} words)")
    count = len(caption.split()) if words else 0
    if count > MAX_CAPTION_WORDS:
        return f"caption has {count} words, more than the {MAX_CAPTION_WORDS} a decoder writes (decoding.max_length)"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _where(key: str, index: int, entry: Any) -> str:  # "images[3] (id 7)"
    ident = entry.get("id") if isinstance(entry, dict) else None
    return f"{key}[{index}]" + (f" (id {_short(ident)})" if ident is not None else "")


class _Refusal:
    # Builds the one-line error of a file that is not the format it should be.

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what

    def __call__(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: not a {self.what} file: {message}")

    def entries(self, data: Any, key: str) -> list[dict[str, Any]]:  # ``data[key]``: a list of objects
        if not isinstance(data, dict):
            raise self(f"expected a JSON object with {key!r}, got a {type(data).__name__}")
        entries = data.get(key)
        if not isinstance(entries, list):
            raise self(f"no {key!r} list" if key not in data else f"{key!r} must be a list, got {_short(entries)}")
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise self(f"{key}[{index}] is a {type(entry).__name__}, not an object")
        return entries

    def ids(self, entries: list[dict[str, Any]], key: str) -> dict[int, int]:  # each entry's unique id -> its index
        seen: dict[int, int] = {}
        for index, entry in enumerate(entries):
            ident = entry.get("id")
            if not _is_id(ident):
                raise self(f"{_where(key, index, entry)}: 'id' must be a whole number, got {_short(ident)}")
            if ident in seen:
                one = {"categories": "category"}.get(key, key.removesuffix("s"))
                raise ValueError(f"{self.path}: {one} id {ident!r} appears twice in {key!r} ({key}[{seen[ident]}] "
                                 f"and {key}[{index}]); ids must be unique")
            seen[ident] = index
        return seen


def _check_images(refuse: _Refusal, data: Any, *, file_names: bool) -> dict[int, int]:
    # The images' ids, checked with their file names (required with ``file_names``), widths and heights
    images = refuse.entries(data, "images")
    ids = refuse.ids(images, "images")
    for index, image in enumerate(images):
        where = _where("images", index, image)
        name = image.get("file_name")
        if (file_names or "file_name" in image) and not (isinstance(name, str) and name):
            raise refuse(f"{where}: 'file_name' must be a non-empty string, got {_short(name)}")
        for key in ("width", "height"):
            if key in image and not (_is_id(image[key]) and 0 < image[key] <= MAX_SIDE):
                raise refuse(f"{where}: {key!r} must be a positive whole number, got {_short(image[key])} (at most "
                             f"{MAX_SIDE})")
    return ids


def check_coco_captions(data: Any, path: Path) -> dict[str, Any]:
    """A COCO captions file's content, checked (``docs/formats/scenes.md``), without ``categories`` (pycocotools'
    index would want each caption to have one)."""
    refuse = _Refusal(path, "COCO captions")
    images = _check_images(refuse, data, file_names=True)
    for index, annotation in enumerate(refuse.entries(data, "annotations")):
        where = _where("annotations", index, annotation)
        if not _is_id(annotation.get("id")):
            raise refuse(f"{where}: 'id' must be a whole number, got {_short(annotation.get('id'))}")
        if not _is_id(annotation.get("image_id")) or annotation["image_id"] not in images:
            raise refuse(f"{where}: image_id {_short(annotation.get('image_id'))} is not an image of 'images'")
        if not isinstance(annotation.get("caption"), str):
            hint = " (an instances file? give the captions file)" if "bbox" in annotation else ""
            raise refuse(f"{where}: 'caption' must be a string, got {_short(annotation.get('caption'))}{hint}")
        problem = caption_problem(annotation["caption"], words=False)
        if problem:
            raise refuse(f"{where}: {problem}")
    return {key: value for key, value in data.items() if key != "categories"}


def check_coco_instances(data: Any, path: Path) -> dict[str, Any]:
    """A COCO instances file's content, checked (``docs/formats/scenes.md``)."""
    refuse = _Refusal(path, "COCO instances")
    images = _check_images(refuse, data, file_names=False)
    categories = refuse.entries(data, "categories")
    category_ids = refuse.ids(categories, "categories")
    for index, category in enumerate(categories):
        if not (isinstance(category.get("name"), str) and category["name"]):
            raise refuse(f"{_where('categories', index, category)}: 'name' must be a non-empty string, got "
                         f"{_short(category.get('name'))}")
    annotations = refuse.entries(data, "annotations")
    refuse.ids(annotations, "annotations")
    for index, annotation in enumerate(annotations):
        where = _where("annotations", index, annotation)
        if not _is_id(annotation.get("image_id")) or annotation["image_id"] not in images:
            raise refuse(f"{where}: image_id {_short(annotation.get('image_id'))} is not an image of 'images'")
        if not _is_id(annotation.get("category_id")) or annotation["category_id"] not in category_ids:
            raise refuse(f"{where}: category_id {_short(annotation.get('category_id'))} is not one of 'categories'")
        box = annotation.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(map(_is_number, box)) and box[2] >= 0
                and box[3] >= 0):
            raise refuse(f"{where}: 'bbox' must be four finite numbers [x, y, w, h] with w, h >= 0, got "
                         f"{_short(box)}")
    return data


def check_attributes(data: Any, path: Path, annotation_ids: set[int]) -> dict[str, Any]:
    """A scenes attributes file's content, checked: each instance's id one of annotation_ids (the instances')."""
    refuse = _Refusal(path, "scenes attributes")
    instances = refuse.entries(data, "instances")
    refuse.ids(instances, "instances")
    colours = data.get("colours")
    if colours is not None and not (isinstance(colours, list) and all(isinstance(c, str) for c in colours)):
        raise refuse(f"'colours' must be a list of colour words, got {_short(colours)}")
    for index, entry in enumerate(instances):
        where, colour = _where("instances", index, entry), entry.get("colour")
        if colour is not None and not isinstance(colour, str):
            raise refuse(f"{where}: 'colour' must be a colour word or null, got {_short(colour)}")
        if colours is not None and colour is not None and colour not in colours:
            raise refuse(f"{where}: colour {colour!r} is not one of 'colours' {colours}")
        if entry["id"] not in annotation_ids:
            raise refuse(f"{where}: no annotation of the instances file has this id (the attributes of "
                         "another split?)")
    return data
