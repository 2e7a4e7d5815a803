"""Fashion scenes: COCO files, determinism, captions true of the drawn boxes, and the make-scenes command."""

from __future__ import annotations

import colorsys
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO

from vision_attn.cli import main
from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
from vision_attn.data.scenes import (
    CLASS_WORDS,
    COLOURS,
    PALETTES,
    RELATIONS,
    SceneStyle,
    box_relation,
    make_scenes,
    relation,
)

COUNTS = {"train": 40, "val": 10, "test": 10}
SPLITS = list(COUNTS)


def _load(root: Path, kind: str, split: str) -> dict:
    return json.loads((root / "annotations" / f"{kind}_{split}.json").read_text())


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scenes")
    written = make_scenes(root, counts=COUNTS, seed=0)
    assert {split: counts["images"] for split, counts in written.items()} == COUNTS
    return root


def _objects(root: Path, split: str) -> dict[int, list[dict]]:
    """Per image id: each object's class word, colour, bbox and grid cell, joined from the three files."""
    instances, attributes = _load(root, "instances", split), _load(root, "attributes", split)
    words = {category["id"]: category["name"] for category in instances["categories"]}
    extra = {entry["id"]: entry for entry in attributes["instances"]}
    objects: dict[int, list[dict]] = {}
    for annotation in instances["annotations"]:
        entry, word = extra[annotation["id"]], words[annotation["category_id"]]
        assert entry["image_id"] == annotation["image_id"]
        objects.setdefault(annotation["image_id"], []).append({
            "id": annotation["id"], "image_id": annotation["image_id"], "word": word, "colour": entry["colour"],
            "name": f"{entry['colour']} {word}", "bbox": annotation["bbox"], "cell": tuple(entry["cell"]),
            "source_split": entry["source_split"], "source": entry["source_index"]})
    return objects


def _holds(phrase: str, subject_box: list[float], object_box: list[float]) -> bool:
    """Whether ``phrase`` is true of the two boxes' centres."""
    (sx, sy), (ox, oy) = ((x + w / 2, y + h / 2) for x, y, w, h in (subject_box, object_box))
    return {"to the left of": sx < ox, "to the right of": sx > ox, "above": sy < oy, "below": sy > oy}[phrase]


def test_files_are_coco_captions_and_instances(scenes: Path) -> None:
    for split, count in COUNTS.items():
        captions, instances = _load(scenes, "captions", split), _load(scenes, "instances", split)
        assert len(captions["images"]) == count
        assert all(set(image) == {"id", "file_name", "width", "height"} for image in captions["images"])
        assert all(set(a) == {"id", "image_id", "caption"} for a in captions["annotations"])
        assert all(set(a) == {"id", "image_id", "category_id", "bbox", "area", "iscrowd"}
                   for a in instances["annotations"])
        assert [(c["id"], c["name"]) for c in instances["categories"]] == [
            (label + 1, word) for label, word in enumerate(CLASS_WORDS)]
        assert instances["images"] == captions["images"]
        for image in captions["images"]:
            assert image["file_name"] == f"{image['id']}.png" and isinstance(image["id"], int)
            with Image.open(scenes / "images" / split / image["file_name"]) as png:
                assert (png.format, png.mode, png.size) == ("PNG", "RGB", (96, 96))
                assert (image["width"], image["height"]) == (96, 96)


def test_boxes_are_the_tight_boxes_of_the_tinted_items(scenes: Path) -> None:
    """Every object's bbox holds exactly its pixels > 0, in its colour, and nothing else is drawn."""
    for split in SPLITS:
        for image_id, objects in _objects(scenes, split).items():
            pixels = np.asarray(Image.open(scenes / "images" / split / f"{image_id}.png"))  # (96, 96, 3)
            covered = np.zeros(pixels.shape[:2], dtype=bool)
            for obj in objects:
                x, y, w, h = obj["bbox"]
                assert 0 <= x and 0 <= y and x + w <= 96 and y + h <= 96 and w > 0 and h > 0
                crop = pixels[y : y + h, x : x + w]  # (h, w, 3)
                drawn = crop.any(axis=2)
                assert drawn[0].any() and drawn[-1].any() and drawn[:, 0].any() and drawn[:, -1].any()  # tight
                off_channels = [c for c, value in enumerate(COLOURS[obj["colour"]]) if value == 0]
                assert not crop[..., off_channels].any()  # tinted by its colour only
                covered[y : y + h, x : x + w] = True
            assert not pixels[~covered].any()


