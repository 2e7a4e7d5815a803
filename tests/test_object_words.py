"""Object words and the object metrics on COCO-format data: which caption words name which category (synonyms,
plurals, phrases), and CHAIR, object recall, pointing and the α mass in the box and in the segmentation mask, on a
fixture whose answers are known by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vision_attn.data.object_words import ObjectWords, built_in, object_words
from vision_attn.data.vocabulary import tokenize


def test_the_coco_table_maps_plurals_synonyms_and_phrases_to_categories_the_longest_phrase_first() -> None:
    coco = built_in("coco")
    assert len(coco.categories) == 80
    tokens = tokenize("Two men hold a teddy bear and a hot dog near the dogs and a cellphone")
    assert coco.mentions(tokens) == [(1, "person"), (5, "teddy bear"), (9, "hot dog"), (12, "dog"),
                                     (15, "cell phone")]
    assert coco.named_in(["A woman rides a bike.", "Some people on bicycles"]) == {"person", "bicycle"}
    assert coco.mentions(tokenize("a cat on a mat")) == [(1, "cat")]
    scenes = built_in("scenes")
    assert scenes.mentions(["a", "red", "top", "and", "a", "bag"]) == [(2, "top"), (5, "bag")]


def test_a_users_table_is_read_and_a_bad_one_refused_in_one_line(tmp_path) -> None:
    table = tmp_path / "words.json"
    table.write_text(json.dumps({"categories": {"mug": ["mug", "mugs", "coffee cup"]}}))
    assert object_words(table).mentions(tokenize("Mugs and a coffee cup")) == [(0, "mug"), (4, "mug")]
    for bad, message in [({"categories": {}}, "at least one category"),
                         ({"categories": {"mug": []}}, "non-empty list of phrases"),
                         ({"categories": {"mug": ["cup"], "bowl": ["cup"]}}, "names both 'mug' and 'bowl'")]:
        table.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message) as raised:
            object_words(table)
        assert "\n" not in str(raised.value)
    with pytest.raises(FileNotFoundError, match="no such file .an object-words table was expected."):
        object_words(tmp_path / "missing.json")
    assert ObjectWords({"a": ["x y"]}).longest == 2


def write_fixture(root: Path) -> dict[str, Path]:
    """Two 100×100 images. Image 1: a person (box and mask: the left half) and a dog (bottom-right quarter),
    referenced as "a man with his dog". Image 2: a cat whose box is the whole image and whose mask is the top-left
    quarter, referenced as "a cat sitting on a bed" (no bed among the instances). The results put α on a 2×2
    grid: "men" on the two left cells, "cat" of image 2 half on the top-left cell, half on the top-right."""
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 100, "height": 100} for i in (1, 2)]
    categories = [{"id": 1, "name": "person"}, {"id": 17, "name": "cat"}, {"id": 18, "name": "dog"},
                  {"id": 59, "name": "bed"}]

    def square(x0: int, y0: int, x1: int, y1: int) -> list[list[int]]:
        return [[x0, y0, x1, y0, x1, y1, x0, y1]]

    annotations = [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 50, 100], "area": 5000, "iscrowd": 0,
         "segmentation": square(0, 0, 50, 100)},
        {"id": 2, "image_id": 1, "category_id": 18, "bbox": [50, 50, 50, 50], "area": 2500, "iscrowd": 0,
         "segmentation": square(50, 50, 100, 100)},
        {"id": 3, "image_id": 2, "category_id": 17, "bbox": [0, 0, 100, 100], "area": 2500, "iscrowd": 0,
         "segmentation": square(0, 0, 50, 50)},
    ]
    captions = {"images": images, "annotations": [
        {"id": 1, "image_id": 1, "caption": "a man with his dog"},
        {"id": 2, "image_id": 2, "caption": "a cat sitting on a bed"}]}
    instances = {"images": images, "annotations": annotations, "categories": categories}
    results = [
        {"image_id": 1, "caption": "two men and a cat", "tokens": ["two", "men", "and", "a", "cat"], "grid": [2, 2],
         "image_size": [100, 100], "file_name": "1.jpg", "betas": [1.0] * 5,
         "alphas": [[0.25] * 4, [0.5, 0.0, 0.5, 0.0], [0.25] * 4, [0.25] * 4, [0.0, 1.0, 0.0, 0.0]]},
        {"image_id": 2, "caption": "a cat on a bed", "tokens": ["a", "cat", "on", "a", "bed"], "grid": [2, 2],
         "image_size": [100, 100], "file_name": "2.jpg", "betas": [1.0] * 5,
         "alphas": [[0.25] * 4, [0.5, 0.5, 0.0, 0.0], [0.25] * 4, [0.25] * 4, [0.25] * 4]},
    ]
    paths = {name: root / f"{name}.json" for name in ("captions", "instances", "results")}
    for name, content in (("captions", captions), ("instances", instances), ("results", results)):
        paths[name].write_text(json.dumps(content))
    return paths


def test_evaluate_with_the_coco_words_gives_the_hand_known_chair_recall_pointing_and_mask_mass(tmp_path,
                                                                                               capsys) -> None:
    """Mentions: "men" (person, present), "cat" in image 1 (absent: hallucinated), "cat" and "bed" in image 2
    (the bed is in no instance but its references name it: present, as CHAIR counts it). CHAIRi 1/4, CHAIRs 1/2.
    Pointing counts the two mentions with instances: both hit; α mass in the boxes 1 and 1; in the masks 1 ("men":
    α inside the mask and nowhere else) and 0.5 (half of the cat's α on its mask). Recall: person and cat of the
    three categories present, 2/3."""
    from vision_attn.cli import main

    paths = write_fixture(tmp_path)
    out = tmp_path / "scores.json"
    main(["evaluate", str(paths["results"]), "--annotations", str(paths["captions"]), "--instances",
          str(paths["instances"]), "--words", "coco", "--out", str(out)])
    scores = json.loads(out.read_text())
    assert scores["CHAIRi"] == 0.25 and scores["CHAIRs"] == 0.5 and scores["object_mentions"] == 4
    assert scores["pointing_words"] == 2 and scores["pointing_accuracy"] == 1.0
    assert scores["alpha_mass_in_box"] == pytest.approx(1.0) and scores["alpha_mass_in_mask"] == pytest.approx(0.75)
    assert scores["object_recall"] == pytest.approx(2 / 3) and scores["object_precision"] == 0.5
    printed = capsys.readouterr().out
    assert "CHAIRi" in printed and "alpha_mass_in_mask" in printed
    # without --words: the scenes' class words name nothing here, and no CHAIR
    main(["evaluate", str(paths["results"]), "--annotations", str(paths["captions"]), "--instances",
          str(paths["instances"]), "--out", str(tmp_path / "plain.json")])
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert "CHAIRi" not in plain and plain["pointing_words"] == 0


def test_a_mask_that_misses_the_attention_scores_zero_and_several_boxes_count_as_their_union(tmp_path) -> None:
    from vision_attn.metrics import box_coverage, pointing_scores

    record = {"image_id": 1, "tokens": ["a", "dog"], "grid": [2, 2], "image_size": [100, 100],
              "alphas": [[0.25] * 4, [0.0, 0.0, 0.0, 1.0]]}
    boxes = {1: [("dog", [0, 0, 50, 50]), ("dog", [50, 50, 50, 50])]}  # two dogs: top-left and bottom-right
    scores = pointing_scores([record], boxes, words=built_in("coco"),
                             masks=lambda image_id, category: __import__("torch").zeros(100, 100, dtype=bool))
    assert scores["pointing_accuracy"] == 1.0 and scores["alpha_mass_in_box"] == pytest.approx(1.0)
    assert scores["alpha_mass_in_mask"] == 0.0
    union = box_coverage([(0, 0, 50, 50), (50, 50, 100, 100)], (2, 2), (100, 100))
    assert union.tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_evaluate_refuses_words_without_instances_and_an_unknown_table_in_one_line(tmp_path, capsys) -> None:
    from vision_attn.cli import main

    paths = write_fixture(tmp_path)
    for extra, message in ((["--words", "coco"], "--words goes with --instances"),
                           (["--instances", str(paths["instances"]), "--words", str(tmp_path / "none.json")],
                            "none.json")):
        with pytest.raises(SystemExit):
            main(["evaluate", str(paths["results"]), "--annotations", str(paths["captions"]), *extra,
                  "--out", str(tmp_path / "s.json")])
        error = capsys.readouterr().err
        assert message in error and error.count("\n") <= 2 and "Traceback" not in error
        assert not (tmp_path / "s.json").exists()


def test_the_datamodule_reads_its_table_and_scales_the_instances_boxes_to_the_network_input(tmp_path) -> None:
    from vision_attn.datamodules import CocoCaptionsDataModule

    paths = write_fixture(tmp_path)
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    for split in ("train", "val", "test"):
        (annotations / f"captions_{split}.json").write_text(paths["captions"].read_text())
        (tmp_path / "images" / split).mkdir(parents=True)
    (annotations / "instances_test.json").write_text(paths["instances"].read_text())
    data = CocoCaptionsDataModule(str(tmp_path), image_size=50, layout={"object_words": "coco"})
    assert data.object_words is built_in("coco")
    assert data.box_scale("test") == {1: (0.5, 0.5), 2: (0.5, 0.5)} and data.box_scale("val") == {}
    assert [o.name for o in data.records("test")[0].objects] == ["person", "dog"]


def test_the_grounding_aid_finds_a_category_by_any_of_its_table_words() -> None:
    """With the coco table, the person class is named by "men" and the dog class by "puppy": each looks at its
    object's box; a class named by no word of the vocabulary names nothing."""
    import torch

    from vision_attn.captioning.extensions.grounding import Grounding, GroundingOptions
    from vision_attn.captioning.options import ObjectNames
    from vision_attn.data.vocabulary import SPECIALS, Vocabulary

    vocab = Vocabulary([*SPECIALS, "two", "men", "and", "a", "puppy"])
    coco = built_in("coco")
    classes = ["person", "dog", "giraffe"]
    words = [coco.single_words(name) for name in classes]
    term = Grounding(GroundingOptions(), objects=ObjectNames(classes=classes, class_words=words), vocab=vocab)
    tokens = torch.tensor([[vocab.id(w) for w in "two men and a puppy".split()]])
    person, dog = [0, -1, 0.0, 0.0, 0.5, 0.5], [1, -1, 0.5, 0.5, 1.0, 1.0]  # top-left and bottom-right cells
    from vision_attn.captioning.extensions.grounding import grounding_targets

    target, mask = grounding_targets(tokens, torch.tensor([[person, dog]]), (2, 2), term.class_word_ids)
    assert mask[0].tolist() == [False, True, False, False, True]
    assert target[0, 1].tolist() == [1.0, 0.0, 0.0, 0.0] and target[0, 4].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert term.class_word_ids[2].tolist() == [-1] * term.class_word_ids.shape[1]  # no giraffe word here


def test_one_object_named_twice_under_two_names_is_counted() -> None:
    """"a white shirt and a white dress" with both words' α on the shirt: the caption names one object twice; a
    caption whose two words look at their own objects does not."""
    from vision_attn.metrics import pointing_scores

    boxes = {1: [("shirt", [0, 0, 50, 50]), ("dress", [50, 50, 50, 50])]}
    tokens = ["a", "white", "shirt", "and", "a", "white", "dress"]
    on_shirt, on_dress, flat = [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.25] * 4
    twice = {"image_id": 1, "tokens": tokens, "grid": [2, 2], "image_size": [100, 100],
             "alphas": [flat, flat, on_shirt, flat, flat, flat, on_shirt]}
    apart = {**twice, "image_id": 1, "alphas": [flat, flat, on_shirt, flat, flat, flat, on_dress]}
    words = ObjectWords({"shirt": ["shirt"], "dress": ["dress"]})
    assert pointing_scores([twice], boxes, words=words)["object_named_twice_rate"] == 1.0
    assert pointing_scores([apart], boxes, words=words)["object_named_twice_rate"] == 0.0
    assert pointing_scores([twice, apart], boxes, words=words)["object_named_twice_rate"] == 0.5
