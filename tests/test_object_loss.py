"""The object loss: each training object's class and colour read from the annotation vectors under its box, with
the boxes and labels of the train split's instances file (``object_targets``, ``object_weight``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import run_in_process, tiny
from vision_attn.boxes import box_cell_coverage, box_cell_weights
from vision_attn.captioning.extensions.grounding import grounding_loss, grounding_targets
from vision_attn.captioning.extensions.object_classes import object_loss
from vision_attn.data.caption_datasets import pad_objects
from vision_attn.data.coco import read_object_targets
from vision_attn.data.scenes import CLASS_WORDS, COLOURS, make_scenes
from vision_attn.data.vocabulary import SPECIALS
from vision_attn.datamodules import CocoCaptionsDataModule


def test_box_cell_weights_share_each_box_by_the_area_in_each_cell():
    boxes = torch.tensor([
        [0.0, 0.0, 0.5, 0.5],  # exactly the top-left cell of a 2×2 grid
        [0.25, 0.0, 0.75, 0.5],  # half in the top-left cell, half in the top-right
        [0.0, 0.0, 1.0, 1.0],  # the whole image
        [0.6, 0.7, 0.6, 0.7],  # no area: the cell of its corner (bottom-right)
    ])
    weights = box_cell_weights(boxes, (2, 2))
    expected = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25], [0, 0, 0, 1.0]])
    torch.testing.assert_close(weights, expected)
    # a 3×2 grid: rows of thirds; a box over the middle third of the left column
    torch.testing.assert_close(box_cell_weights(torch.tensor([[0.0, 1 / 3, 0.5, 2 / 3]]), (3, 2)),
                               torch.tensor([[0.0, 0, 1, 0, 0, 0]]))


def test_box_cell_coverage_is_the_share_of_each_cell_inside_the_box():
    boxes = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.25, 0.0, 0.75, 0.5], [0.0, 0.0, 1.0, 1.0]])
    expected = torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(box_cell_coverage(boxes, (2, 2)), expected)
    # a 56-pixel canvas in 7×7 cells of 8: an item at x 12..40, y 3..31 covers half of column 1 and row 0 ...
    coverage = box_cell_coverage(torch.tensor([12.0, 3.0, 40.0, 31.0]) / 56, (7, 7)).view(7, 7)
    torch.testing.assert_close(coverage[0, 1], torch.tensor(5 / 8 * 4 / 8))
    torch.testing.assert_close(coverage[1, 2], torch.tensor(1.0))
    assert coverage[:, 6].sum() == 0 and coverage[4:].sum() == 0


def test_object_loss_reads_the_vectors_under_each_box():
    """A 2×2 grid whose cells hold one-hot features of classes 0..3: the box over cell k is read as class k, a
    padding row is left out, and the colour term counts only where a colour is known."""
    annotations = torch.eye(4).unsqueeze(0) * 20  # (1, L=4, D=4): cell i holds 20·e_i
    head = nn.Linear(4, 4, bias=False)
    head.weight.data = torch.eye(4)  # class logits = the pooled feature
    objects = torch.tensor([[[2, -1, 0.0, 0.5, 0.5, 1.0],  # bottom-left cell (index 2), class 2, no colour
                             [1, 0, 0.5, 0.0, 1.0, 0.5],  # top-right cell (index 1), class 1, colour 0
                             [-1, -1, 0, 0, 0, 0]]])  # padding
    colour_head = nn.Linear(4, 2, bias=False)
    colour_head.weight.data = torch.tensor([[0.0, 1, 0, 0], [0, 0, 0, 0]])  # colour 0 where cell 1 is lit
    result = object_loss(annotations, (2, 2), objects, head, colour_head)
    assert result.objects == 2
    assert result.accuracy.item() == 1.0
    assert result.loss.item() < 1e-6
    wrong = objects.clone()
    wrong[0, 0, 0] = 3  # the bottom-left object said to be class 3: read as 2, so wrong and a large loss
    missed = object_loss(annotations, (2, 2), wrong, head, colour_head)
    assert missed.accuracy.item() == 0.5 and missed.loss.item() > 5
    # gradients reach the annotation vectors under the boxes only
    features = annotations.clone().requires_grad_(True)
    object_loss(features, (2, 2), wrong, head, colour_head).loss.backward()
    assert features.grad[0, 2].abs().sum() > 0 and features.grad[0, 3].abs().sum() == 0
    empty = object_loss(annotations, (2, 2), torch.full((1, 1, 6), -1.0), head)
    assert empty.objects == 0 and empty.loss.item() == 0


def test_pad_objects_pads_with_class_minus_one():
    padded = pad_objects([torch.ones(2, 6), torch.zeros(0, 6)])
    assert padded.shape == (2, 2, 6)
    assert (padded[1, :, 0] == -1).all() and (padded[0] == 1).all()


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("scenes")
    make_scenes(root, counts={"train": 12, "val": 4, "test": 4}, styles={"train": {"layout": "mixed"}})
    return root


def test_object_targets_hold_the_instances_boxes_classes_and_colours(scenes):
    instances = json.loads((scenes / "annotations" / "instances_train.json").read_text())
    attributes = json.loads((scenes / "annotations" / "attributes_train.json").read_text())
    targets = read_object_targets(scenes / "annotations" / "instances_train.json",
                                  scenes / "annotations" / "attributes_train.json")
    assert targets.classes == CLASS_WORDS and targets.colours == list(COLOURS)
    colour_of = {entry["id"]: entry["colour"] for entry in attributes["instances"]}
    sizes = {image["id"]: (image["width"], image["height"]) for image in instances["images"]}
    for annotation in instances["annotations"]:
        rows = targets.per_image[annotation["image_id"]]
        label = annotation["category_id"] - 1
        row = rows[rows[:, 0] == label]
        assert len(row) == 1  # no two items of a scene share a class
        x, y, w, h = annotation["bbox"]
        width, height = sizes[annotation["image_id"]]
        torch.testing.assert_close(row[0, 2:], torch.tensor([x / width, y / height, (x + w) / width,
                                                             (y + h) / height]))
        assert targets.colours[int(row[0, 1])] == colour_of[annotation["id"]]
    no_colours = read_object_targets(scenes / "annotations" / "instances_train.json")
    assert no_colours.colours == [] and all((rows[:, 1] == -1).all() for rows in no_colours.per_image.values())


def test_datamodule_batches_carry_each_images_objects(scenes):
    data = CocoCaptionsDataModule(str(scenes), image_size=96, loader={"batch_size": 4}, group_captions=True,
                                  object_targets=True)
    assert data.object_classes == CLASS_WORDS and data.object_colours == list(COLOURS)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch.objects.shape[0] == 4 and batch.objects.shape[2] == 6
    counts = (batch.objects[..., 0] >= 0).sum(1)
    assert ((counts >= 2) & (counts <= 3)).all()  # 2 or 3 items per scene
    plain = CocoCaptionsDataModule(str(scenes), image_size=96, loader={"batch_size": 4})
    assert plain.object_classes == [] and plain.object_colours == []
    plain.setup("fit")
    assert next(iter(plain.train_dataloader())).objects is None


def test_object_targets_without_an_instances_file_is_one_line(tmp_path):
    root, plain = tmp_path / "no_instances", tmp_path / "plain"
    make_scenes(root, counts={"train": 4, "val": 2, "test": 2})
    make_scenes(plain, counts={"train": 4, "val": 2, "test": 2})
    (root / "annotations" / "instances_train.json").unlink()
    result = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                            str(root), "--data.init_args.object_targets", "true",
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert "instances_train.json" in error and "object_targets" in error and "Traceback" not in result.stderr
    for option in ("object", "grounding"):
        result = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                                str(plain), "--model.init_args.objective.auxiliary", f"[{option}]",
                                "--trainer.default_root_dir", str(tmp_path / "run2"))
        assert result.returncode != 0
        error = result.stderr.strip().splitlines()[-1]
        assert f"auxiliary.{option} needs" in error and "object_targets: true" in error, error
        assert "Traceback" not in result.stderr


def test_a_fit_with_the_object_loss_learns_and_its_checkpoint_captions_without_the_heads(scenes, tmp_path):
    """Through the CLI, with grounding and self-critical training too: both losses are logged in training, and
    the heads stay out of the captioner."""
    from vision_attn.captioning.captioner import Captioner

    run = tmp_path / "run"
    result = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                            str(scenes), "--data.init_args.object_targets", "true", "--data.init_args.group_captions",
                            "true", "--model.init_args.objective.auxiliary", "[object, grounding]",
                            "--model.init_args.decoder.output_terms", "[word_counts]",
                            "--model.init_args.decoder.attention_inputs", "[previous_word]",
                            "--model.init_args.self_critical.from_epoch", "1",
                            "--model.init_args.self_critical.samples", "2", "--trainer.max_epochs", "2",
                            "--data.init_args.scenes.styles", '{"train": {"layout": "mixed"}}',
                            "--trainer.default_root_dir", str(run), "--trainer.log_every_n_steps", "1",
                            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                            "--trainer.logger.save_dir", str(run))
    assert result.returncode == 0, result.stderr[-2000:]
    logged = next(run.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "train/object_loss" in logged and "train/object_acc" in logged and "train/grounding_loss" in logged
    checkpoint = next(run.rglob("best.ckpt"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["state_dict"]["auxiliary.object.head.weight"].shape[0] == len(CLASS_WORDS)
    assert state["state_dict"]["auxiliary.object.colour_head.weight"].shape[0] == len(COLOURS)
    captioner = Captioner.from_checkpoint(checkpoint)
    assert not any("object" in name for name in captioner.state_dict())


@pytest.mark.parametrize("trainable_stages", [-1, 0], ids=["encoder_trains", "encoder_frozen"])
def test_every_trainable_parameter_is_optimised_the_training_aids_heads_too(trainable_stages):
    """The concept, object and colour heads are the LightningModule's, not the captioner's: they must still be in
    the optimiser's groups (once each), or their losses train the encoder against fixed random heads."""
    from vision_attn.tasks import CaptionerTask

    module = CaptionerTask(vocabulary=[*SPECIALS, "a", *CLASS_WORDS, *COLOURS], image={"size": 96},
                           encoder={"width": 8, "trainable_stages": trainable_stages},
                           decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                           objective={"auxiliary": ["concept", "object", "grounding"]},
                           objects={"classes": list(CLASS_WORDS), "colours": list(COLOURS)})
    grouped = [id(p) for group in module.parameter_groups() for p in group["params"]]
    trainable = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == set(trainable), sorted(trainable[i] for i in set(trainable) - set(grouped))
    assert any(name.startswith("auxiliary.object.colour_head") for name in trainable.values())


