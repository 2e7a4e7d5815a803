"""Fashion-MNIST items on a larger canvas: the DataModule's placements, masks and labels, the pointing game and
mass on hand-made maps, and the canvas config through the CLI on a tiny budget, with `rollout-mass`."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.conftest import run_in_process, shipped
from vision_attn.data.fashion_mnist import (
    canvas_mean_std,
    find_fashion_mnist,
    load_fashion_mnist,
    place_on_canvas,
    random_places,
)
from vision_attn.metrics import mask_mass, pointing_game

CANVAS_CONFIG = shipped("trainer/cpu.yaml", "tasks/classifier.yaml", "data/fashion_mnist.yaml",
                        "vit/fashion_mnist_canvas.yaml")


def test_placing_items_keeps_every_pixel_and_nothing_else() -> None:
    items = torch.randint(1, 256, (5, 1, 28, 28), dtype=torch.uint8)
    places = torch.tensor([[0, 0], [28, 28], [3, 17], [28, 0], [11, 5]])  # (left, top), corners included
    canvases = place_on_canvas(items, places, 56)
    assert canvases.shape == (5, 1, 56, 56) and canvases.dtype == torch.uint8
    for canvas, item, (left, top) in zip(canvases, items, places.tolist(), strict=True):
        assert torch.equal(canvas[:, top : top + 28, left : left + 28], item)
        assert int((canvas > 0).sum()) == 28 * 28  # nothing outside the item's square
    drawn = random_places(10_000, 56, generator=torch.Generator().manual_seed(0))
    assert int(drawn.min()) == 0 and int(drawn.max()) == 28  # every place that keeps the item whole


def test_canvas_mean_and_std_are_those_of_the_placed_items() -> None:
    images, _ = load_fashion_mnist(find_fashion_mnist("data/fashion_mnist"), "train")
    items = images[:4000, None]
    canvases = place_on_canvas(items, random_places(len(items), 56), 56).float() / 255
    mean, std = canvas_mean_std(56)
    assert abs(float(canvases.mean()) - mean) < 0.01 and abs(float(canvases.std()) - std) < 0.01


def test_canvas_datamodule_masks_and_labels_belong_to_the_item() -> None:
    from vision_attn.datamodules import FashionMNISTCanvasDataModule

    data = FashionMNISTCanvasDataModule(canvas={"size": 56}, val_size=500,
                                        loader={"batch_size": 64, "eval_batch_size": 100})
    data.setup("test")
    images, labels = load_fashion_mnist(find_fashion_mnist("data/fashion_mnist"), "test")
    canvases, canvas_labels = data.test_set.images, data.test_set.labels  # type: ignore[union-attr]
    assert canvases.shape == (10_000, 1, 56, 56) and torch.equal(canvas_labels, labels)
    # each canvas holds its own item, whole, somewhere: the same pixel total and the same bright pixels
    assert torch.equal(canvases.flatten(1).long().sum(1), images.flatten(1).long().sum(1))
    assert torch.equal((canvases > 0).flatten(1).sum(1), (images > 0).flatten(1).sum(1))
    batch = next(iter(data.test_dataloader()))
    inputs, batch_labels, masks = data.on_after_batch_transfer(batch, 0)
    assert inputs.dtype == torch.float32 and inputs.shape == (100, 1, 56, 56)
    assert torch.equal(batch_labels, labels[:100]) and torch.equal(masks, canvases[:100, 0] > 0)
    # the places differ between items, and are the same on every setup (a fixed test split)
    corners = [tuple(int(v) for v in torch.nonzero(mask)[0]) for mask in masks[:20]]
    assert len(set(corners)) > 10
    again = FashionMNISTCanvasDataModule(canvas={"size": 56}, val_size=500)
    again.setup("test")
    assert torch.equal(again.test_set.images, canvases)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="at least 28"):
        FashionMNISTCanvasDataModule(canvas={"size": 20})


def test_pointing_and_mass_on_hand_made_maps() -> None:
    mask = torch.zeros(1, 56, 56, dtype=torch.bool)
    mask[0, 8:24, 16:40] = True  # rows 1-2, columns 2-4 of a 7x7 grid of 8-pixel cells
    on_item = torch.zeros(1, 7, 7)
    on_item[0, 1:3, 2:5] = 1.0
    assert float(mask_mass(on_item, mask)) == pytest.approx(1.0)
    assert bool(pointing_game(on_item, mask))
    peak_elsewhere = on_item.clone()
    peak_elsewhere[0, 6, 6] = 5.0
    assert not bool(pointing_game(peak_elsewhere, mask))
    uniform = torch.ones(1, 7, 7)
    assert float(mask_mass(uniform, mask)) == pytest.approx(float(mask.float().mean()))
    # a blind map points at random: over many masks at random places it hits about as often as their area
    masks = place_on_canvas(torch.full((2000, 1, 28, 28), 255, dtype=torch.uint8),
                            random_places(2000, 56, generator=torch.Generator().manual_seed(1)), 56)[:, 0] > 0
    hits = pointing_game(torch.rand(2000, 7, 7, generator=torch.Generator().manual_seed(2)), masks)
    assert abs(float(hits.float().mean()) - 0.25) < 0.04


def test_canvas_config_trains_tests_and_scores_its_maps_through_the_cli(tmp_path) -> None:
    checkpoints = tmp_path / "ckpt"
    (tmp_path / "tiny.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        f"      init_args: {{dirpath: {checkpoints}, filename: best, monitor: val/acc, mode: max}}\n")
    tiny = ["--config", str(tmp_path / "tiny.yaml"), "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
            "--trainer.limit_test_batches", "2", "--trainer.enable_progress_bar", "false",
            "--data.init_args.loader.batch_size", "64", "--data.init_args.loader.eval_batch_size", "100",
            "--model.init_args.architecture.embed_dim", "32", "--model.init_args.architecture.depth", "2",
            "--model.init_args.architecture.num_heads", "2", "--model.init_args.log_overlays", "0",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.default_root_dir", str(tmp_path)]
    fit = run_in_process("fit", *CANVAS_CONFIG, *tiny, "--trainer.logger.save_dir", str(tmp_path / "fit"))
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = checkpoints / "best.ckpt"
    test = run_in_process("test", *CANVAS_CONFIG, "--ckpt_path", str(checkpoint), *tiny,
                          "--trainer.logger.save_dir", str(tmp_path / "test"))
    assert test.returncode == 0, test.stderr[-3000:]
    rows = [row for path in tmp_path.rglob("metrics.csv") for row in csv.DictReader(path.open())]
    logged = {key: float(value) for row in rows for key, value in row.items() if value and "/" in key}
    for name in ("rollout_mass", "rollout_pointing", "last_layer_mass", "last_layer_pointing"):
        assert 0.0 <= logged[f"val/{name}"] <= 1.0 and 0.0 <= logged[f"test/{name}"] <= 1.0
    result = run_in_process("rollout-mass", "--ckpt", str(checkpoint), "--count", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert "64 Fashion-MNIST test items on 56x56 canvases" in lines[0]
    scores = {line[:18].strip(): [float(value) for value in line[18:].split()] for line in lines[2:]}
    assert set(scores) == {"rollout", "gradient rollout", "last layer"}
    assert all(0.0 <= value <= 1.0 for pair in scores.values() for value in pair)
    # the same items with grey noise around them: the same masks (so the same area share), other inputs
    noisy = run_in_process("rollout-mass", "--ckpt", str(checkpoint), "--count", "64", "--background-noise", "64")
    assert noisy.returncode == 0, noisy.stderr[-3000:]
    first = noisy.stdout.strip().splitlines()[0]
    assert "with grey noise up to 64 around the item" in first
    assert first.split("area share ")[1] == lines[0].split("area share ")[1]
    assert noisy.stdout.splitlines()[2:] != lines[2:]
    # ... and on textures: the same masks again, and a one-line refusal of noise and a background at once
    textured = run_in_process("rollout-mass", "--ckpt", str(checkpoint), "--count", "64", "--background", "texture",
                              "--background-level", "0.3", "--texture-source", "matplotlib")
    assert textured.returncode == 0, textured.stderr[-3000:]
    first = textured.stdout.strip().splitlines()[0]
    assert "on texture backgrounds up to 0.3 of white" in first
    assert first.split("area share ")[1] == lines[0].split("area share ")[1]
    assert textured.stdout.splitlines()[2:] not in (lines[2:], noisy.stdout.splitlines()[2:])
    both = run_in_process("rollout-mass", "--ckpt", str(checkpoint), "--background-noise", "9", "--background",
                          "noise")
    assert both.returncode == 2 and both.stderr.strip().splitlines() == [
        "error: background noise is grey noise on black: give it or a background, not both"], both.stderr


def test_canvas_training_batches_carry_each_items_box() -> None:
    """In training each item is mirrored (or not), placed at random, and its place comes with the batch as
    [x, y, w, h]: the item's pixels are all inside that box, and they are the item's (or its mirror image's)."""
    import lightning as L

    from vision_attn.datamodules import FashionMNISTCanvasDataModule

    data = FashionMNISTCanvasDataModule(canvas={"size": 56}, val_size=500, loader={"batch_size": 64},
                                        augmentation={"hflip": True})
    data.setup("fit")
    data.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    data.trainer.training = True
    items, labels = next(iter(data.train_dataloader()))
    torch.manual_seed(0)
    inputs, batch_labels, boxes = data.on_after_batch_transfer((items, labels), 0)
    assert inputs.shape == (64, 1, 56, 56) and boxes.shape == (64, 4) and torch.equal(batch_labels, labels)
    pixels = (inputs * data.std[0] + data.mean[0]) * 255  # back to the 0..255 canvas
    flipped = 0
    for canvas, item, (x, y, w, h) in zip(pixels[:, 0], items[:, 0].float(), boxes.tolist(), strict=True):
        assert (w, h) == (28, 28) and 0 <= x <= 28 and 0 <= y <= 28
        inside = canvas[y : y + h, x : x + w]
        assert canvas.round().sum() == inside.round().sum()  # nothing outside the box
        if torch.allclose(inside, item.flip(-1), atol=0.01) and not torch.allclose(inside, item, atol=0.01):
            flipped += 1
        else:
            torch.testing.assert_close(inside, item, atol=0.01, rtol=0)
    assert 10 < flipped < 54  # about half mirrored
    assert len({tuple(box) for box in boxes.tolist()}) > 40  # places differ


def training_canvases(canvas: dict, batch_size: int) -> tuple:
    """The canvas DataModule on ``canvas``, and one training batch of it: the items, their canvases' pixels
    (0..255, one channel) and the items' boxes."""
    import lightning as L

    from vision_attn.datamodules import FashionMNISTCanvasDataModule

    data = FashionMNISTCanvasDataModule(canvas=canvas, val_size=500, loader={"batch_size": batch_size})
    data.setup("fit")
    data.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    data.trainer.training = True
    items, labels = next(iter(data.train_dataloader()))
    inputs, _, boxes, *_ = data.on_after_batch_transfer((items, labels), 0)  # and the windows' origins, if any
    return data, items, ((inputs * data.std[0] + data.mean[0]) * 255).round()[:, 0], boxes


def assert_test_canvases_are_black_round_their_items(data) -> None:
    """The test split of ``data`` (a canvas DataModule): nothing lit but the items' masks."""
    data.trainer.training = False
    data.setup("test")
    test_inputs, _, masks = data.on_after_batch_transfer(next(iter(data.test_dataloader())), 0)
    assert torch.equal(((test_inputs * data.std[0] + data.mean[0]) * 255).round()[:, 0] > 0.5, masks)


def test_background_noise_fills_every_pixel_but_the_items_in_training() -> None:
    """background_noise 64: around each training item (its zero pixels included) grey noise up to a level drawn per
    image, at most 64; the item's own pixels are as they were; evaluation canvases stay black."""
    data, items, pixels, boxes = training_canvases({"size": 56, "background_noise": 64}, 128)
    levels = []
    for canvas, item, (x, y, _, _) in zip(pixels, items[:, 0].float(), boxes.tolist(), strict=True):
        inside = canvas[y : y + 28, x : x + 28]
        torch.testing.assert_close(inside[item > 0], item[item > 0])  # the item untouched
        background = torch.cat([canvas[: y].flatten(), canvas[y + 28 :].flatten(), inside[item == 0]])
        assert float(background.min()) >= 0 and float(background.max()) <= 64
        levels.append(float(background.max()))
    assert min(levels) < 20 and max(levels) > 50  # a noise level of its own per image
    assert_test_canvases_are_black_round_their_items(data)
    from vision_attn.datamodules import FashionMNISTCanvasDataModule

    with pytest.raises(ValueError, match="background_noise"):
        FashionMNISTCanvasDataModule(canvas={"background_noise": 300})


def test_training_windows_hold_the_item_and_say_where_they_lie() -> None:
    """train_window 40: each training image is a 40x40 window of its canvas, at a multiple of 8 pixels, with the
    whole item inside; over a batch the windows take every place and the items reach every pixel phase."""
    import lightning as L

    from vision_attn.datamodules import FashionMNISTCanvasDataModule

    data = FashionMNISTCanvasDataModule(canvas={"size": 56, "train_window": 40}, val_size=500,
                                        loader={"batch_size": 256})
    data.setup("fit")
    data.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    data.trainer.training = True
    items, labels = next(iter(data.train_dataloader()))
    inputs, _, boxes, origins = data.on_after_batch_transfer((items, labels), 0)
    assert inputs.shape == (256, 1, 40, 40) and origins.shape == (256, 2)
    assert set(origins.flatten().tolist()) == {0, 8, 16}
    pixels = (inputs * data.std[0] + data.mean[0]) * 255
    for canvas, item, (x, y, *size) in zip(pixels[:, 0], items[:, 0].float(), boxes.tolist(), strict=True):
        assert size == [28, 28] and 0 <= x <= 12 and 0 <= y <= 12 and canvas.round().sum() == item.sum()
    on_canvas = origins + boxes[:, :2]  # the item's corner on the 56x56 canvas
    assert int(on_canvas.min()) >= 0 and int(on_canvas.max()) <= 28
    assert len(set((on_canvas % 8).flatten().tolist())) == 8
    with pytest.raises(ValueError, match="train_window"):
        FashionMNISTCanvasDataModule(canvas={"size": 56, "train_window": 32})  # 56 - 32 is 24, but 32 misses phases 5-7
    with pytest.raises(ValueError, match="train_window"):
        FashionMNISTCanvasDataModule(canvas={"size": 56, "train_window": 44})  # 56 - 44 is not a multiple of 8


def test_attention_grounding_is_minus_log_the_rollout_share_on_the_box() -> None:
    """The grounding term by hand: the rollout's cls row over the patches, the share of it on the cells the box
    covers (a box over cells (1..2, 1..2) of the 7x7 grid covers them whole and nothing else), −log of it."""
    import torch.nn.functional as F

    from vision_attn.tasks import ViTTask
    from vision_attn.vit.rollout import attention_rollout

    torch.manual_seed(0)
    task = ViTTask(image={"size": 56, "channels": 1}, architecture={"patch_size": 8, "embed_dim": 32, "depth": 2,
                                                                     "num_heads": 2, "reg_tokens": 1},
                   training={"attention_grounding": 0.5}, log_overlays=0)
    images, labels = torch.randn(4, 1, 56, 56), torch.tensor([0, 3, 5, 9])
    boxes = torch.tensor([[8, 8, 16, 16]] * 4)
    loss, logits = task.grounded_loss(images, labels, boxes)
    tokens, attentions, _ = task.model.forward_intermediates(images)
    cls_row = attention_rollout(attentions)[:, 0, 2:].view(4, 7, 7)  # the cls token's row, past cls and register
    share = cls_row[:, 1:3, 1:3].sum((-2, -1)) / cls_row.sum((-2, -1))
    expected = F.cross_entropy(task.model.forward_head(tokens), labels) - 0.5 * share.log().mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logits, task.model.forward_head(tokens))
    with pytest.raises(ValueError, match="boxes"):
        task.grounded_loss(images, labels, None)
    with pytest.raises(ValueError, match="attention_grounding"):
        ViTTask(training={"attention_grounding": -1.0})


