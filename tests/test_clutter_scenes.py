"""Cluttered Fashion scenes: every background kind (both texture sources), 1 to 5 objects, small items and
overlap, each drawn for a few tiny scenes and checked against its own files: boxes, visible masks, the saved
background, captions and relations; the default scenes are pixel for pixel what they were; textures come from the
installed packages only; bad style values are one line; the ViT's canvas draws the same backgrounds."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as coco_mask

from tests.conftest import run_in_process
from tests.test_output_folders import manifest_files, one_line_error
from tests.test_vit_canvas import assert_test_canvases_are_black_round_their_items, training_canvases
from vision_attn.data import backgrounds
from vision_attn.data.backgrounds import (
    TEXTURE_SOURCES,
    Background,
    BackgroundPool,
    fill_canvases,
    read_texture,
    texture_files,
)
from vision_attn.data.scene_style import SceneStyle
from vision_attn.data.scenes import _Captioner, box_relation, make_scenes
from vision_attn.datamodules.data_options import Canvas

COUNTS = {"train": 3, "test": 4}
MODES = {  # name -> style
    "noise": {"background": "noise", "background_level": 1.0},
    "texture-skimage": {"background": "texture", "background_level": 1.0},
    "texture-matplotlib": {"background": "texture", "texture_source": "matplotlib", "background_level": 1.0},
    "distractors": {"background": "distractors", "background_level": 1.0},
    "mixed": {"background": "mixed", "background_weights": [1, 1, 1, 1], "layout": "mixed"},
    "one-object": {"objects": [1, 1]},
    "five-objects": {"objects": [5, 5], "layout": "free", "background": "noise"},
    "five-on-the-grid": {"objects": [4, 5], "background": "distractors"},
    "small": {"scale": [0.36, 0.6], "layout": "free", "objects": [1, 5], "background": "texture"},
    "overlap": {"overlap": 0.5, "layout": "free", "objects": [3, 5], "background": "texture", "background_level": 1},
    "overlap-on-black": {"overlap": 0.5, "layout": "free", "objects": [4, 5], "scale": [0.8, 1.2]},
}


def _load(root: Path, kind: str, split: str) -> dict:
    return json.loads((root / "annotations" / f"{kind}_{split}.json").read_text())


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> dict[str, Path]:
    """Each mode's scenes, a few per split on 96-pixel canvases."""
    roots = {}
    for name, style in MODES.items():
        roots[name] = tmp_path_factory.mktemp(name)
        make_scenes(roots[name], counts=COUNTS, seed=1, style=style)
    return roots


def _holds(phrase: str, subject: list[float], obj: list[float]) -> bool:
    (sx, sy), (ox, oy) = ((x + w / 2, y + h / 2) for x, y, w, h in (subject, obj))
    return {"to the left of": sx < ox, "to the right of": sx > ox, "above": sy < oy, "below": sy > oy}[phrase]


def _scenes(root: Path, split: str):
    """Per image: the image, its saved background (None when black), and its objects in painting order."""
    captions, instances = _load(root, "captions", split), _load(root, "instances", split)
    attributes = {entry["id"]: entry for entry in _load(root, "attributes", split)["instances"]}
    words = {category["id"]: category["name"] for category in instances["categories"]}
    for image in captions["images"]:
        pixels = np.asarray(Image.open(root / "images" / split / image["file_name"]))
        saved = root / "backgrounds" / split / image["file_name"]
        under = np.asarray(Image.open(saved)) if saved.is_file() else None
        objects = sorted((a for a in instances["annotations"] if a["image_id"] == image["id"]), key=lambda a: a["id"])
        for obj in objects:
            obj["name"] = f"{attributes[obj['id']]['colour']} {words[obj['category_id']]}"
        texts = [a["caption"] for a in captions["annotations"] if a["image_id"] == image["id"]]
        yield pixels, under, objects, texts