def test_grounding_targets_point_each_naming_word_at_its_objects_box():
    """"a red sneaker next to a white bag": "red" and "sneaker" look at the sneaker's box, "white" and "bag" at
    the bag's; "a", "next", "to" at nothing; a colour word not just before its object's class word names nothing."""
    words = ["<pad>", "a", "red", "sneaker", "next", "to", "white", "bag", "blue", "top"]
    ids = {word: index for index, word in enumerate(words)}
    tokens = torch.tensor([[ids[w] for w in "a red sneaker next to a white bag".split()],
                           [ids[w] for w in "a white sneaker next to a red bag".split()]])  # colours swapped
    class_word_ids = torch.tensor([ids["top"], ids["sneaker"], ids["bag"]])  # classes 0, 1, 2
    colour_word_ids = torch.tensor([ids["red"], ids["white"], ids["blue"]])  # colours 0, 1, 2
    sneaker = [1, 0, 0.0, 0.0, 0.5, 0.5]  # class 1, red, top-left cell of a 2×2 grid
    bag = [2, 1, 0.5, 0.5, 1.0, 1.0]  # class 2, white, bottom-right cell
    objects = torch.tensor([[sneaker, bag, [-1, -1, 0, 0, 0, 0]]] * 2)
    target, mask = grounding_targets(tokens, objects, (2, 2), class_word_ids, colour_word_ids)
    assert mask[0].tolist() == [False, True, True, False, False, False, True, True]
    torch.testing.assert_close(target[0, 1], torch.tensor([1.0, 0, 0, 0]))  # red -> the sneaker
    torch.testing.assert_close(target[0, 2], torch.tensor([1.0, 0, 0, 0]))  # sneaker
    torch.testing.assert_close(target[0, 7], torch.tensor([0.0, 0, 0, 1]))  # bag
    assert mask[1].tolist() == [False, False, True, False, False, False, False, True]  # wrong colours name nothing
    alphas = torch.full((2, 8, 4), 0.25)
    assert grounding_loss(alphas, target, mask).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    on_target = target.clone()
    on_target[~mask] = 0.25
    assert grounding_loss(on_target.clamp_min(1e-9), target, mask).item() < 1e-6
    without_colours = grounding_targets(tokens, objects, (2, 2), class_word_ids)[1]
    assert without_colours[0].tolist() == [False, False, True, False, False, False, False, True]