def test_sources_are_real_fashion_mnist_items(scenes: Path) -> None:
    """The recorded Fashion-MNIST image, tinted, is what the canvas shows inside the box."""
    train_images, _ = load_fashion_mnist(find_fashion_mnist("data/fashion_mnist"), "train")
    for image_id, objects in list(_objects(scenes, "train").items())[:5]:
        pixels = np.asarray(Image.open(scenes / "images" / "train" / f"{image_id}.png"))
        for obj in objects:
            item = train_images[obj["source"]].numpy()  # (28, 28)
            rows, cols = np.nonzero(item)
            x, y, w, h = obj["bbox"]
            expected = item[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1, None].astype(np.uint16)
            expected = expected * np.array(COLOURS[obj["colour"]], dtype=np.uint16) // 255  # (h, w, 3)
            assert np.array_equal(pixels[y : y + h, x : x + w], expected)


def test_same_seed_same_bytes_other_seed_differs(scenes: Path, tmp_path: Path) -> None:
    make_scenes(tmp_path / "again", counts=COUNTS, seed=0)
    make_scenes(tmp_path / "other", counts=COUNTS, seed=1)
    files = sorted(p.relative_to(scenes) for p in scenes.rglob("*") if p.is_file())
    assert len(files) == sum(COUNTS.values()) + 3 * len(SPLITS) + 1  # and the manifest of what make-scenes wrote
    assert sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*") if p.is_file()) == files
    for relative in files:
        assert (scenes / relative).read_bytes() == (tmp_path / "again" / relative).read_bytes(), relative
    assert (scenes / "images/val/1.png").read_bytes() != (tmp_path / "other/images/val/1.png").read_bytes()
    assert _load(scenes, "captions", "train") != _load(tmp_path / "other", "captions", "train")


def test_five_captions_name_every_object_with_its_colour(scenes: Path) -> None:
    for split in SPLITS:
        objects = _objects(scenes, split)
        by_image: dict[int, list[str]] = {}
        for annotation in _load(scenes, "captions", split)["annotations"]:
            by_image.setdefault(annotation["image_id"], []).append(annotation["caption"])
        assert set(by_image) == set(objects)
        for image_id, captions in by_image.items():
            assert len(captions) == 5 and len(set(captions)) == 5
            for caption in captions:
                assert caption == caption.lower() and not caption.endswith(".")
                for obj in objects[image_id]:
                    assert re.search(rf"\b{obj['name']}\b", caption), (caption, obj["name"])


def test_every_relation_phrase_is_true_of_the_boxes(scenes: Path) -> None:
    """The attributes file records each relation phrase of each caption; every one holds for the bboxes."""
    relation_pattern = re.compile("|".join(RELATIONS))
    checked = 0
    for split in SPLITS:
        objects = {obj["id"]: obj for image in _objects(scenes, split).values() for obj in image}
        records: dict[int, list[dict]] = {}
        for record in _load(scenes, "attributes", split)["relations"]:
            records.setdefault(record["caption_id"], []).append(record)
        for annotation in _load(scenes, "captions", split)["annotations"]:
            caption, recorded = annotation["caption"], records.get(annotation["id"], [])
            assert relation_pattern.findall(caption) == [r["relation"] for r in recorded], caption
            for record in recorded:
                subject, obj = objects[record["subject_id"]], objects[record["object_id"]]
                assert subject["image_id"] == obj["image_id"] == annotation["image_id"] and subject is not obj
                assert re.search(rf"{record['relation']} (a|the) {obj['name']}\b", caption), (caption, record)
                assert _holds(record["relation"], subject["bbox"], obj["bbox"]), (caption, record)
                checked += 1
    assert checked > 100