def _masks(pixels: np.ndarray, under: np.ndarray | None, objects: list[dict]) -> list[np.ndarray]:
    """Each object's visible pixels: its RLE when the file has one, else (black, apart) the non-zero pixels in its
    box."""
    masks = []
    for obj in objects:
        if "segmentation" in obj:
            masks.append(coco_mask.decode(obj["segmentation"]).astype(bool))
        else:
            x, y, w, h = obj["bbox"]
            inside = np.zeros(pixels.shape[:2], dtype=bool)
            inside[y : y + h, x : x + w] = True
            masks.append(pixels.any(axis=2) & inside)
    return masks


@pytest.mark.parametrize("mode", list(MODES))
def test_boxes_masks_backgrounds_and_captions_are_true(mode: str, drawn: dict[str, Path]) -> None:
    """Per scene: the visible masks are exactly where the image differs from its background (outlines aside),
    disjoint, within the item boxes, which each mask (or what hides it) reaches on all four sides; the background
    file holds no object pixel; every object is named with its colour and every stated relation holds."""
    root, style = drawn[mode], SceneStyle.of(MODES[mode])
    low, high = style.objects
    counts, kinds, occluded = set(), set(), 0
    for split in COUNTS:
        info = _load(root, "captions", split)["info"]
        assert info.get("backgrounds", False) == (style.background != "black")
        assert SceneStyle.of(info["style"]) == style
        by_id = {}
        for pixels, under, objects, texts in _scenes(root, split):
            counts.add(len(objects))
            kinds.add(under is not None)
            if style.background == "black":
                assert under is None
            differs = (pixels != (under if under is not None else 0)).any(axis=2)
            masks = _masks(pixels, under, objects)
            union = np.zeros_like(differs)
            for k, (obj, mask) in enumerate(zip(objects, masks, strict=True)):
                by_id[obj["id"]] = obj
                assert mask.any() and not (mask & union).any() and obj["area"] == int(mask.sum())
                assert not (mask & ~differs).any()  # an object pixel is never the background's
                x, y, w, h = obj["bbox"]
                rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
                assert x <= cols[0] and cols[-1] < x + w and y <= rows[0] and rows[-1] < y + h
                later = np.any([masks[j] for j in range(k + 1, len(masks))] + [np.zeros_like(mask)], axis=0)
                covered = mask | later | (differs & ~np.any(masks, axis=0)) | (pixels == 0).all(axis=2)
                if not style.overlap:
                    covered = mask
                box = covered[y : y + h, x : x + w]
                assert box[0].any() and box[-1].any() and box[:, 0].any() and box[:, -1].any(), obj
                occluded += bool(style.overlap) and (later[y : y + h, x : x + w] & ~mask[y : y + h, x : x + w]).any()
                union |= mask
            leftover = differs & ~union  # only later items' black outlines over earlier ones
            assert not leftover.any() or (style.overlap and (pixels[leftover] == 0).all())
            if under is not None:
                assert (pixels[~differs] == under[~differs]).all()
            for text in texts:
                for obj in objects:
                    assert re.search(rf"\b(a|the|single) {obj['name']}\b", text), (text, obj["name"])
                assert len(text.split()) <= 31
        for record in _load(root, "attributes", split)["relations"]:
            subject, obj = by_id[record["subject_id"]], by_id[record["object_id"]]
            assert _holds(record["relation"], subject["bbox"], obj["bbox"]), record
    assert counts <= set(range(low, high + 1)) and (low == high or len(counts) > 1)
    if style.background == "mixed":
        assert kinds == {True, False}  # some scenes drew black, others not
    if style.overlap:
        assert occluded > 0
    if style.scale != (1.0, 1.0):
        sides = [max(o["bbox"][2:]) for split in COUNTS for _, _, objs, _ in _scenes(root, split) for o in objs]
        assert max(sides) <= round(28 * style.scale[1])
    listed = manifest_files(root)
    assert all(f"backgrounds/{split}/{path.name}" in listed for split in COUNTS
               for path in (root / "backgrounds" / split).glob("*.png"))


