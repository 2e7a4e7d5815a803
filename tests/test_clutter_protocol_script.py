"""scripts/clutter_protocol.py: the backgrounds it paints itself (a held-out kind no generator of the project
draws) leave every item pixel as it was, fill the rest, and are written beside the scenes for the erasure test;
its tables hold every figure."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from PIL import Image

from vision_attn.data.scenes import make_scenes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "clutter_protocol.py"


def protocol():
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