def test_two_object_relation_captions_parsed_from_text_alone(scenes: Path) -> None:
    """Independent of the record: "a X to the left of a Y" / "the X is above the Y", looked up by name."""
    sentence = re.compile(rf"(?:a|the) (\w+ \w+) (?:is )?({'|'.join(RELATIONS)}) (?:a|the) (\w+ \w+)")
    parsed = 0
    for split in SPLITS:
        objects = _objects(scenes, split)
        for annotation in _load(scenes, "captions", split)["annotations"]:
            match = sentence.fullmatch(annotation["caption"])
            if match:
                names = {obj["name"]: obj for obj in objects[annotation["image_id"]]}
                subject, phrase, obj = names[match[1]], match[2], names[match[3]]
                assert _holds(phrase, subject["bbox"], obj["bbox"]), annotation["caption"]
                parsed += 1
    assert parsed > 20


def test_scene_composition(scenes: Path) -> None:
    """2 and 3 objects both occur, on distinct cells, with distinct classes; every colour and class is used."""
    sizes, colours, words = set(), set(), set()
    for split in SPLITS:
        for objects in _objects(scenes, split).values():
            for obj in objects:
                x, y, w, h = obj["bbox"]
                assert (x // 32, y // 32) == ((x + w - 1) // 32, (y + h - 1) // 32) == obj["cell"][::-1]
            sizes.add(len(objects))
            assert len({obj["word"] for obj in objects}) == len(objects)
            assert len({obj["cell"] for obj in objects}) == len(objects)
            colours |= {obj["colour"] for obj in objects}
            words |= {obj["word"] for obj in objects}
    assert sizes == {2, 3}
    assert colours == set(COLOURS) and words == set(CLASS_WORDS)


def test_val_and_test_draw_disjoint_fashion_mnist_test_images(scenes: Path) -> None:
    sources = {split: {(obj["source_split"], obj["source"]) for objects in _objects(scenes, split).values()
                       for obj in objects} for split in SPLITS}
    assert {name for name, _ in sources["train"]} == {"train"}
    assert {name for name, _ in sources["val"] | sources["test"]} == {"test"}
    assert not sources["val"] & sources["test"]
    assert max(index for _, index in sources["val"]) < 5000 <= min(index for _, index in sources["test"])


def test_pycocotools_reads_the_files(scenes: Path) -> None:
    captions = COCO(str(scenes / "annotations" / "captions_val.json"))
    instances = COCO(str(scenes / "annotations" / "instances_val.json"))
    assert len(captions.getImgIds()) == COUNTS["val"] and len(captions.getAnnIds()) == 5 * COUNTS["val"]
    assert [category["name"] for category in instances.loadCats(instances.getCatIds())] == CLASS_WORDS
    sneaker = instances.getCatIds(catNms=["sneaker"])
    assert instances.loadAnns(instances.getAnnIds(catIds=sneaker)) == [
        a for a in instances.dataset["annotations"] if a["category_id"] == sneaker[0]]
    results = captions.loadRes([{"image_id": image_id, "caption": "a red bag"} for image_id in captions.getImgIds()])
    assert len(results.getAnnIds()) == COUNTS["val"]


def test_relation_of_cells() -> None:
    assert relation((1, 0), (1, 2), prefer_vertical=True) == "to the left of"  # same row: only left/right holds
    assert relation((0, 1), (2, 1), prefer_vertical=False) == "above"  # same column: only above/below holds
    assert relation((2, 2), (0, 0), prefer_vertical=True) == "below"
    assert relation((2, 2), (0, 0), prefer_vertical=False) == "to the right of"
    with pytest.raises(ValueError, match="same cell"):
        relation((1, 1), (1, 1), prefer_vertical=False)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="canvas_size // grid_size must be at least 28"):
        make_scenes(tmp_path, counts={"train": 1}, canvas_size=64, grid_size=3)
    with pytest.raises(ValueError, match="scene split 'dev'"):
        make_scenes(tmp_path, counts={"dev": 1})
    with pytest.raises(ValueError, match="whole number"):
        make_scenes(tmp_path, counts={"train": -1})