def test_the_default_scenes_are_pixel_for_pixel_what_they_were(tmp_path: Path) -> None:
    """The default style, and an earlier one, hash to what the generator wrote before backgrounds, object counts,
    scale ranges and overlap existed (JSON bytes and decoded PNG pixels, so a new zlib does not matter)."""
    def digest(root: Path) -> str:
        found = hashlib.sha256()
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.name != ".vision-attn-manifest.json":
                found.update(path.relative_to(root).as_posix().encode())
                found.update(np.asarray(Image.open(path)).tobytes() if path.suffix == ".png" else path.read_bytes())
        return found.hexdigest()

    pinned = {None: "0eeb0ee1dc6acae4eae9438fd890cc87cc385232177ef3e21ae4fb45208c31ee",
              "mixed": "4c746f2b3cabffa9cbe83aa16105806b3a92492e396fdada523915f4b14ba4eb"}
    for key, style in ((None, None), ("mixed", {"layout": "mixed", "shade_jitter": 1.0, "scale_jitter": 0.1})):
        make_scenes(tmp_path / str(key), counts={"train": 4, "val": 2, "test": 4}, seed=7, style=style)
        assert digest(tmp_path / str(key)) == pinned[key], key
        assert not (tmp_path / str(key) / "backgrounds").exists()