def test_the_inside_grounding_target_asks_little_of_the_cells_a_box_only_grazes() -> None:
    """A box over columns 0.25..0.75 and rows 0..0.5 of a 4×2 grid (cells 0.25 wide, 0.5 high) fills cells 1 and
    2 and covers nothing else: both targets split it evenly. A box from x 0.2 to 0.5 has 1/6 of its area in cell
    0, which it fills a fifth of, and 5/6 in cell 1, which it fills whole: "box" asks for 1/6 and 5/6, "inside"
    for (1/6 · 1/5) : (5/6 · 1) = 1 : 25."""
    words = ["<pad>", "a", "bag"]
    tokens = torch.tensor([[1, 2]])
    for box, expected_box, expected_inside in (
            ([0.25, 0.0, 0.75, 0.5], [0, 0.5, 0.5, 0, 0, 0, 0, 0], [0, 0.5, 0.5, 0, 0, 0, 0, 0]),
            ([0.2, 0.0, 0.5, 0.5], [1 / 6, 5 / 6, 0, 0, 0, 0, 0, 0], [1 / 26, 25 / 26, 0, 0, 0, 0, 0, 0])):
        objects = torch.tensor([[[0, 0, *box]]])
        class_word_ids = torch.tensor([words.index("bag")])
        plain, mask = grounding_targets(tokens, objects, (2, 4), class_word_ids)
        inside, same_mask = grounding_targets(tokens, objects, (2, 4), class_word_ids, inside=True)
        assert mask.tolist() == same_mask.tolist() == [[False, True]]
        torch.testing.assert_close(plain[0, 1], torch.tensor(expected_box))
        torch.testing.assert_close(inside[0, 1], torch.tensor(expected_inside))