def test_make_scenes_command(tmp_path: Path, capsys) -> None:
    main(["make-scenes", "--root", str(tmp_path), "--train", "3", "--val", "2", "--test", "2", "--seed", "5",
          "--canvas-size", "128", "--grid-size", "4"])
    printed = capsys.readouterr().out
    assert "train: 3 images" in printed and "15 captions" in printed and "test: 2 images" in printed
    with Image.open(tmp_path / "images" / "val" / "2.png") as png:
        assert png.size == (128, 128)
    assert _load(tmp_path, "captions", "train")["info"]["seed"] == 5
    with pytest.raises(SystemExit) as exit_info:
        main(["make-scenes", "--root", str(tmp_path), "--canvas-size", "50"])
    assert exit_info.value.code == 2
    assert "error: canvas_size // grid_size" in capsys.readouterr().err


# ------------------------------------------------------------------ styles: free layouts, shades and scales
STYLED = {"layout": "free", "shade_jitter": 1.0, "scale_jitter": 0.25}


@pytest.fixture(scope="module")
def styled_scenes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("styled")
    make_scenes(root, counts={"train": 60, "test": 60}, seed=3, style=STYLED, styles={"test": {"layout": "mixed"}})
    return root


def _named_colour(rgb: np.ndarray) -> str:
    """The named colour nearest to an RGB value, once both are scaled so their largest channel is 1."""
    pattern = rgb / max(1.0, float(rgb.max()))
    return min(COLOURS, key=lambda name: float(np.abs(pattern - np.array(COLOURS[name]) / 255).sum()))


def test_every_relation_is_true_of_the_boxes_in_every_layout(styled_scenes: Path) -> None:
    """Free and mixed layouts: each recorded relation holds of the box centres, and items never overlap."""
    checked, free_scenes = 0, 0
    for split in ("train", "test"):
        objects = _objects_any_layout(styled_scenes, split)
        by_id = {obj["id"]: obj for image in objects.values() for obj in image}
        for record in _load(styled_scenes, "attributes", split)["relations"]:
            subject, obj = by_id[record["subject_id"]], by_id[record["object_id"]]
            assert _holds(record["relation"], subject["bbox"], obj["bbox"]), record
            checked += 1
        for image in objects.values():
            free_scenes += all(obj["cell"] is None for obj in image)
            for i, first in enumerate(image):
                for second in image[:i]:
                    (x1, y1, w1, h1), (x2, y2, w2, h2) = first["bbox"], second["bbox"]
                    assert x1 + w1 <= x2 or x2 + w2 <= x1 or y1 + h1 <= y2 or y2 + h2 <= y1  # boxes apart
    assert checked > 200
    assert 60 < free_scenes < 120  # all 60 train scenes are free, and some but not all of the mixed test ones


def test_free_layouts_use_the_whole_canvas(styled_scenes: Path) -> None:
    """Items are not held to the 3×3 cells (on the grid no box crosses a cell's edge), and sizes vary."""
    crossing, sides = 0, set()
    for image in _objects_any_layout(styled_scenes, "train").values():
        for obj in image:
            x, y, w, h = obj["bbox"]
            crossing += x // 32 != (x + w - 1) // 32 or y // 32 != (y + h - 1) // 32
            sides.add(max(w, h))
    assert crossing > 50 and max(sides) - min(sides) >= 10