def test_textures_are_read_from_the_installed_packages_without_the_network(tmp_path: Path, monkeypatch) -> None:
    """With every socket connection refused, both sources draw: their files lie in the packages' own folders,
    and scikit-image itself is never imported (``skimage.data`` would download some of its images)."""
    def refuse(*args, **kwargs):
        raise OSError("the network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    imported_before = "skimage" in sys.modules
    read_texture.cache_clear()
    for source, (package, folder, names) in TEXTURE_SOURCES.items():
        files = texture_files(source)
        assert [path.name for path in files] == list(names)
        assert all(path.parent.as_posix().endswith(f"{package}/{folder}") and path.is_file() for path in files)
        make_scenes(tmp_path / source, counts={"test": 3}, seed=2,
                    style={"background": "texture", "texture_source": source, "background_level": 1.0})
        assert len(list((tmp_path / source / "backgrounds" / "test").glob("*.png"))) == 3
    assert read_texture.cache_info().currsize > 0
    assert imported_before or "skimage" not in sys.modules


def test_a_missing_texture_package_is_one_line(monkeypatch) -> None:
    monkeypatch.setitem(TEXTURE_SOURCES, "skimage", ("no_such_package_here", "data", ("a.png",)))
    with pytest.raises(FileNotFoundError, match=r"^texture_source 'skimage' reads the images shipped with "):
        Background("texture").check()


@pytest.mark.parametrize(("arguments", "expected"), [
    (["--objects", "0", "3"], "--objects"),
    (["--objects", "3", "2"], "objects must be [min, max]"),
    (["--objects", "2", "6"], "at most 5"),
    (["--scale", "0.2", "1"], "scale must be [min, max]"),
    (["--scale", "1", "2.5"], "--scale"),
    (["--scale-jitter", "0.1", "--scale", "0.5", "1"], "scale_jitter or scale"),
    (["--overlap", "0.3"], "overlap needs layout free or mixed"),
    (["--overlap", "0.6", "--layout", "free"], "--overlap"),
    (["--background", "fog"], "--background"),
    (["--background", "noise", "--background-level", "1.5"], "--background-level"),
    (["--background", "noise", "--background-weights", "1", "1", "1", "1"], "background_weights are the odds"),
    (["--background", "mixed", "--background-weights", "0", "0", "0", "0"], "positive sum"),
    (["--texture-source", "web"], "--texture-source"),
    (["--objects", "5", "5", "--grid-size", "2", "--canvas-size", "64"], "cannot hold 5 objects"),
    (["--objects", "5", "5", "--layout", "free", "--canvas-size", "64", "--grid-size", "2"],
     "needs canvas_size of at least"),
])
def test_bad_clutter_options_are_one_line_before_any_work(arguments: list[str], expected: str,
                                                          tmp_path: Path) -> None:
    result = run_in_process("make-scenes", "--root", str(tmp_path / "out"), "--train", "1", "--val", "0",
                            "--test", "0", *arguments)
    one_line_error(result, expected)
    assert not (tmp_path / "out").exists()


def test_style_mappings_are_checked_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^unknown scene style option\(s\) \['clutter'\]: use layout, "):
        SceneStyle.of({"clutter": 1})
    for style, message in (({"background": "fog"}, "background must be one of"),
                           ({"objects": [1, 2, 3]}, "objects must be two numbers"),
                           ({"objects": [1.5, 2]}, "objects must be [min, max] whole numbers"),
                           ({"background_level": float("nan")}, "background_level must be a number from 0 to 1")):
        with pytest.raises(ValueError, match=f"^{message}".replace("[", r"\[").replace("]", r"\]")):
            SceneStyle.of(style).check(96, 3)


def test_pretraining_items_are_pasted_over_the_styles_background_with_their_own_pixels_as_alpha() -> None:
    """The encoder's pretraining items (training batches and fixed validation items) lie over a background of the
    style, drawn per item; every pixel the tinted item covers is the item's, and black styles are untouched."""
    import torch

    from vision_attn.data.classification_datasets import TensorImageDataset
    from vision_attn.data.scene_items import SceneItemDataset

    greys = torch.zeros(16, 1, 28, 28, dtype=torch.uint8)
    greys[:, :, 6:22, 8:20] = 200  # a 16x12 block: where the item is, whatever its scale
    source = TensorImageDataset(greys, torch.arange(16) % 10)
    def drawn_pairs(style: SceneStyle) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(styled, black) images of the same draws: the fixed items, then a training batch from one seed."""
        fixed = SceneItemDataset(source, style=style, canvas_size=32, seed=1)
        black = SceneItemDataset(source, style=SceneStyle(), canvas_size=32, seed=1)
        pairs = [(fixed[i][0], black[i][0]) for i in range(16)]
        for batch_style in (style, SceneStyle()):
            torch.manual_seed(0)
            pairs.append(SceneItemDataset(source, style=batch_style, canvas_size=32).__getitems__(list(range(16))))
        return pairs[:16] + [(a[0], b[0]) for a, b in zip(pairs[16], pairs[17], strict=True)]

    for background in ("noise", "texture", "distractors"):
        pairs = drawn_pairs(SceneStyle(background=background, background_level=1.0))
        lit = 0  # items with something drawn round them (a dim level or a dark photo may draw next to nothing)
        for drawn, plain in pairs:
            item = plain.amax(dim=0) > 0  # the same draws place the same item; only the background differs
            assert torch.equal(drawn[:, item], plain[:, item])
            lit += bool(drawn[:, ~item].float().mean() > 2)
        assert lit >= 24, background


def test_captions_of_one_four_and_five_objects_read_well_and_state_true_relations() -> None:
    """The extra forms: one object has no relation; four and five name all, relating the first three."""
    boxes = [[0, 0, 10, 10], [40, 0, 10, 10], [0, 40, 10, 10], [40, 40, 10, 10], [80, 80, 10, 10]]
    names = ["red top", "blue bag", "green coat", "white boot", "yellow dress"]

    def captioner(count: int) -> _Captioner:
        return _Captioner(names[:count], lambda s, o, v: box_relation(boxes[s], boxes[o], prefer_vertical=v),
                          list(range(1, count + 1)))

    one = [text for text, stated in captioner(1).captions([[0, 1, 2]] * 5, [(False, False)] * 5) if not stated]
    assert one == ["a red top", "there is a red top", "a single red top", "a red top on its own", "just a red top"]
    five = captioner(5).captions([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [1, 0, 3, 2, 4], [2, 4, 0, 1, 3],
                                  [3, 1, 0, 4, 2]], [(False, True)] * 5)
    assert five[1] == ("there is a yellow dress, a white boot, a green coat, a blue bag and a red top", [])
    assert five[3][0] == "a green coat next to a yellow dress, a red top, a blue bag and a white boot"
    assert five[0][0] == ("a red top to the left of a blue bag and a green coat below the blue bag, with a white "
                          "boot and a yellow dress")
    for text, stated in five:
        assert all(name in text for name in names) and len(text.split()) <= 31
        for subject, phrase, obj in stated:
            assert _holds(phrase, boxes[subject - 1], boxes[obj - 1])
    four = captioner(4).captions([[0, 1, 2, 3]] * 5, [(True, True)] * 5)
    assert all(all(name in text for name in names[:4]) for text, _ in four)


def test_the_vit_canvas_draws_the_same_backgrounds_round_its_items() -> None:
    """``fill_canvases``: the items' pixels untouched, the rest drawn from the background (grey, one channel);
    black without noise is the canvases as they were; background_noise draws what it always drew."""
    from vision_attn.data import fashion_mnist

    torch.manual_seed(0)
    items = (torch.rand(16, 1, 28, 28) * 255).to(torch.uint8) * (torch.rand(16, 1, 28, 28) < 0.4)
    canvases = fashion_mnist.place_on_canvas(items, fashion_mnist.random_places(16, 56), 56)
    assert fill_canvases(canvases, items, noise=0, background=Background()) is canvases
    for kind in ("noise", "texture", "distractors", "mixed"):
        filled = fill_canvases(canvases, items, noise=0, background=Background(kind, level=1.0))
        assert filled.shape == canvases.shape and filled.dtype == torch.uint8
        assert torch.equal(filled[canvases > 0], canvases[canvases > 0])
        assert int((filled != canvases).sum()) > 0, kind
    torch.manual_seed(1)
    noisy = fill_canvases(canvases, items, noise=64, background=Background())
    torch.manual_seed(1)
    levels = torch.randint(0, 65, (16, 1, 1, 1))
    grey = (torch.rand(canvases.shape) * (levels + 1)).to(torch.uint8)
    assert torch.equal(noisy, torch.where(canvases == 0, grey, canvases))


def _symmetries(image: torch.Tensor) -> list[torch.Tensor]:
    """The eight turns and mirrors of a (C, S, S) image."""
    turns = [torch.rot90(image, k, dims=(1, 2)) for k in range(4)]
    return turns + [turn.flip(2) for turn in turns]


def test_a_background_pool_draws_one_new_background_per_reuse_items_and_turns_the_ones_it_gives() -> None:
    """``BackgroundPool``: filled at its first batch; then each batch of 64 at reuse 8 replaces 8 of its
    backgrounds, and every background it gives is one of the pool's, turned or mirrored; the items' pixels stay
    as they were, and the same torch seed draws the same canvases."""
    torch.manual_seed(0)
    items = (torch.rand(64, 3, 28, 28) * 255).to(torch.uint8) * (torch.rand(64, 1, 28, 28) < 0.4)
    background = Background("mixed", level=1.0, weights=(0.0, 1.0, 1.0, 1.0))
    pool = BackgroundPool(background, reuse=8, capacity=256)
    rng = np.random.default_rng(0)
    first = pool.draw(rng, items, 32)
    assert first.shape == (64, 3, 32, 32) and first.dtype == torch.uint8 and pool.pool.shape == (256, 3, 32, 32)
    before = pool.pool.clone()
    given = pool.draw(rng, items, 32)
    replaced = (pool.pool != before).flatten(1).any(dim=1)
    assert 0 < int(replaced.sum()) <= 8  # ⌈64 / 8⌉ new ones (a drawn one may equal the old: never all of them)
    kept = {bytes(image.contiguous().numpy()) for image in pool.pool}
    assert all(any(bytes(turned.contiguous().numpy()) in kept for turned in _symmetries(image)) for image in given)
    assert len({bytes(image.numpy()) for image in given}) > 32  # not one background for the batch

    canvases = torch.zeros(64, 3, 32, 32, dtype=torch.uint8)
    canvases[:, :, 2:30, 2:30] = items
    filled = []
    for _ in range(2):
        torch.manual_seed(3)
        pooled = BackgroundPool(background, reuse=8, capacity=256)
        filled.append([fill_canvases(canvases, items, noise=0, background=background, pool=pooled) for _ in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*filled, strict=True))  # seeded: the same draws
    inside = canvases != 0
    assert all(torch.equal(canvas[inside], canvases[inside]) for canvas in filled[0])
    for reuse in (0, 1.5, True, "8"):
        with pytest.raises(ValueError, match="^background_reuse must be a whole number of 1 or more"):
            BackgroundPool(background, reuse=reuse)  # type: ignore[arg-type]


def test_scene_items_reuse_backgrounds_for_training_items_only(tmp_path: Path) -> None:
    """``background_reuse``: the training items' backgrounds come from a pool, the fixed validation and test items
    draw their own; a bad value is refused in one line before any data is read."""
    from vision_attn.datamodules import FashionSceneItemsDataModule

    style = {"background": "mixed", "background_weights": [1, 1, 1, 1], "hue_jitter": 1.0}
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="^background_reuse must be a whole number of 1 or more"):
            FashionSceneItemsDataModule(str(tmp_path), style=style, background_reuse=bad)
    data = FashionSceneItemsDataModule(style=style, background_reuse=8)
    data.setup("fit")
    assert data.train_set.pool is not None and data.train_set.pool.reuse == 8
    assert data.val_set.pool is None
    torch.manual_seed(0)
    canvases = torch.stack([image for image, _ in data.train_set.__getitems__(list(range(64)))])
    assert canvases.shape == (64, 3, 32, 32) and int((canvases.flatten(1).amax(1) > 0).sum()) == 64
    assert FashionSceneItemsDataModule(style=style).background_reuse == 1  # off unless asked for


def test_the_canvas_group_takes_a_background_and_refuses_bad_ones_in_one_line() -> None:
    assert Canvas().background_spec() == Background()
    assert Canvas.coerce({"background": "mixed", "background_weights": [0, 1, 1, 0]}).background_spec().weights == \
        (0, 1, 1, 0)
    for options, message in (({"background": "fog"}, "canvas.background must be one of"),
                             ({"background": "noise", "background_noise": 9}, "canvas.background_noise is grey"),
                             ({"background_level": 2}, "canvas.background_level must be"),
                             ({"texture_source": "web"}, "canvas.texture_source must be one of")):
        with pytest.raises(ValueError, match=f"^{message}"):
            Canvas.coerce(options)
    assert backgrounds.BACKGROUNDS == ("black", "noise", "texture", "distractors", "mixed")
    from vision_attn.cli_arguments import BACKGROUND_KINDS, SHARED_OPTIONS

    assert tuple(BACKGROUND_KINDS) == backgrounds.BACKGROUNDS  # what the tools offer is what the data draws
    assert tuple(SHARED_OPTIONS["texture_source"][1]["choices"]) == tuple(backgrounds.TEXTURE_SOURCES)


def test_the_canvas_datamodule_trains_on_a_background_and_evaluates_on_black() -> None:
    """canvas.background texture: each training canvas holds its item's pixels as they were and a photograph
    around them; evaluation canvases stay black round the item."""
    data, items, pixels, boxes = training_canvases({"size": 56, "background": "texture", "background_level": 1.0}, 32)
    lit = 0
    for canvas, item, (x, y, _, _) in zip(pixels, items[:, 0].float(), boxes.tolist(), strict=True):
        inside = canvas[y : y + 28, x : x + 28]
        torch.testing.assert_close(inside[item > 0], item[item > 0])
        lit += int(canvas[:y].gt(0).sum() + canvas[y + 28 :].gt(0).sum()) > 0
    assert lit > 24  # a photograph round nearly every item (a few are dimmed to black)
    assert_test_canvases_are_black_round_their_items(data)