def test_attention_grounding_pulls_the_rollout_onto_the_items_through_the_cli(tmp_path) -> None:
    """30 steps of the canvas config with and without attention_grounding: grounded, the validation rollout
    already lies mostly on the items (their pixels, which it never saw: it was trained on boxes), and well above
    the ungrounded run's."""
    mass = {}
    for weight in ("0.0", "1.0"):
        run = tmp_path / weight
        fit = run_in_process(
            "fit", *CANVAS_CONFIG, "--trainer.max_epochs", "1", "--trainer.max_time", "null",
            "--trainer.limit_train_batches", "30", "--trainer.limit_val_batches", "2",
            "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", str(run), "--trainer.default_root_dir", str(run),
            "--data.init_args.loader.batch_size", "64", "--data.init_args.loader.eval_batch_size", "100",
            "--model.init_args.architecture.embed_dim", "32", "--model.init_args.architecture.depth", "2",
            "--model.init_args.architecture.num_heads", "2", "--model.init_args.log_overlays", "0",
            "--model.init_args.training.attention_grounding", weight)
        assert fit.returncode == 0, fit.stderr[-3000:]
        rows = [row for path in run.rglob("metrics.csv") for row in csv.DictReader(path.open())]
        mass[weight] = next(float(row["val/rollout_mass"]) for row in rows if row.get("val/rollout_mass"))
    assert mass["1.0"] > 0.6 and mass["1.0"] > mass["0.0"] + 0.2, mass