def test_a_shade_jittered_item_still_carries_its_colour_word(styled_scenes: Path) -> None:
    """Tints are other shades, not the pure RGB values, yet each item's pixels are nearest its named colour, and
    every caption names it with that colour."""
    tints = set()
    for image_id, image in _objects_any_layout(styled_scenes, "train").items():
        pixels = np.asarray(Image.open(styled_scenes / "images" / "train" / f"{image_id}.png")).astype(np.float64)
        for obj in image:
            x, y, w, h = obj["bbox"]
            crop = pixels[y : y + h, x : x + w].reshape(-1, 3)
            bright = crop[crop.max(axis=1) >= np.quantile(crop.max(axis=1), 0.75)]  # the item's lit pixels
            assert _named_colour(bright.mean(axis=0)) == obj["colour"], obj
            tints.add(tuple(obj["rgb"]))
    assert len(tints) > 100 and not tints & {tuple(rgb) for rgb in COLOURS.values()}
    captions: dict[int, list[str]] = {}
    for annotation in _load(styled_scenes, "captions", "train")["annotations"]:
        captions.setdefault(annotation["image_id"], []).append(annotation["caption"])
    for image_id, image in _objects_any_layout(styled_scenes, "train").items():
        for caption in captions[image_id]:
            for obj in image:
                assert re.search(rf"\b{obj['colour']} {obj['word']}\b", caption), (caption, obj)


def _colour_by_hue(rgb: np.ndarray) -> str:
    """What a person calls an RGB tint (0..255): white when it is a bright grey, else by its hue's nearest name."""
    hue, saturation, value = colorsys.rgb_to_hsv(*(np.asarray(rgb, dtype=np.float64) / 255))
    if saturation < 0.2:
        return "white" if value > 0.7 else "grey"
    names = {"red": 0, "yellow": 60, "green": 120, "blue": 240}
    return min(names, key=lambda name: min(abs(hue * 360 - names[name]), 360 - abs(hue * 360 - names[name])))


def test_hue_jitter_draws_each_colour_family_and_its_items_keep_their_colour_word(tmp_path: Path) -> None:
    """hue_jitter: tints range over each named colour's family (other hues, paler and darker), each still called by
    its name, and the items drawn with them carry that colour in their pixels and captions; at 0 the exact tints."""
    rng = np.random.default_rng(0)
    for name in COLOURS:
        tints = SceneStyle(hue_jitter=1.0).tints(rng, [name] * 400).astype(np.float64)
        assert {_colour_by_hue(tint) for tint in tints} == {name}, name
        hsv = np.array([colorsys.rgb_to_hsv(*(tint / 255)) for tint in tints])
        if name != "white":  # a family, not one value: the hue spreads, paler and darker shades come too
            assert np.ptp((hsv[:, 0] + 0.5) % 1) > 0.04 and hsv[:, 1].min() < 0.6 and hsv[:, 2].min() < 0.8
        assert SceneStyle(hue_jitter=0.0).tints(rng, [name]).tolist() == [list(COLOURS[name])]
    make_scenes(tmp_path, counts={"train": 40}, seed=1, style={"layout": "mixed", "hue_jitter": 1.0})
    captions: dict[int, list[str]] = {}
    for annotation in _load(tmp_path, "captions", "train")["annotations"]:
        captions.setdefault(annotation["image_id"], []).append(annotation["caption"])
    for image_id, image in _objects_any_layout(tmp_path, "train").items():
        pixels = np.asarray(Image.open(tmp_path / "images" / "train" / f"{image_id}.png")).astype(np.float64)
        for obj in image:
            x, y, w, h = obj["bbox"]
            crop = pixels[y : y + h, x : x + w].reshape(-1, 3)
            brightest = crop[crop.max(axis=1) >= np.quantile(crop.max(axis=1), 0.9)].mean(axis=0)
            lit = brightest / brightest.max() * max(obj["rgb"])  # the item's grey scales the tint: undo it
            assert _colour_by_hue(lit) == obj["colour"], obj
            assert all(re.search(rf"\b{obj['colour']} {obj['word']}\b", caption) for caption in captions[image_id])
    with pytest.raises(ValueError, match="shade_jitter or hue_jitter, not both"):
        make_scenes(tmp_path / "both", counts={"train": 1}, style={"shade_jitter": 1, "hue_jitter": 1})
    with pytest.raises(ValueError, match="takes none"):
        make_scenes(tmp_path / "both", counts={"train": 1}, style={"palette": "css", "hue_jitter": 1})
    with pytest.raises(ValueError, match="palette must be one of"):
        make_scenes(tmp_path / "both", counts={"train": 1}, style={"palette": "rainbow"})
    with pytest.raises(ValueError, match="hue_jitter must be between 0 and 1"):
        make_scenes(tmp_path / "far", counts={"train": 1}, style={"hue_jitter": 1.5})


