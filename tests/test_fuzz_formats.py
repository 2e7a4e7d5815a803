"""Seeded mutation fuzzing of every file format the commands read, starting from real valid files: a scenes split
written by ``make_scenes``, a tiny trained captioner's checkpoint and a tiny ViT's, the results ``caption`` writes
with the captioner, a test config, a feature cache, an owned folder's manifest, an object-words table and PNG images.

Each format is mutated in each kind of ``KINDS`` that applies to it (``COVERED``): random bytes, truncation, bit
flips, type swaps, huge values, deep nesting, duplicates and odd Unicode. The contract, checked for every case: the
reader accepts the input and what it gives is usable (finite numbers, the shapes and types documented), or it
refuses it with one of the project's errors whose message, as the command line prints it, names the file; never
another exception, and each case within ``CASE_SECONDS``. A few of the cases of each command run through the
command line too, under a memory cap: exit 0 with a whole output without NaN, or exit 2 with one ``error:`` line
and no traceback, and no half-written output. The random stream is seeded, so a failing case comes back on the
next run; its format, kind and index are in the test's id and message."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import random
import resource
import shutil
import struct
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests.conftest import CONFIGS, run_each_in_a_fresh_process, run_in_process
from vision_attn.api import CaptionResult
from vision_attn.checkpoint import read_model_checkpoint
from vision_attn.config_files import check_config_files
from vision_attn.data.coco import read_coco_captions, read_instances, read_object_targets
from vision_attn.data.feature_cache import FeatureCache
from vision_attn.data.images import open_image
from vision_attn.data.object_words import read_object_words
from vision_attn.data.scenes import make_scenes
from vision_attn.errors import USER_ERRORS, user_message
from vision_attn.io import MANIFEST, OwnedFolder, read_manifest
from vision_attn.results import read_results, read_scored_results

SEED = 53
CASES = 6  # per format and kind
CASE_SECONDS = 5.0  # what one in-process case may take: each file here is a few kilobytes, or a few megabytes
MEMORY_CAP = 8 * 2**30  # the address space of the command-line runs (METEOR's Java reserves over 4 GiB)

KINDS = ("random bytes", "truncation", "bit flips", "type swap", "huge value", "deep nesting", "duplicate",
         "odd unicode")
BYTE_KINDS = KINDS[:3]
TREE_KINDS = KINDS[3:]
FORMATS = ("results", "scored results", "captions", "instances", "attributes", "object words", "config",
           "checkpoint", "image", "feature cache", "manifest")
# what each format is fuzzed with: JSON and YAML formats every kind; the binary ones what their structure has
COVERED = {**{name: KINDS for name in FORMATS},
           "image": (*BYTE_KINDS, "type swap", "huge value", "duplicate", "odd unicode"),
           "feature cache": (*BYTE_KINDS, "type swap", "huge value", "duplicate", "odd unicode")}

RAW = "\u0001raw\u0001"  # a string the text form of a tree replaces by raw text (what json.dumps cannot write)
ODD_STRINGS = ["\u202egnp.exe", "\x00", "e\u0301\u0301\u0301", "\ufeffred", "\ud800", "\U0001d4e4\U0001d4f7",
               "line\u2028break", "ﬁne", "１２３", "\u200b", "a\nb\r\nc", "\ue000", "Ⅻ", "٣", "İ", "ß" * 3, "\t",
               "../../etc/passwd", "C:\\x", "%s%n", "'; DROP TABLE", ""]
SWAPS: list[Any] = [None, True, False, 0, -1, 1.5, "", "3", "x", [], {}, [1, 2], {"a": 1}, float("nan"),
                    float("inf"), -float("inf"), [[]], {"": None}]
HUGE: list[Any] = [10**30, -(2**63) - 1, 2**64, 1e308, -1e308, 2**31, 2**53 + 1, "x" * 200_000, [0] * 50_000,
                   RAW + "1" + "0" * 5000, RAW + "1e99999", RAW + "-0", "9" * 4000]


# --- the mutation engine ---------------------------------------------------------------------------------------
def places(tree: Any) -> list[tuple]:
    """The paths (keys and indices) of every node of a JSON-like tree, the root's ``()`` first, without recursion."""
    found, todo = [], [()]
    while todo:
        path = todo.pop()
        found.append(path)
        node = at(tree, path)
        if isinstance(node, dict):
            todo += [(*path, key) for key in node]
        elif isinstance(node, list):
            todo += [(*path, index) for index in range(len(node))]
    return found


def at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def replaced(tree: Any, path: tuple, value: Any) -> Any:
    """``tree`` (a deep copy) with the node at ``path`` replaced by ``value``."""
    if not path:
        return value
    tree = copy.deepcopy(tree)
    at(tree, path[:-1])[path[-1]] = value
    return tree


def _raw(text: str) -> str:
    """JSON text with each string ``RAW + text`` replaced by that raw text (what json.dumps cannot write)."""
    marker = json.dumps(RAW)[1:-1]
    while f'"{marker}' in text:
        start = text.index(f'"{marker}')
        decoded, end = json.decoder.scanstring(text, start + 1)
        text = text[:start] + decoded[len(RAW):] + text[end:]
    return text