def _scenes_captioner(pretrained: str | None = None, classes: list[str] = CLASS_WORDS, **options):
    from vision_attn.tasks import CaptionerTask

    return CaptionerTask(vocabulary=[*SPECIALS, "a", *CLASS_WORDS, *COLOURS],
                         image={"size": 96, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
                         encoder={"width": 24, "pretrained": pretrained},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         objective={"auxiliary": [{"name": "object", "weight": 1.0, **options}]},
                         objects={"classes": list(classes), "colours": list(COLOURS)})


def test_object_heads_start_from_the_pretrained_classifier_heads(pretrained_encoder):
    """The object loss's ``heads_from_encoder``: the object class and colour heads are the pretraining's, so the object
    loss     of a box reads what the pretrained encoder read of an item; without it they are new."""
    state = torch.load(pretrained_encoder, map_location="cpu", weights_only=False)["state_dict"]
    started = _scenes_captioner(str(pretrained_encoder), heads_from_encoder=True)
    fresh = _scenes_captioner(str(pretrained_encoder))
    heads = started.auxiliary.object
    for head, key in ((heads.head, "model.head"), (heads.colour_head, "model.colour_head")):
        torch.testing.assert_close(head.weight, state[f"{key}.weight"])
        torch.testing.assert_close(head.bias, state[f"{key}.bias"])
    assert not torch.equal(fresh.auxiliary.object.head.weight, state["model.head.weight"])
    # the heads read the trunk's pooled vectors exactly as the pretraining's classifier did
    from vision_attn.captioning.encoder import EncoderClassifier

    classifier = EncoderClassifier(width=24, num_classes=len(CLASS_WORDS), num_colours=len(COLOURS))
    classifier.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    classifier.eval()
    started.eval()
    images = torch.rand(2, 3, 32, 32)
    pooled = started.model.encoder(images)[0].mean(dim=1)
    class_logits, colour_logits = classifier(images)
    torch.testing.assert_close(heads.head(pooled), class_logits)
    torch.testing.assert_close(heads.colour_head(pooled), colour_logits)


def test_object_heads_from_encoder_refuses_what_it_cannot_start_from(pretrained_encoder, tmp_path):
    with pytest.raises(ValueError, match="needs encoder.pretrained"):
        _scenes_captioner(heads_from_encoder=True)
    from vision_attn.errors import CheckpointError

    trunk_only = tmp_path / "trunk.pt"  # the same trunk as a bare state dict: nothing to read classes with
    state = torch.load(pretrained_encoder, map_location="cpu", weights_only=False)["state_dict"]
    torch.save({k: v for k, v in state.items() if "head" not in k}, trunk_only)
    with pytest.raises(CheckpointError, match="not an encoder pretraining checkpoint with class heads"):
        _scenes_captioner(str(trunk_only), heads_from_encoder=True)
    with pytest.raises(CheckpointError, match="are not this captioner's object classes"):
        _scenes_captioner(str(pretrained_encoder), heads_from_encoder=True,
                          classes=list(reversed(CLASS_WORDS)))