def test_a_palette_tints_each_item_with_its_makers_rgb_for_the_colour_word(tmp_path: Path, capsys) -> None:
    """--palette tab10: the same scenes (layout, items, captions) as the exact colours, each item tinted with
    matplotlib's RGB for its colour word, which the attributes record."""
    for palette in ("exact", "tab10"):
        main(["make-scenes", "--root", str(tmp_path / palette), "--train", "0", "--val", "0", "--test", "5",
              "--palette", palette])
    exact, tab10 = (_load(tmp_path / name, "attributes", "test")["instances"] for name in ("exact", "tab10"))
    assert [a["colour"] for a in exact] == [a["colour"] for a in tab10]
    assert all(tuple(a["rgb"]) == PALETTES["tab10"][a["colour"]] for a in tab10)
    assert any(tuple(a["rgb"]) != COLOURS[a["colour"]] for a in tab10)
    assert _load(tmp_path / "exact", "captions", "test")["annotations"] == \
        _load(tmp_path / "tab10", "captions", "test")["annotations"]
    with Image.open(tmp_path / "tab10" / "images" / "test" / "1.png") as tinted, \
            Image.open(tmp_path / "exact" / "images" / "test" / "1.png") as pure:
        assert tinted.size == pure.size and np.asarray(tinted).tolist() != np.asarray(pure).tolist()


def test_styles_are_recorded_and_refused_when_out_of_range(styled_scenes: Path, tmp_path: Path) -> None:
    recorded = _load(styled_scenes, "captions", "train")["info"]["style"]
    assert recorded == {**STYLED, "hue_jitter": 0.0, "palette": "exact"}
    assert _load(styled_scenes, "captions", "test")["info"]["style"]["layout"] == "mixed"
    with pytest.raises(ValueError, match="scene layout must be one of"):
        make_scenes(tmp_path, counts={"train": 1}, style={"layout": "random"})
    with pytest.raises(ValueError, match="shade_jitter must be between 0 and 1"):
        make_scenes(tmp_path, counts={"train": 1}, style={"shade_jitter": 2})
    with pytest.raises(ValueError, match="canvas_size // grid_size must be at least 35"):
        make_scenes(tmp_path, counts={"train": 1}, style={"scale_jitter": 0.25})  # a 35-pixel item in a 32 cell
    with pytest.raises(ValueError, match="unknown scene style option"):
        make_scenes(tmp_path, counts={"train": 1}, style={"colour_jitter": 1})
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_box_relation() -> None:
    assert box_relation([0, 0, 10, 10], [40, 5, 10, 10], prefer_vertical=True) == "to the left of"  # dy too small
    assert box_relation([0, 0, 10, 10], [30, 30, 10, 10], prefer_vertical=True) == "above"
    assert box_relation([0, 0, 10, 10], [30, 30, 10, 10], prefer_vertical=False) == "to the left of"
    assert box_relation([30, 60, 10, 10], [30, 0, 10, 10], prefer_vertical=False) == "below"