def mutate_bytes(rng: random.Random, kind: str, data: bytes) -> bytes:
    """``data`` after one mutation of a kind in ``BYTE_KINDS``."""
    if kind == "random bytes":
        noise = rng.randbytes(rng.choice([0, 1, 7, 64, 4096]))
        if rng.random() < 0.5 or not data:
            return noise
        start = rng.randrange(len(data))
        return data[:start] + noise + data[start + len(noise):]
    if kind == "truncation":
        return data[:rng.choice([0, 1, len(data) // 2, max(0, len(data) - 1), rng.randrange(len(data) + 1)])]
    flipped = bytearray(data)
    for _ in range(rng.choice([1, 3, 20, 200])):
        if flipped:
            index = rng.randrange(len(flipped))
            flipped[index] ^= 1 << rng.randrange(8)
    return bytes(flipped)


def mutate_tree(rng: random.Random, kind: str, tree: Any) -> Any:
    """``tree`` after one mutation of a kind in ``TREE_KINDS`` (a duplicated key is made in the text instead)."""
    paths = places(tree)
    if kind == "type swap":
        path = rng.choice(paths)
        old = at(tree, path)
        return replaced(tree, path, rng.choice([value for value in SWAPS if type(value) is not type(old)]))
    if kind == "huge value":
        leaves = [path for path in paths if not isinstance(at(tree, path), dict | list)] or paths
        return replaced(tree, rng.choice(leaves), rng.choice(HUGE))
    if kind == "deep nesting":
        path, depth = rng.choice(paths), rng.choice([63, 65, 300, 5000])
        opening, closing = ("[" * depth, "]" * depth) if rng.random() < 0.5 else ('{"a":' * depth, "}" * depth)
        return replaced(tree, path, RAW + opening + json.dumps(at(tree, path)) + closing)
    if kind == "duplicate":
        lists = [path for path in paths if isinstance(at(tree, path), list) and at(tree, path)]
        path = rng.choice(lists) if lists else ()
        items = copy.deepcopy(at(tree, path))
        if not isinstance(items, list) or not items:
            return tree
        index = rng.randrange(len(items))
        items[index:index] = [copy.deepcopy(items[index])] * rng.choice([1, 1, 2, 1000])
        return replaced(tree, path, items)
    # odd unicode: a string, or a key of an object, becomes an odd one
    strings = [path for path in paths if isinstance(at(tree, path), str)]
    keyed = [path for path in paths if path and isinstance(path[-1], str)]
    odd = rng.choice(ODD_STRINGS)
    if strings and (rng.random() < 0.6 or not keyed):
        path = rng.choice(strings)
        return replaced(tree, path, odd if rng.random() < 0.5 else at(tree, path) + odd)
    if not keyed:
        return tree
    path = rng.choice(keyed)
    parent = copy.deepcopy(at(tree, path[:-1]))
    parent = {(key + odd if key == path[-1] else key): value for key, value in parent.items()}
    return replaced(tree, path[:-1], parent)


def duplicate_key(rng: random.Random, text: str) -> str:
    """JSON text with one of its object keys given a second time, with another value, just before the first."""
    keys = [index for index in range(len(text)) if text.startswith('{"', index) or text.startswith(', "', index)]
    if not keys:
        return text
    start = rng.choice(keys) + (1 if text[rng.choice(keys)] == "{" else 2)
    start = text.index('"', start - 1)
    end = text.index('":', start + 1)
    key = text[start:end + 1]
    return f"{text[:start]}{key}: {json.dumps(rng.choice(SWAPS))}, {text[start:]}"


def mutated_json(rng: random.Random, kind: str, good: Any) -> bytes:
    """The bytes of a JSON file: ``good`` after one mutation of ``kind``."""
    if kind in BYTE_KINDS:
        return mutate_bytes(rng, kind, json.dumps(good).encode())
    if kind == "duplicate" and rng.random() < 0.5:
        return duplicate_key(rng, json.dumps(good)).encode()
    if kind == "odd unicode" and rng.random() < 0.3:
        return rng.choice([b"\xef\xbb\xbf", b"\xff\xfe", b""]) + (
            json.dumps(good).encode("utf-16") if rng.random() < 0.3 else json.dumps(good).encode())
    return _raw(json.dumps(mutate_tree(rng, kind, good))).encode("utf-8", "surrogatepass")


def cases(name: str, kind: str) -> Iterator[tuple[int, random.Random]]:
    """The seeded cases of one format and kind: each with its own random stream, so each can be rerun alone."""
    for index in range(CASES):
        yield index, random.Random(f"{SEED}/{name}/{kind}/{index}")


# --- the contract ----------------------------------------------------------------------------------------------
def finite(tree: Any) -> bool:
    """Whether every number in a JSON-like tree (tensors and arrays included) is finite."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return False
        if isinstance(node, torch.Tensor) and node.is_floating_point() and not bool(node.isfinite().all()):
            return False
        if isinstance(node, np.ndarray) and node.dtype.kind == "f" and not bool(np.isfinite(node).all()):
            return False
        if isinstance(node, dict):
            todo += list(node.values())
        elif isinstance(node, list | tuple):
            todo += list(node)
    return True


def accepted_or_refused(read: Callable[[], Any], path: Path, case: str) -> Any:
    """``read()``'s value, or None when it refused with one of our errors naming ``path`` in one line; anything
    else, or a case over ``CASE_SECONDS``, fails the test naming ``case``."""
    start = time.perf_counter()
    try:
        return read()
    except USER_ERRORS as error:
        message = user_message(error)
        assert str(path) in message or path.name in message, f"{case}: {message[:500]}"
        return None
    finally:
        assert time.perf_counter() - start < CASE_SECONDS, f"{case}: {time.perf_counter() - start:.1f} s"


# --- the valid files -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def valid(trained_captioner, vit_checkpoint, tmp_path_factory) -> dict[str, Any]:
    """The valid files the mutations start from, and their content."""
    work = tmp_path_factory.mktemp("fuzz_valid")
    root, ckpt = trained_captioner["scenes"], trained_captioner["ckpt"]
    images = root / "images" / "test"
    results = work / "results.json"
    done = run_in_process("caption", "--ckpt", str(ckpt), str(images), "--out", str(results))
    assert done.returncode == 0, done.stderr[-2000:]
    found = {"root": root, "ckpt": ckpt, "images": images, "results": results, "work": work,
             "annotations": {kind: root / "annotations" / f"{kind}_test.json"
                             for kind in ("captions", "instances", "attributes")}}
    found["trees"] = {kind: json.loads(path.read_text()) for kind, path in found["annotations"].items()}
    # file names relative to the images (read_results finds them there), so the bytes mutated are the same wherever
    # the suite's temporary folder lies
    found["trees"]["results"] = [{**record, "file_name": Path(record["file_name"]).name}
                                 for record in json.loads(results.read_text())]
    ids = {image["file_name"]: image["id"] for image in found["trees"]["captions"]["images"]}
    found["trees"]["scored"] = [{"image_id": ids[Path(record["file_name"]).name], "caption": record["caption"]}
                                for record in found["trees"]["results"]]  # the COCO results format, by image id
    found["trees"]["object words"] = {"name": "fuzz", "categories": {"shirt": ["shirt", "t-shirt", "top"],
                                                                     "bag": ["bag", "handbag"]}}
    found["trees"]["config"] = yaml.safe_load((CONFIGS / "captioner_tiny.yaml").read_text())
    found["checkpoint"] = torch.load(ckpt, map_location="cpu", weights_only=True)
    found["vit"], found["vit_ckpt"] = torch.load(vit_checkpoint, map_location="cpu", weights_only=True), vit_checkpoint
    return found


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --- the JSON and YAML formats, in process ----------------------------------------------------------------------
def check_results(path: Path, valid: dict[str, Any]) -> Any:
    records = read_results(path, image_dir=valid["images"])
    for record, image in records:
        assert image.is_file() and finite(record)
        if record.get("image_size") is not None:  # a record as `caption` writes it: the API's result of it
            result = CaptionResult.from_record(record)
            assert result.alphas.shape[0] == len(result.tokens)
    return records


def check_scored(path: Path, valid: dict[str, Any]) -> Any:
    records = read_scored_results(path)
    assert records and all(isinstance(r["caption"], str) and finite(r) for r in records)
    ids = [r["image_id"] for r in records]
    assert len(ids) == len(set(ids))
    return records


def check_captions(path: Path, valid: dict[str, Any]) -> Any:
    found = read_coco_captions(path, valid["images"])
    assert found and all(item.captions and all(isinstance(c, str) for c in item.captions) for item in found)
    return found


def check_instances(path: Path, valid: dict[str, Any]) -> Any:
    found = read_instances(path)
    for objects in found.objects.values():
        assert all(len(item.box) == 4 and all(map(math.isfinite, item.box)) for item in objects)
    targets = read_object_targets(path)
    assert finite(list(targets))
    return found


def check_attributes(path: Path, valid: dict[str, Any]) -> Any:
    found = read_instances(valid["annotations"]["instances"], path)
    assert all(item.colour is None or isinstance(item.colour, str) for objects in found.objects.values()
               for item in objects)
    return found


def check_object_words(path: Path, valid: dict[str, Any]) -> Any:
    table = read_object_words(path)
    assert isinstance(table.named_in(["a shirt beside a bag", ""]), set)
    return table


def check_config(path: Path, valid: dict[str, Any]) -> Any:
    check_config_files(["--config", str(path)])
    return True


JSON_READERS: dict[str, tuple[str, Callable[[Path, dict[str, Any]], Any]]] = {
    "results": ("results", check_results), "scored results": ("scored", check_scored),
    "captions": ("captions", check_captions), "instances": ("instances", check_instances),
    "attributes": ("attributes", check_attributes), "object words": ("object words", check_object_words),
    "config": ("config", check_config)}


def mutated_yaml(rng: random.Random, kind: str, good: Any) -> bytes:
    """The bytes of a YAML config: ``good`` after one mutation of ``kind`` (its JSON form is YAML too)."""
    if kind in BYTE_KINDS:
        return mutate_bytes(rng, kind, yaml.safe_dump(good).encode())
    if kind == "duplicate" and rng.random() < 0.5:  # a key given twice in a block mapping
        text = yaml.safe_dump(good, sort_keys=False)
        lines = text.splitlines(keepends=True)
        index = rng.randrange(len(lines))
        return "".join([*lines[:index + 1], lines[index], *lines[index + 1:]]).encode()
    return mutated_json(rng, kind, good)


@pytest.mark.parametrize(("name", "kind"), [(name, kind) for name in JSON_READERS for kind in COVERED[name]])
def test_fuzz_json_and_yaml_readers(name: str, kind: str, valid, tmp_path: Path) -> None:
    tree_name, check = JSON_READERS[name]
    good = valid["trees"][tree_name]
    for index, rng in cases(name, kind):
        data = (mutated_yaml if name == "config" else mutated_json)(rng, kind, good)
        path = write(tmp_path / f"{index}" / ("config.yaml" if name == "config" else f"{tree_name}.json"), data)
        accepted_or_refused(lambda path=path: check(path, valid), path, f"{name}/{kind}/{index}")


# --- checkpoints ------------------------------------------------------------------------------------------------
def mutated_checkpoint(rng: random.Random, kind: str, good: dict[str, Any], path: Path) -> None:
    """Write to ``path`` the valid checkpoint ``good`` after one mutation of ``kind``: of its bytes, of the tree it
    holds (a tensor is a leaf; a huge one holds values near float32's largest), or a zip member given twice."""
    buffer = io.BytesIO()
    if kind in BYTE_KINDS:
        torch.save(good, buffer)
        path.write_bytes(mutate_bytes(rng, kind, buffer.getvalue()))
        return
    if kind == "duplicate" and rng.random() < 0.5:  # a member of the archive twice, the second one another's bytes
        torch.save(good, buffer)
        with zipfile.ZipFile(buffer) as source:
            members = [(info.filename, source.read(info)) for info in source.infolist()]
        twice = rng.randrange(len(members))
        other = members[rng.randrange(len(members))][1]
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive, pytest.warns(UserWarning, match="Duplicate"):
            for index, (name, data) in enumerate(members):
                archive.writestr(name, data)
                if index == twice:
                    archive.writestr(name, other)
        return
    tree = good
    if kind == "huge value" and rng.random() < 0.3:
        tensors = [path for path in places(good) if isinstance(at(good, path), torch.Tensor)
                   and at(good, path).is_floating_point()]
        place = rng.choice(tensors)
        tree = replaced(good, place, torch.full_like(at(good, place), 3e38))
    elif kind == "deep nesting":
        place, nested = rng.choice(places(good)), None
        nested = at(good, place)
        for _ in range(rng.choice([63, 65, 300])):
            nested = [nested] if rng.random() < 0.5 else {"a": nested}
        tree = replaced(good, place, nested)
    else:
        tree = mutate_tree(rng, kind, good)
        if isinstance(tree, dict):
            tree = {key: value for key, value in tree.items() if not (isinstance(value, str) and RAW in value)}
    try:
        torch.save(tree, buffer)
    except (RuntimeError, TypeError, UnicodeEncodeError):  # a tree torch cannot write (a lone surrogate in a key)
        torch.save(good, buffer)
    path.write_bytes(buffer.getvalue())


def check_checkpoint(path: Path, kind: str = "captioner") -> Any:
    saved = read_model_checkpoint(path, kind=kind)
    assert finite(dict(saved.state_dict))
    return saved


@pytest.mark.parametrize("model", ["captioner", "vit"])
@pytest.mark.parametrize("kind", COVERED["checkpoint"])
def test_fuzz_checkpoints(kind: str, model: str, valid, tmp_path: Path) -> None:
    good = valid["checkpoint" if model == "captioner" else "vit"]
    for index, rng in cases("checkpoint" if model == "captioner" else "vit checkpoint", kind):
        path = tmp_path / f"{index}.ckpt"
        mutated_checkpoint(rng, kind, good, path)
        accepted_or_refused(lambda path=path: check_checkpoint(path, model), path, f"{model} checkpoint/{kind}/{index}")


# --- images ------------------------------------------------------------------------------------------------------
def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    found, offset = [], 8
    while offset + 8 <= len(data):
        length, = struct.unpack(">I", data[offset:offset + 4])
        found.append((data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]))
        offset += 12 + length
    return found


def mutated_image(rng: random.Random, kind: str, good: bytes) -> bytes:
    """A PNG's bytes after one mutation of ``kind``: another mode or format for a type swap, a header of huge
    sides (its CRC right), chunks given twice; odd Unicode is in the file's name instead."""
    if kind in BYTE_KINDS:
        return mutate_bytes(rng, kind, good)
    image = Image.open(io.BytesIO(good))
    image.load()
    chunks = png_chunks(good)
    if kind == "type swap":
        mode, form = rng.choice([("1", "PNG"), ("I;16", "PNG"), ("I", "PNG"), ("F", "TIFF"), ("CMYK", "JPEG"),
                                 ("LA", "PNG"), ("P", "GIF"), ("RGBA", "WEBP"), ("RGB", "BMP"), ("L", "ICO"),
                                 ("YCbCr", "JPEG"), ("RGB", "PPM")])
        if rng.random() < 0.15:
            return json.dumps({"not": "an image"}).encode()
        out = io.BytesIO()
        if mode in ("I;16", "I"):  # 16- and 32-bit grey
            grey = np.asarray(image.convert("L"), dtype=np.uint16 if mode == "I;16" else np.int32) * 257
            Image.fromarray(grey).save(out, form)
        else:
            image.convert(mode).save(out, form)
        return out.getvalue()
    if kind == "huge value":
        width, height = rng.choice([(2**31 - 1, 1), (65535, 65535), (1, 2**31 - 1), (0, 0), (2**32 - 1, 2**32 - 1),
                                    (100_000, 1)])
        ihdr = struct.pack(">II", width, height) + chunks[0][1][8:]
        return good[:8] + png_chunk(b"IHDR", ihdr) + b"".join(png_chunk(k, d) for k, d in chunks[1:])
    # duplicate: a chunk given twice, or the whole file twice
    if rng.random() < 0.2:
        return good + good
    twice = rng.randrange(len(chunks))
    return good[:8] + b"".join(png_chunk(k, d) * (2 if index == twice else 1)
                               for index, (k, d) in enumerate(chunks))


ODD_NAMES = ["new\nline.png", "\u202egnp.exe.png", "e\u0301.png", " .png", "-rf.png", "\U0001f600.png",
             "\udcff.png", "a" * 250 + ".png", "*?.png", ".png"]


@pytest.mark.parametrize("kind", COVERED["image"])
def test_fuzz_images(kind: str, valid, tmp_path: Path) -> None:
    good = (valid["images"] / "1.png").read_bytes()
    for index, rng in cases("image", kind):
        if kind == "odd unicode":
            path, data = tmp_path / f"{index}" / rng.choice(ODD_NAMES), good
        else:
            path, data = tmp_path / f"{index}.png", mutated_image(rng, kind, good)
        write(path, data)

        def check(path: Path = path) -> Any:
            image = open_image(path, max_side=96)
            assert image.mode == "RGB" and min(image.size) >= 1
            return image

        accepted_or_refused(check, path, f"image/{kind}/{index}")


# --- feature caches -------------------------------------------------------------------------------------------
CACHE_SHAPE = (4, 2, 2)


def filled_cache(root: Path) -> FeatureCache:
    """A cache of five images in shards of two (the last one short), filled; ``encode`` gives finite features."""
    cache = FeatureCache(root, {"fuzz": True}, 5, CACHE_SHAPE, shard_size=2)
    cache.fill(lambda index: torch.full((1,), float(index)),
               lambda images: images.view(-1, 1, 1, 1).expand(-1, *CACHE_SHAPE) / 10, batch_size=2)
    return cache


def mutated_cache_file(rng: random.Random, kind: str, cache: FeatureCache) -> Path:
    """Mutate one file of ``cache`` (its key.json, a shard or a shard's flags) in ``kind``; the file's path."""
    files = sorted(cache.folder.iterdir())
    path = rng.choice(files)
    data = path.read_bytes()
    if kind in BYTE_KINDS:
        path.write_bytes(mutate_bytes(rng, kind, data))
    elif path.name == "key.json":
        path.write_bytes(mutated_json(rng, kind, json.loads(data)))
    elif kind == "type swap":
        array = np.load(path)
        other = rng.choice([np.float32, np.float64, np.int8, np.uint8, bool, np.complex64, "U3", np.int64])
        np.save(path, array.astype(other))
    elif kind == "huge value":
        array = np.load(path)
        big = rng.choice([np.inf, -np.inf, np.nan, 65504, 1e30])
        array.reshape(-1)[rng.randrange(array.size)] = big
        if rng.random() < 0.3:  # a header promising far more rows than the file holds
            text = data.decode("latin-1").replace(f"({array.shape[0]},", "(1000000000000,", 1)
            data = text.encode("latin-1")
            path.write_bytes(data)
            return path
        np.save(path, array)
    elif kind == "duplicate":  # one shard's file copied over another's
        other = rng.choice([file for file in files if file.name != "key.json"])
        shutil.copyfile(other, path)
    else:  # odd unicode: the header's dict given odd text
        path.write_bytes(data.replace(b"'descr'", "'descr\u202e'".encode(), 1).replace(b"False", b"\xff\xfe", 1))
    return path


@pytest.mark.parametrize("kind", COVERED["feature cache"])
def test_fuzz_feature_caches(kind: str, tmp_path: Path) -> None:
    for index, rng in cases("feature cache", kind):
        cache = filled_cache(tmp_path / f"{index}")
        path = mutated_cache_file(rng, kind, cache)

        def check(root: Path = tmp_path / f"{index}") -> list[Any]:
            again = filled_cache(root)  # what fit and cache-features do: fill what is missing, then read
            items = [again[row] for row in range(again.count)]
            assert all(item is None or (tuple(item.shape) == CACHE_SHAPE and bool(item.float().isfinite().all()))
                       for item in items)
            return items

        accepted_or_refused(check, path, f"feature cache/{kind}/{index} ({path.name})")


# --- manifests ------------------------------------------------------------------------------------------------
def owned_folder(folder: Path) -> dict[str, Any]:
    """A folder written by `overlay` (two files and its manifest), with a file of the user's beside them and a
    subfolder linked to a folder outside, holding another; the manifest's content."""
    out = OwnedFolder(folder, "overlay")
    with out.staged() as staging:
        (staging / "index.html").write_text("<html></html>")
        (staging / "images").mkdir()
        (staging / "images" / "0.png").write_bytes(b"png")
    (folder / "user.txt").write_text("the user's")
    outside = folder.parent / f"{folder.name}-outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("the user's too")
    (folder / "linked").symlink_to(outside)
    return json.loads((folder / MANIFEST).read_text())


@pytest.mark.parametrize("kind", COVERED["manifest"])
def test_fuzz_manifests(kind: str, tmp_path: Path) -> None:
    for index, rng in cases("manifest", kind):
        folder = tmp_path / f"{index}"
        good = owned_folder(folder)
        good["files"] += [{"path": "user.txt", "size": 10, "sha256": "0" * 64}, "linked/victim.txt"]
        path = write(folder / MANIFEST, mutated_json(rng, kind, good))

        def check(folder: Path = folder, overwrite: bool = rng.random() < 0.5) -> Any:
            manifest = read_manifest(folder)  # never raises: None, or what it says checked against the folder
            assert manifest is None or all((folder / name).resolve().is_relative_to(folder.resolve())
                                           for name in manifest.ours)
            out = OwnedFolder(folder, "overlay", overwrite=overwrite)
            with out.staged() as staging:
                (staging / "index.html").write_text("<html>again</html>")
            return out

        accepted_or_refused(check, folder, f"manifest/{kind}/{index}")
        assert (folder / "user.txt").read_text() == "the user's"
        assert (tmp_path / f"{index}-outside" / "victim.txt").read_text() == "the user's too"
        assert not [p for p in folder.iterdir() if p.name.startswith(".vision-attn-staging-")]
        assert path.parent == folder


# --- the commands, in one capped process -----------------------------------------------------------------------
def run_capped(commands: list[list[str]], limit: int = MEMORY_CAP, crash_logs: Path | None = None
               ) -> list[tuple[int, str]]:
    """Each of ``commands`` through the command line, one after another in one new interpreter whose address space
    is capped at ``limit``: each one's exit code and stderr. A Java that the cap crashes writes its crash logs in
    ``crash_logs``, not in its working folder (pycocoevalcap's, in the installed package)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = None
    if crash_logs is not None:
        logs = f"-XX:ErrorFile={crash_logs}/hs_err_%p.log -XX:ReplayDataFile={crash_logs}/replay_%p.log"
        env = {**os.environ, "JAVA_TOOL_OPTIONS": logs}
    return [(done.returncode, done.stderr)
            for done in run_each_in_a_fresh_process(commands, env=env, preexec_fn=cap)]


def strict_json(path: Path) -> Any:
    """``path``'s JSON, refusing ``NaN`` and ``Infinity`` (not JSON)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{path}: holds {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


def whole_output(out: Path) -> None:
    """What a command that exited 0 wrote at ``out``: a whole JSON file, or a folder with its manifest, every JSON
    in it strict and no staging folder or temporary file left."""
    if out.suffix == ".json":
        strict_json(out)
        leftovers = [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]
    else:
        assert (out / MANIFEST).is_file(), out
        for found in out.rglob("*.json"):
            strict_json(found)
        leftovers = [p.name for p in out.rglob("*") if p.name.startswith(".vision-attn-staging-")
                     or p.name.endswith(".tmp")]
    assert not leftovers, (out, leftovers)


def command_cases(valid: dict[str, Any], work: Path) -> list[tuple[str, list[str], Path]]:
    """The command-line cases: (what, the arguments, the output), a few of each command for each format it reads,
    the mutations drawn from the seeded stream."""
    rng = random.Random(f"{SEED}/commands")
    image, ckpt, trees = valid["images"] / "1.png", valid["ckpt"], valid["trees"]
    found: list[tuple[str, list[str], Path]] = []

    def add(what: str, args: list[str], out: Path) -> None:
        found.append((what, [*map(str, args), "--out", str(out)], out))

    for index, kind in enumerate([*TREE_KINDS, *TREE_KINDS, *BYTE_KINDS]):  # caption: checkpoints
        path = work / f"ckpt{index}.ckpt"
        mutated_checkpoint(rng, kind, valid["checkpoint"], path)
        add(f"caption --ckpt ({kind})", ["caption", "--ckpt", path, image], work / f"caption{index}" / "r.json")
    for index, kind in enumerate(COVERED["image"]):  # caption: images
        name = rng.choice(ODD_NAMES) if kind == "odd unicode" else "image.png"
        path = write(work / f"image{index}" / name, (image.read_bytes() if kind == "odd unicode"
                                                     else mutated_image(rng, kind, image.read_bytes())))
        add(f"caption IMAGE ({kind})", ["caption", "--ckpt", ckpt, path], work / f"captioned{index}" / "r.json")
    for index, kind in enumerate(KINDS):  # overlay: results
        path = write(work / f"results{index}.json", mutated_json(rng, kind, trees["results"]))
        add(f"overlay RESULTS ({kind})", ["overlay", path, "--panel-size", "64"], work / f"overlay{index}")
    for index, kind in enumerate(rng.sample(KINDS, 3)):  # explore: instances and attributes
        instances = write(work / f"instances{index}.json", mutated_json(rng, kind, trees["instances"]))
        attributes = write(work / f"attributes{index}.json", mutated_json(rng, kind, trees["attributes"]))
        add(f"explore --instances --attributes ({kind})", ["explore", valid["results"], "--instances", instances,
                                                           "--attributes", attributes], work / f"explore{index}")
    for index, kind in enumerate(rng.sample(KINDS, 3)):  # evaluate: results, references and the words table
        results = write(work / f"scored{index}.json", mutated_json(rng, kind, trees["scored"]))
        captions = write(work / f"captions{index}.json", mutated_json(rng, kind, trees["captions"]))
        words = write(work / f"words{index}.json", mutated_json(rng, kind, trees["object words"]))
        add(f"evaluate ({kind})", ["evaluate", results, "--annotations", captions, "--instances",
                                   valid["annotations"]["instances"], "--words", words], work / f"scores{index}.json")
    for index, kind in enumerate(rng.sample(KINDS, 2)):  # erasure: a scenes root whose instances are mutated
        root = work / f"root{index}"
        shutil.copytree(valid["root"] / "images" / "test", root / "images" / "test")
        shutil.copytree(valid["root"] / "annotations", root / "annotations")
        write(root / "annotations" / "instances_test.json", mutated_json(rng, kind, trees["instances"]))
        add(f"erasure --root ({kind})", ["erasure", "--ckpt", ckpt, "--root", root, "--count", "2"],
            work / f"erasure{index}.json")
    vit_kinds = [*rng.sample(TREE_KINDS, 3), *rng.sample(BYTE_KINDS, 2)]
    for index, kind in enumerate(vit_kinds):  # the ViT's tools: checkpoints
        path = work / f"vit{index}.ckpt"
        mutated_checkpoint(rng, kind, valid["vit"], path)
        tool = ("classify", "deletion", "rollout-mass")[index % 3]
        args = {"classify": ["classify", "--ckpt", path, image],
                "deletion": ["deletion", "--ckpt", path, "--count", "2", "--steps", "2"],
                "rollout-mass": ["rollout-mass", "--ckpt", path, "--count", "2"]}[tool]
        if tool == "rollout-mass":  # it prints its figures and writes nothing
            found.append((f"rollout-mass --ckpt ({kind})", list(map(str, args)), work / f"printed{index}"))
        else:
            add(f"{tool} --ckpt ({kind})", args, work / f"{tool}{index}.json")
    for index, kind in enumerate(rng.sample([k for k in COVERED["image"] if k != "odd unicode"], 3)):  # classify
        path = write(work / f"vit_image{index}" / "image.png", mutated_image(rng, kind, image.read_bytes()))
        add(f"classify IMAGE ({kind})", ["classify", "--ckpt", valid["vit_ckpt"], path], work / f"classes{index}.json")
    for index, kind in enumerate(rng.sample(KINDS, 4)):  # fit: configs, parsed and printed only
        config = write(work / f"config{index}.yaml", mutated_yaml(rng, kind, trees["config"]))
        found.append((f"fit --config ({kind})", ["fit", "--config", str(CONFIGS / "tiny_trainer.yaml"), "--config",
                                                 str(config), "--print_config"], work / "printed"))
    for index, kind in enumerate(rng.sample(KINDS, 2)):  # make-scenes: a folder with a mutated manifest
        root = work / f"scenes{index}"
        owned_folder(root)
        write(root / MANIFEST, mutated_json(rng, kind, json.loads((root / MANIFEST).read_text())))
        found.append((f"make-scenes --root ({kind})", ["make-scenes", "--root", str(root), "--train", "0", "--val",
                                                       "0", "--test", "1"], root))
    return found


def test_fuzz_every_command_exits_0_with_whole_output_or_2_in_one_line(valid, tmp_path: Path) -> None:
    cases_run = command_cases(valid, tmp_path)
    start = time.perf_counter()
    outcomes = run_capped([args for _, args, _ in cases_run])
    assert time.perf_counter() - start < 240
    for (what, args, out), (code, stderr) in zip(cases_run, outcomes, strict=True):
        assert code in (0, 2) and "Traceback" not in stderr, (what, code, stderr[-2000:])
        if code == 2:
            lines = stderr.strip().splitlines()
            assert lines and lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1, \
                (what, stderr[-2000:])
            assert args[0] == "make-scenes" or not out.exists() or out.is_dir(), (what, "wrote before refusing")
        elif args[0] not in ("fit", "make-scenes", "rollout-mass"):
            whole_output(out)
        if args[0] == "make-scenes":
            assert (out / "user.txt").read_text() == "the user's", what
            assert (out.parent / f"{out.name}-outside" / "victim.txt").read_text() == "the user's too", what


# --- what the fuzzing found, kept ----------------------------------------------------------------------------------
def test_a_config_key_given_twice_is_refused_naming_its_line(tmp_path: Path) -> None:
    config = tmp_path / "twice.yaml"
    config.write_text("trainer:\n  max_epochs: 1\n  min_epochs: 1\n  max_epochs: 5\nmodel:\n  init_args: {}\n")
    result = run_in_process("fit", "--config", str(config), "--print_config")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith(f"error: {config}: line 4, column 3: the key 'max_epochs' is given twice"), lines[0]
    assert "first on line 2" in lines[0]
    config.write_text("trainer:\n  max_epochs: 1\ndata:\n  init_args: {max_epochs: 1}\n")  # one key per mapping
    check_config_files(["--config", str(config)])


@pytest.mark.parametrize("damage", ["a header of 10**12 rows", "pickled objects", "empty", "float flags"])
def test_a_damaged_flags_file_of_a_feature_cache_is_filled_again_never_allocated(damage: str, tmp_path: Path) -> None:
    cache = filled_cache(tmp_path)
    flags = cache.folder / "shard_00001.valid.npy"
    if damage == "a header of 10**12 rows":
        flags.write_bytes(flags.read_bytes().replace(b"(2,)", b"(1000000000000,)", 1))
    elif damage == "pickled objects":
        np.save(flags, np.array([True, None], dtype=object), allow_pickle=True)
    elif damage == "empty":
        flags.write_bytes(b"")
    else:
        np.save(flags, np.ones(2, dtype=np.float32))
    again = filled_cache(tmp_path)  # the damaged shard is missing: filled again
    assert np.load(flags).dtype == np.bool_
    assert [float(again[row].float().mean()) for row in range(5)] == pytest.approx([0, 0.1, 0.2, 0.3, 0.4], abs=1e-3)
    np.save(flags, np.ones(3, dtype=bool))  # damaged after the fill: one line naming the shard when read
    with pytest.raises(ValueError, match=r"shard_00001\.npy: it or shard_00001\.valid\.npy beside it is missing or "
                                         "damaged"):
        FeatureCache(tmp_path, {"fuzz": True}, 5, CACHE_SHAPE, shard_size=2)[2]


def test_a_manifest_naming_one_file_many_times_reads_it_once(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    with OwnedFolder(folder, "overlay").staged() as staging:
        (staging / "big.bin").write_bytes(bytes(range(256)) * 2**15)  # 8 MiB
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / "hard.bin").hardlink_to(folder / "big.bin")
    entry = manifest["files"][0]
    manifest["files"] = ([entry] * 5000 + [{**entry, "path": "./big.bin"}] * 5000
                         + [{**entry, "path": "hard.bin"}] * 5000)  # 120 GiB to hash, were each name read
    (folder / MANIFEST).write_text(json.dumps(manifest))
    start = time.perf_counter()
    found = read_manifest(folder)
    assert time.perf_counter() - start < 5
    assert found is not None and set(found.ours) == {"big.bin", "./big.bin", "hard.bin"} and not found.foreign


def test_a_failed_meteor_ends_in_one_line_and_the_next_score_does_not_wait_forever(tmp_path: Path) -> None:
    """Under a 4 GiB address space METEOR's Java cannot start here (it reserves more): pycocoevalcap then kept its
    lock, so a second score in the process waited forever. Each run now ends, scored or in one line."""
    root = tmp_path / "scenes"
    make_scenes(root, counts={"train": 0, "val": 0, "test": 2})
    captions = root / "annotations" / "captions_test.json"
    scored = tmp_path / "scored.json"
    scored.write_text(json.dumps([{"image_id": a["image_id"], "caption": a["caption"]}
                                  for a in json.loads(captions.read_text())["annotations"][::5]]))
    args = ["evaluate", str(scored), "--annotations", str(captions), "--out", str(tmp_path / "scores.json")]
    for code, stderr in run_capped([args, args], limit=4 * 2**30, crash_logs=tmp_path):
        assert code == 0 or (code == 2 and stderr.strip().splitlines()[-1].startswith("error: METEOR's Java process "
                                                                                      "failed")), stderr[-2000:]
