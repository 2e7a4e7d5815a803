"""scripts/clutter_protocol.py: the backgrounds it paints itself (a held-out kind no generator of the project
draws) leave every item pixel as it was, fill the rest, and are written beside the scenes for the erasure test;
its tables hold every figure."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from vision_attn.data.scenes import make_scenes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "clutter_protocol.py"


def protocol():
    if str(SCRIPT.parent) not in sys.path:  # as when it runs: the scripts beside it are importable
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("clutter_protocol", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_painted_patterns_keep_every_item_pixel_and_fill_the_rest(tmp_path: Path) -> None:
    script = protocol()
    make_scenes(tmp_path, counts={"test": 4}, seed=3)
    images = sorted((tmp_path / "images" / "test").glob("*.png"))
    before = {path.name: np.asarray(Image.open(path).convert("RGB")) for path in images}
    script.repaint(tmp_path, 1.0, seed=3)
    for path in images:
        after = np.asarray(Image.open(path).convert("RGB"))
        under = np.asarray(Image.open(tmp_path / "backgrounds" / "test" / path.name).convert("RGB"))
        items = before[path.name].any(-1)
        assert np.array_equal(after[items], before[path.name][items])  # the items untouched
        assert np.array_equal(after[~items], under[~items])  # the rest is the pattern written beside
        assert (under[~items] > 0).any(-1).mean() > 0.5
    patterns = [script.pattern(np.random.default_rng(k), 32, 0.25) for k in range(6)]
    assert all(p.shape == (32, 32, 3) and p.max() <= round(255 * 0.25) for p in patterns)


def test_the_tables_hold_every_kind_and_figure() -> None:
    script = protocol()
    assert script.scene_flags(script.KINDS["texture_matplotlib"][1]) == [
        "--background", "texture", "--texture-source", "matplotlib", "--background-level", "0.25"]
    assert script.scene_flags(script.KINDS["objects_4_5"][1]) == ["--layout", "free", "--objects", "4", "5"]
    row = {"group": "clean", **{key: 0.5 for key in script.SCORES}, "repeated_object_rate": 0.01}
    table = script.table({"clean": row}, script.SCORES, script.HEADINGS).splitlines()
    assert table[0].count("|") == len(script.HEADINGS) + 3 and len(table) == 3
    assert table[2] == "| clean | clean | " + " | ".join(["0.500"] * 5 + ["1.0%", "0.500", "0.500"]) + " |"


def held_out():
    spec = importlib.util.spec_from_file_location("held_out_scenes", SCRIPT.with_name("held_out_scenes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_held_out_scenes_are_valid_splits_whose_boxes_masks_and_backgrounds_match_the_items(tmp_path: Path) -> None:
    """Every held-out kind written by held_out_scenes.py passes the formats' checks; each item's box is the tight box
    of its mask, its pixels are its colour's, the background alone differs from the scene exactly on the items, the
    noise is as bright as its kind says (40-75% or 80-100% of white) at its brightest, and the counts and sizes are
    the kind's."""
    from pycocotools import mask as coco_mask

    from vision_attn.data.formats import check_attributes, check_coco_captions, check_coco_instances, read_json

    script = held_out()
    rng = np.random.default_rng(0)
    items = rng.integers(0, 256, size=(40, 28, 28), dtype=np.uint8) * (rng.random((40, 28, 28)) < 0.6)
    labels = np.arange(40) % 10
    for kind, (_, objects, scales, ground, levels) in script.HELD_OUT.items():
        root = tmp_path / kind
        script.write_split(root, kind, 6, 3, items, labels)
        notes = root / "annotations"
        captions = check_coco_captions(read_json(notes / "captions_test.json", "captions"), notes)
        instances = check_coco_instances(read_json(notes / "instances_test.json", "instances"), notes)
        check_attributes(read_json(notes / "attributes_test.json", "attributes"), notes,
                         {a["id"] for a in instances["annotations"]})
        colours = {a["id"]: a["colour"] for a in read_json(notes / "attributes_test.json", "attributes")["instances"]}
        assert len(captions["annotations"]) == 5 * 6
        for image in instances["images"]:
            scene = np.asarray(Image.open(root / "images" / "test" / image["file_name"]).convert("RGB"))
            alone = np.asarray(Image.open(root / "backgrounds" / "test" / image["file_name"]).convert("RGB"))
            ours = [a for a in instances["annotations"] if a["image_id"] == image["id"]]
            assert objects[0] <= len(ours) <= objects[1]
            union = np.zeros(scene.shape[:2], bool)
            for annotation in ours:
                mask = coco_mask.decode(annotation["segmentation"]).astype(bool)
                rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
                assert annotation["bbox"] == [cols[0], rows[0], cols[-1] - cols[0] + 1, rows[-1] - rows[0] + 1]
                assert max(annotation["bbox"][2:]) <= round(28 * scales[1]) and annotation["area"] == mask.sum()
                off = np.array(script.COLOURS[colours[annotation["id"]]]) == 0  # the colour's dark channels
                assert (scene[mask][:, off] <= 1).all()
                union |= mask
            assert ((scene != alone).any(-1) == union).all()
            if ground != "black":
                assert levels[0] * 255 * 0.8 <= alone[~union].max() <= levels[1] * 255 + 1
            else:
                assert not scene[~union].any()