def _objects_any_layout(root: Path, split: str) -> dict[int, list[dict]]:
    """``_objects``, with the grid cell None for items placed freely."""
    instances, attributes = _load(root, "instances", split), _load(root, "attributes", split)
    words = {category["id"]: category["name"] for category in instances["categories"]}
    extra = {entry["id"]: entry for entry in attributes["instances"]}
    objects: dict[int, list[dict]] = {}
    for annotation in instances["annotations"]:
        entry = extra[annotation["id"]]
        objects.setdefault(annotation["image_id"], []).append({
            "id": annotation["id"], "word": words[annotation["category_id"]], "colour": entry["colour"],
            "rgb": entry["rgb"], "bbox": annotation["bbox"], "cell": entry["cell"] and tuple(entry["cell"])})
    return objects


# ------------------------------------------------------------- single items: the encoder's pretraining set
def test_scene_items_are_drawn_as_scenes_draw_them() -> None:
    """Each item is a real Fashion-MNIST item, tinted in a shade of its named colour, at a size in the style's
    range, inside the canvas; its targets are [label, colour]. Evaluation items are drawn the same way every
    time; training items anew each time."""
    import torch

    from vision_attn.data.classification_datasets import TensorImageDataset
    from vision_attn.data.scene_items import SceneItemDataset

    images, labels = load_fashion_mnist(find_fashion_mnist("data", download=False), "test")
    source = TensorImageDataset(images[:200, None], labels[:200])
    style = SceneStyle(shade_jitter=1.0, scale_jitter=0.1)
    fixed = SceneItemDataset(source, style=style, canvas_size=32, seed=5)
    again = SceneItemDataset(source, style=style, canvas_size=32, seed=5)  # its own draws, not fixed's kept ones
    colours, sizes, places = set(), set(), set()
    for index in range(200):
        image, (label, colour) = fixed[index]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and int(label) == int(labels[index])
        lit = image.permute(1, 2, 0).numpy().astype(np.float64)
        mask = lit.max(axis=2) > 0
        rows, cols = np.nonzero(mask)
        height, width = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert max(height, width) <= 31  # 28 ± 10%: at most 31 pixels
        crop = lit[mask]
        bright = crop[crop.max(axis=1) >= np.quantile(crop.max(axis=1), 0.75)]
        assert _named_colour(bright.mean(axis=0)) == list(COLOURS)[int(colour)]
        colours.add(int(colour))
        sizes.add(int(max(height, width)))
        places.add((int(rows.min()), int(cols.min())))
        assert torch.equal(again[index][0], image) and torch.equal(again[index][1], fixed[index][1])  # drawn
        assert torch.equal(fixed[index][0], image)  # the same way every time, and kept as drawn
    assert colours == set(range(len(COLOURS))) and len(sizes) >= 4 and len(places) > 30
    fresh = SceneItemDataset(source, style=style, canvas_size=32)
    assert sum(not torch.equal(fresh[i][0], fresh[i][0]) for i in range(20)) >= 18  # training: anew each time
    with pytest.raises(ValueError, match="canvas_size 28 is smaller than the largest item"):
        SceneItemDataset(source, style=SceneStyle(scale_jitter=0.2), canvas_size=28)
    with pytest.raises(ValueError, match="shade_jitter must be between 0 and 1"):
        SceneItemDataset(source, style=SceneStyle(shade_jitter=1.5))