def test_scaled_training_items_come_at_sizes_of_their_own_inside_their_boxes() -> None:
    """canvas.scale [0.5, 1.15] with train_window 40: each training item is resized to a side of its own, 14 to 32
    pixels, and lies whole inside its box, which fits the window; its pixels are the item's, resized; sizes and
    places vary over a batch, and evaluation canvases keep their 28-pixel items on black."""
    import torch.nn.functional as F

    torch.manual_seed(0)  # the sizes and places are drawn from torch's generator
    data, items, pixels, boxes = training_canvases({"size": 56, "train_window": 40, "scale": [0.5, 1.15]}, 256)
    sides = boxes[:, 2].tolist()
    assert torch.equal(boxes[:, 2], boxes[:, 3]) and min(sides) == 14 and max(sides) == 32
    assert len(set(sides)) == 19  # every side from 14 to 32 pixels
    for canvas, item, (x, y, w, h) in zip(pixels, items[:, 0].float(), boxes.tolist(), strict=True):
        assert 0 <= x <= 40 - w and 0 <= y <= 40 - h
        inside = canvas[y : y + h, x : x + w]
        assert canvas.sum() == inside.sum()  # nothing lit outside the box
        resized = F.interpolate(item[None, None], size=(h, w), mode="bilinear", antialias=True)[0, 0]
        mirrored = F.interpolate(item.flip(-1)[None, None], size=(h, w), mode="bilinear", antialias=True)[0, 0]
        assert min(float((inside - r.round().clamp(0, 255)).abs().max()) for r in (resized, mirrored)) == 0
    assert len({tuple(box) for box in boxes[:, :2].tolist()}) > 100
    assert_test_canvases_are_black_round_their_items(data)


@pytest.mark.parametrize(("scale", "message"), [
    ([0.5], "scale is [low, high] with 0 < low <= high, got [0.5]"),
    ([1.0, 0.5], "scale is [low, high]"),
    ([0.0, 1.0], "scale is [low, high]"),
    ([0.5, float("nan")], "scale is [low, high]"),
    ([0.5, 1.5], "scale [0.5, 1.5] draws items of up to 42 pixels: they must fit the training window (40 pixels)"),
    ([0.01, 1.0], "draws items of up to 28 pixels: they must fit the training window (40 pixels), and be 1 pixel"),
])
def test_a_scale_that_cannot_be_drawn_is_refused_in_one_line(scale, message) -> None:
    from vision_attn.datamodules.data_options import Canvas

    with pytest.raises(ValueError, match="^canvas.") as refused:
        Canvas.coerce({"size": 56, "train_window": 40, "scale": scale})
    assert message in str(refused.value) and "\n" not in str(refused.value)
