"""Attention overlays: heat-map geometry, rollout maths against hand-computed cases, the CLI, the gallery."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process, tiny
from vision_attn.overlay import heat_panel, panel_grid, upsample_heatmap, write_gallery
from vision_attn.vit.rollout import attention_rollout, class_map, discard_weakest, explain, fuse_heads
from vision_attn.vit.vision_transformer import VisionTransformer

# --- heat-map geometry ------------------------------------------------------------------------------


def cell_bounds(index: int, cells: int, pixels: int) -> tuple[float, float]:
    return index * pixels / cells, (index + 1) * pixels / cells


@pytest.mark.parametrize("mode", ["bilinear", "pyramid"])
@pytest.mark.parametrize(("grid", "size"), [((3, 3), (96, 96)), ((3, 4), (90, 200)), ((14, 14), (224, 300))])
def test_a_one_hot_alpha_lights_up_its_own_cell(mode, grid, size) -> None:
    height, width = size
    for row, column in [(0, 0), (grid[0] - 1, grid[1] - 1), (grid[0] // 2, grid[1] - 1), (1, 0)]:
        weights = torch.zeros(grid)
        weights[row, column] = 1.0
        heat = upsample_heatmap(weights, size, mode=mode)
        assert heat.shape == (height, width)
        top, bottom = cell_bounds(row, grid[0], height)
        left, right = cell_bounds(column, grid[1], width)
        peak_y, peak_x = divmod(int(heat.argmax()), width)
        assert top <= peak_y < bottom and left <= peak_x < right, (row, column, peak_y, peak_x)
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        centre_y, centre_x = (heat * ys).sum() / heat.sum(), (heat * xs).sum() / heat.sum()
        assert top <= centre_y < bottom and left <= centre_x < right
        inside = heat[int(top) : int(np.ceil(bottom)), int(left) : int(np.ceil(right))].sum()
        assert inside > 0.3 * heat.sum()


def test_heat_panel_keeps_the_image_geometry_and_draws_only_inside_the_box() -> None:
    image = Image.new("RGB", (300, 120), (40, 40, 40))
    weights = torch.zeros(2, 2)
    weights[1, 0] = 1.0  # bottom-left cell of the centre square (90..210 x 0..120)
    box = (90, 0, 210, 120)
    panel = heat_panel(image, weights, box=box)
    assert panel.size == image.size
    changed = np.abs(np.asarray(panel, dtype=np.int32) - np.asarray(image, dtype=np.int32)).sum(axis=-1)
    peak_y, peak_x = np.unravel_index(changed[:, 90:210].argmax(), changed[:, 90:210].shape)
    assert 60 <= peak_y < 120 and 0 <= peak_x < 60
    outside = np.asarray(panel)[:, :90]
    assert (outside == round(40 * 0.45)).all()  # dimmed, with no heat


def test_a_flat_map_draws_no_colour() -> None:
    image = Image.new("RGB", (50, 40), (100, 120, 140))
    assert np.array_equal(np.asarray(heat_panel(image, torch.full((3, 3), 1 / 9))), np.asarray(image))


def test_bad_heat_map_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="Gh, Gw"):
        upsample_heatmap(torch.ones(9), (10, 10))
    with pytest.raises(ValueError, match="unknown upsampling"):
        upsample_heatmap(torch.ones(3, 3), (10, 10), mode="nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="colour map"):
        heat_panel(Image.new("RGB", (8, 8)), torch.rand(2, 2), cmap="no-such-map")


def test_panels_wrap_into_rows() -> None:
    panels = [(Image.new("RGB", (40, 30), "red"), f"word {i}") for i in range(7)]
    one_row = panel_grid(panels[:3], columns=5)
    two_rows = panel_grid(panels, columns=5)
    assert two_rows.width == panel_grid(panels[:5], columns=5).width > one_row.width
    assert two_rows.height > one_row.height


# --- rollout maths --------------------------------------------------------------------------------

# Two layers over three tokens, worked out by hand:
#   Â1 = rownorm(A1 + I) = [[1, 0, 0], [.25, .75, 0], [0, 0, 1]]
#   Â2 = rownorm(A2 + I) = [[.5, .25, .25], [0, 1, 0], [.5, 0, .5]]
#   R = Â2 Â1:  row 0 = .5[1,0,0] + .25[.25,.75,0] + .25[0,0,1] = [.5625, .1875, .25]
A1 = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0, 0, 1]])
A2 = torch.tensor([[0.0, 0.5, 0.5], [0, 1, 0], [1, 0, 0]])
ROLLOUT = torch.tensor([[0.5625, 0.1875, 0.25], [0.25, 0.75, 0.0], [0.5, 0.0, 0.5]])


def test_rollout_matches_the_hand_computed_two_layer_case() -> None:
    attentions = [A1[None, None], A2[None, None]]  # (B=1, H=1, N, N)
    assert torch.allclose(attention_rollout(attentions), ROLLOUT[None])


def test_head_fusion_by_mean_max_and_min() -> None:
    # Two heads of layer 1 whose mean is A1; their max and min are worked out by hand.
    head_a = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 1]])
    head_b = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1]])
    layer1 = torch.stack([head_a, head_b])[None]
    layer2 = torch.stack([A2, A2])[None]
    assert torch.allclose(attention_rollout([layer1, layer2], head_fusion="mean"), ROLLOUT[None])
    assert torch.equal(fuse_heads(layer1, "max")[0], torch.tensor([[1.0, 0, 0], [1, 1, 0], [0, 0, 1]]))
    assert torch.equal(fuse_heads(layer1, "min")[0], torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 0, 1]]))
    # max: Â1 row 1 = ([1,1,0] + [0,1,0]) / 3 = [1/3, 2/3, 0]; R row 0 = .5[1,0,0] + .25[1/3,2/3,0] + .25[0,0,1]
    expected_row0 = torch.tensor([0.5 + 0.25 / 3, 0.5 / 3, 0.25])
    assert torch.allclose(attention_rollout([layer1, layer2], head_fusion="max")[0, 0], expected_row0)
    with pytest.raises(ValueError, match="head fusion"):
        fuse_heads(layer1, "median")  # type: ignore[arg-type]


def test_discard_ratio_drops_the_weakest_links_but_never_the_diagonal() -> None:
    attention = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.4, 0.05, 0.25, 0.3], [0.25, 0.25, 0.4, 0.1],
                               [0.7, 0.1, 0.1, 0.1]]])
    kept = discard_weakest(attention, 0.5)  # the two weakest of each row, the diagonal excepted
    expected = torch.tensor([[[0.1, 0.0, 0.0, 0.4], [0.4, 0.05, 0.0, 0.0], [0.25, 0.25, 0.4, 0.0],
                              [0.7, 0.0, 0.0, 0.1]]])
    # Row 0 keeps its weak diagonal 0.1; row 3 drops the two off-diagonal 0.1s; row 2 ties 0.25/0.25, one goes.
    assert torch.equal(kept[0, [0, 1, 3]], expected[0, [0, 1, 3]])
    assert sorted(kept[0, 2].tolist()) == [0.0, 0.0, 0.25, pytest.approx(0.4)] and kept[0, 2, 2] == 0.4
    with pytest.raises(ValueError, match="discard ratio"):
        discard_weakest(attention, 1.0)


def test_rollout_is_batched_and_rows_sum_to_one() -> None:
    torch.manual_seed(0)
    attentions = [torch.rand(3, 2, 7, 7).softmax(-1) for _ in range(3)]
    batched = attention_rollout(attentions, discard_ratio=0.3)
    singles = torch.cat([attention_rollout([a[i : i + 1] for a in attentions], discard_ratio=0.3) for i in range(3)])
    assert torch.allclose(batched, singles)
    assert torch.allclose(batched.sum(-1), torch.ones(3, 7))


def test_gradient_rollout_follows_the_relevance_rule_by_hand() -> None:
    from vision_attn.vit.rollout import gradient_rollout

    # One head; A ⊙ G has a negative entry that must be dropped. Layer 1: Ā1 = (A ⊙ G)⁺, R1 = I + Ā1.
    attention = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    gradient = torch.tensor([[2.0, -1.0], [4.0, 0.0]])
    a1 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert torch.allclose(gradient_rollout([attention[None, None]], [gradient[None, None]])[0], a1)
    # Two layers with the same maps: R2 = R1 + Ā1 R1 = (I + Ā1)², minus I.
    r1 = torch.eye(2) + a1
    two = gradient_rollout([attention[None, None]] * 2, [gradient[None, None]] * 2)[0]
    assert torch.allclose(two, r1 + a1 @ r1 - torch.eye(2))


def test_class_map_reads_the_cls_row_or_the_mean_patch_row_on_any_grid() -> None:
    matrix = torch.arange(49, dtype=torch.float32).view(1, 7, 7)  # cls + a 2x3 grid
    assert torch.equal(class_map(matrix, (2, 3), "token")[0], torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    mean_rows = matrix[0, 1:].mean(0)[1:].view(2, 3)
    assert torch.equal(class_map(matrix, (2, 3), "avg")[0], mean_rows)
    with pytest.raises(ValueError, match="grid"):
        class_map(matrix, (2, 2))


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_explain_gives_maps_for_every_head_and_grid(global_pool) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=24, patch_size=6, in_chans=1, num_classes=4, embed_dim=32, depth=2,
                              num_heads=2, global_pool=global_pool).eval()
    images = torch.randn(2, 1, 24, 24)
    maps = explain(model, images, discard_ratio=0.5, gradient_class=1)
    assert maps.heads.shape == (2, 2, 4, 4)
    assert maps.rollout.shape == maps.gradient_rollout.shape == (2, 4, 4)
    assert torch.allclose(maps.logits, model(images), atol=1e-5)
    if global_pool == "token":  # the cls row of the last layer, per head
        _, attentions = model.forward_with_attention(images)
        assert torch.allclose(maps.heads[:, :, 0, 0], attentions[-1][:, :, 0, 1], atol=1e-6)
    with pytest.raises(ValueError, match="class 9"):
        explain(model, images, gradient_class=9)


# --- gallery and CLI -------------------------------------------------------------------------------


class ImageLister(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.scripts = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:  # noqa: ANN001
        if tag == "img":
            self.sources.append(dict(attrs)["src"])
        if tag == "script":
            self.scripts += 1

    def handle_data(self, data) -> None:  # noqa: ANN001
        self.text.append(data)


def read_gallery(folder: Path) -> ImageLister:
    lister = ImageLister()
    lister.feed((folder / "index.html").read_text(encoding="utf-8"))
    return lister


def test_gallery_lists_every_png_and_escapes_captions(tmp_path) -> None:
    from urllib.parse import unquote, urlsplit

    names = ["a.png", "b & c.png", "#1 ?x 100%.png"]
    entries = [(names[0], 'a <script>alert("x")</script> caption'), (names[1], "naïve — ünïcode"), (names[2], "odd")]
    write_gallery(tmp_path, entries)
    gallery = read_gallery(tmp_path)
    # a browser reads each link as a path (no fragment, no query) that decodes to the file's own name
    assert [unquote(urlsplit(src).path) for src in gallery.sources] == names
    assert all(not urlsplit(src).fragment and not urlsplit(src).query for src in gallery.sources)
    assert gallery.scripts == 0
    assert 'a <script>alert("x")</script> caption' in "".join(gallery.text)


def odd_images(folder: Path) -> list[Path]:
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (37, 181, 3), dtype=np.uint8)).save(folder / "wide.jpg")
    Image.fromarray(rng.integers(0, 255, (150, 23), dtype=np.uint8), mode="L").save(folder / "tall_grey.png")
    Image.new("RGBA", (64, 64), (255, 0, 0, 128)).save(folder / "rgba.png")
    Image.new("P", (9, 9)).save(folder / "palette.gif")
    Image.new("RGB", (1, 1), "white").save(folder / "one_pixel.png")
    return sorted(folder.iterdir())


def check_overlays(out: Path, sources: list[Path], panel_size: int) -> None:
    """One PNG per source, all listed in the gallery; each image drawn in its own aspect ratio."""
    gallery = read_gallery(out)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert sorted(gallery.sources) == pngs and len(pngs) == len(sources)
    heights = {}
    for source in sources:
        with Image.open(out / f"{source.stem}.png") as figure:
            assert figure.mode == "RGB" and max(figure.size) >= panel_size
            assert np.asarray(figure).std() > 0
            heights[source.stem] = figure.height
    assert heights["wide"] < heights["tall_grey"]  # the wide image's panels are not squashed to squares


def test_caption_overlay_draws_one_panel_per_word_in_the_image_geometry() -> None:
    from vision_attn.overlay import caption_overlay

    record = {"caption": "a red bag", "tokens": ["a", "red", "bag"], "grid": [2, 2],
              "alphas": [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]], "betas": [0.1, 0.5, 0.9]}
    wide = caption_overlay(Image.new("RGB", (200, 50), "gray"), record, panel_size=100, columns=2)
    square = caption_overlay(Image.new("RGB", (100, 100), "gray"), record, panel_size=100, columns=2)
    assert wide.width == square.width  # 2 columns of 100-pixel panels
    assert wide.height < square.height  # 2 rows of 25-pixel-high panels against 100-pixel ones
    with pytest.raises(ValueError, match="3 tokens"):
        caption_overlay(Image.new("RGB", (10, 10)), {**record, "alphas": record["alphas"][:2]})


def test_overlay_cli_for_the_captioner_on_odd_images_and_from_results_json(trained_captioner, tmp_path) -> None:
    sources = odd_images(tmp_path / "images")
    out = tmp_path / "out"
    result = run_in_process("overlay", "--ckpt", str(trained_captioner["ckpt"]), str(tmp_path / "images"),
                        "--out", str(out), "--panel-size", "64", "--columns", "3", "--upsample", "pyramid")
    assert result.returncode == 0, result.stderr[-3000:]
    check_overlays(out, sources, 64)
    assert f"wrote {len(sources)} overlays" in result.stdout

    # The same figures from `caption`'s results JSON, without the checkpoint; a caption with markup stays text.
    results = tmp_path / "results.json"
    assert run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), str(sources[0]),
                      "--out", str(results)).returncode == 0
    records = json.loads(results.read_text())
    records[0]["caption"] = "<script>alert(1)</script>"
    results.write_text(json.dumps(records))
    from_json = tmp_path / "from_json"
    result = run_in_process("overlay", str(results), "--out", str(from_json))
    assert result.returncode == 0, result.stderr[-3000:]
    gallery = read_gallery(from_json)
    assert gallery.scripts == 0 and "<script>alert(1)</script>" in "".join(gallery.text)
    assert len(gallery.sources) == 1


def test_overlay_cli_for_the_vit_with_rollout_options(vit_checkpoint, tmp_path) -> None:
    sources = odd_images(tmp_path / "images")
    out = tmp_path / "out"
    result = run_in_process("overlay", "--ckpt", str(vit_checkpoint), *map(str, sources), "--out", str(out),
                        "--head-fusion", "max", "--discard-ratio", "0.5", "--gradient-class", "Sneaker",
                        "--panel-size", "96")
    assert result.returncode == 0, result.stderr[-3000:]
    check_overlays(out, sources, 96)
    assert all("%" in line for line in result.stdout.splitlines() if " -> " in line)


def test_overlay_cli_errors_are_one_line(vit_checkpoint, tmp_path) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    cases = [
        (["--ckpt", str(vit_checkpoint), str(bad)], "bad.jpg: cannot decode image"),
        (["--ckpt", str(vit_checkpoint), str(tmp_path / "missing.png")], "missing.png: no such file"),
        (["--ckpt", str(vit_checkpoint), str(bad), "--gradient-class", "Spaceship"], "unknown class"),
        ([str(tmp_path / "nothing.json")], "nothing.json: no such file (a results JSON was expected)"),
    ]
    for arguments, message in cases:
        result = run_in_process("overlay", *arguments, "--out", str(tmp_path / "out"))
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# --- overlays logged during validation ------------------------------------------------------------


def test_validation_writes_overlay_pngs_when_there_is_no_image_logger(vit_checkpoint, trained_captioner) -> None:
    for run in (vit_checkpoint.parents[1], trained_captioner["run"]):
        pngs = sorted(run.rglob("overlays/step*/val_overlay_*.png"))
        assert pngs, f"no overlays under {run}"
        with Image.open(pngs[0]) as figure:
            assert figure.width > 100 and np.asarray(figure).std() > 0


def test_validation_logs_overlays_to_tensorboard_and_not_in_the_sanity_check(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vision_attn.cli import main

    main(["fit", *tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path),
          "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
          "--trainer.logger.save_dir", str(tmp_path / "tb"), "--trainer.num_sanity_val_steps", "2",
          "--model.init_args.log_overlays", "2"])
    events = EventAccumulator(str(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["val_overlay/0", "val_overlay/1"]
    assert [image.step for image in events.Images("val_overlay/0")] == [4]  # after the 4 training steps only
    assert not list(tmp_path.rglob("overlays"))


# --- rollout mass on the object (docs/formats/metrics.md, ViT) ----------------------------------------------


def test_mask_mass_weighs_each_cell_by_its_share_of_mask_pixels() -> None:
    from vision_attn.metrics import mask_mass

    weights = torch.tensor([[[3.0, 1.0], [0.0, 0.0]]])  # normalised: 0.75 on cell (0, 0), 0.25 on (0, 1)
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    mask[0, :2, :2] = True  # all of cell (0, 0)
    mask[0, 0, 2] = True  # a quarter of cell (0, 1)
    assert torch.allclose(mask_mass(weights, mask), torch.tensor([0.75 + 0.25 * 0.25]))
    uniform = torch.ones(1, 2, 2)
    assert torch.allclose(mask_mass(uniform, mask), mask.float().mean())  # a blind map scores the area share
    with pytest.raises(ValueError, match="does not tile"):
        mask_mass(weights, torch.ones(1, 5, 5, dtype=torch.bool))


def test_rollout_mass_command_reports_mass_against_the_area_share(vit_checkpoint) -> None:
    result = run_in_process("rollout-mass", "--ckpt", str(vit_checkpoint), "--count", "64", "--canvas-size", "56")
    assert result.returncode == 0, result.stderr[-3000:]
    header, columns, *rows = result.stdout.strip().splitlines()
    area = float(header.split("area share ")[1].split()[0])
    assert 0 < area < 0.5 and "accuracy" in header and columns.split()[0] == "map"
    scores = {row[:18].strip(): [float(value) for value in row[18:].split()] for row in rows}
    assert list(scores) == ["rollout", "gradient rollout", "last layer"]
    assert all(0 < mass < 1 and 0 <= pointing <= 1 for mass, pointing in scores.values())