def test_a_batch_of_items_is_gathered_pasted_and_tinted_as_item_by_item() -> None:
    """The batched drawing's three pieces against the plain way: ``gather`` (one indexing of held tensors, for
    a ``TensorImageDataset`` or a ``Subset`` of one) gives what reading item by item gives, and any other dataset
    is read item by item; ``paste`` writes each item where a slice assignment would, in every channel, leaving
    the rest of each canvas as it was; ``divide_by_255`` is floor division for every product of two bytes."""
    import torch
    from torch.utils.data import Subset

    from vision_attn.data.classification_datasets import TensorImageDataset
    from vision_attn.data.scene_items import divide_by_255, gather, paste

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 10, (40,), generator=generator)
    held = TensorImageDataset(images, labels)
    subset = Subset(held, [39 - i for i in range(40)])
    indices = [5, 0, 17, 17, 33]
    for source in (held, subset, [held[i] for i in range(40)]):  # the last: a plain list, read item by item
        batch, batch_labels = gather(source, indices)
        assert torch.equal(batch, torch.stack([source[i][0] for i in indices]))
        assert torch.equal(batch_labels, torch.stack([source[i][1] for i in indices]))
        assert batch_labels.dtype == torch.long

    rng = np.random.default_rng(1)
    for size, square, channels in ((25, 32, 3), (31, 32, 3), (5, 9, 1)):
        canvases = torch.randint(0, 256, (6, channels, square, square), dtype=torch.uint8, generator=generator)
        expected = canvases.clone()
        rows = np.array([4, 0, 2])
        corners = rng.integers(0, square - size + 1, size=(3, 2))
        items = torch.randint(0, 256, (3, channels, size, size), dtype=torch.uint8, generator=generator)
        for row, (top, left), item in zip(rows.tolist(), corners.tolist(), items, strict=True):
            expected[row, :, top : top + size, left : left + size] = item
        paste(canvases, rows, corners, items)
        assert torch.equal(canvases, expected), (size, square, channels)

    products = torch.arange(255 * 255 + 1, dtype=torch.int32)
    assert torch.equal(divide_by_255(products), products // 255)


def test_training_items_drawn_a_batch_at_a_time_are_drawn_as_one_at_a_time() -> None:
    """``__getitems__`` (what a DataLoader with a batch size calls): the same real item and label, tinted in a
    shade of its named colour, at a size in range, inside the canvas; its antialiased resize agrees with PIL's
    within a grey level; and ``tints`` for one item draws exactly what ``tint`` draws."""
    import torch
    import torch.nn.functional as F

    from vision_attn.data.classification_datasets import TensorImageDataset
    from vision_attn.data.scene_items import SceneItemDataset
    from vision_attn.data.scenes import SceneStyle, draw_item

    images, labels = load_fashion_mnist(find_fashion_mnist("data", download=False), "test")
    source = TensorImageDataset(images[:300, None], labels[:300])
    style = SceneStyle(shade_jitter=1.0, scale_jitter=0.1)
    torch.manual_seed(0)
    batch = SceneItemDataset(source, style=style, canvas_size=32).__getitems__(list(range(300)))
    sizes = set()
    for index, (image, (label, colour)) in enumerate(batch):
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and int(label) == int(labels[index])
        lit = image.permute(1, 2, 0).numpy().astype(np.float64)
        rows, cols = np.nonzero(lit.max(axis=2) > 0)
        sizes.add(int(max(rows.max() - rows.min(), cols.max() - cols.min())) + 1)
        crop = lit[lit.max(axis=2) > 0]
        bright = crop[crop.max(axis=1) >= np.quantile(crop.max(axis=1), 0.75)]
        assert _named_colour(bright.mean(axis=0)) == list(COLOURS)[int(colour)]
        # the grey item under the tint is the source item, resized: a channel at full tint shows it
        assert image.max() > 0 and max(rows.max() - rows.min(), cols.max() - cols.min()) + 1 <= 31
    assert len(sizes) >= 4
    for size in (25, 27, 31):  # torch's antialiased bilinear resize against PIL's, on 100 real items
        ours = F.interpolate(images[:100, None].float(), size=(size, size), mode="bilinear", align_corners=False,
                             antialias=True).round().clamp(0, 255).to(torch.uint8)[:, 0].numpy().astype(int)
        white = np.array([255, 255, 255], dtype=np.uint16)
        pil = np.stack([draw_item(item.numpy(), white, size)[..., 0] for item in images[:100]]).astype(int)
        assert np.abs(ours - pil).max() <= 1
    for seed in range(5):
        one = style.tint(np.random.default_rng(seed), "blue")
        assert np.array_equal(one, style.tints(np.random.default_rng(seed), ["blue"])[0])
    fixed = SceneItemDataset(source, style=style, canvas_size=32, seed=5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(fixed.__getitems__([3, 7]), (fixed[3], fixed[7]), strict=True))
