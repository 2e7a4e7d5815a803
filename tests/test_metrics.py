"""Caption metrics through pycocoevalcap (with and without Java) and pointing accuracy by hand."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import pytest

from vision_attn import metrics
from vision_attn.metrics import caption_scores, deduplicate, java_available, pointing_scores, word_order_rates

REFERENCES = {
    1: ["a red sneaker to the left of a white bag", "a white bag to the right of a red sneaker"],
    2: ["a blue coat above a green boot", "a green boot below a blue coat"],
    3: ["there is a yellow dress and a red top", "a yellow dress next to a red top"],
}
EXPECTED_KEYS = {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D"}


@pytest.mark.skipif(not metrics.java_available(), reason="Java is part of the set-up; this machine has none")
def test_all_coco_metrics_with_java_rank_good_captions_above_bad_ones() -> None:
    good = caption_scores({k: v[0] for k, v in REFERENCES.items()}, REFERENCES)
    bad = caption_scores({1: "a dog on a sofa", 2: "two cats", 3: "a man riding a horse"}, REFERENCES)
    assert set(good) == EXPECTED_KEYS
    assert good["BLEU-4"] == pytest.approx(1.0, abs=1e-6)
    assert all(good[key] > bad[key] for key in EXPECTED_KEYS)


@pytest.mark.skipif(not metrics.java_available(), reason="Java is part of the set-up; this machine has none")
def test_one_scoring_starts_the_ptb_tokenizer_once_and_tokenizes_as_two_runs_would(monkeypatch, tmp_path) -> None:
    """References and candidates go through one tokenizer run (each Java start costs a fraction of a second); the
    tokens are those of one run each, empty and multi-line captions included."""
    import shutil

    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    log = tmp_path / "java.log"
    wrapper = tmp_path / "bin" / "java"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("java")} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    references = {**REFERENCES, 4: ["A coat, then (a bag)!", "two\nlines"], 5: ["it's a U.S. bag", ""]}
    predictions = {1: "A red sneaker.", 2: "", 3: "a yellow dress -- and a red top", 4: "a coat", 5: "naïve bag"}
    metrics.meteor_scorer()  # started before the count: METEOR is one process for the whole run
    scores = caption_scores(predictions, references)
    tokenizer_runs = [line for line in log.read_text().splitlines() if "PTBTokenizer" in line]
    assert len(tokenizer_runs) == 1 and set(scores) == EXPECTED_KEYS

    def one_run(captions: dict) -> dict:
        return PTBTokenizer().tokenize({k: [{"caption": c} for c in v] for k, v in captions.items()})

    separately = (one_run(references), one_run({k: [v] for k, v in predictions.items()}))
    assert scores["CIDEr-D"] == float(Cider().compute_score(*separately)[0])
    assert scores["BLEU-4"] == float(Bleu(4).compute_score(*separately, verbose=0)[0][3])


def test_without_java_meteor_is_skipped_with_one_warning(monkeypatch, tmp_path: Path, caplog) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no java on it
    monkeypatch.setattr(metrics, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="vision_attn.metrics"):
        first = caption_scores({k: v[0] for k, v in REFERENCES.items()}, REFERENCES)
        caption_scores({k: v[1] for k, v in REFERENCES.items()}, REFERENCES)
    assert set(first) == EXPECTED_KEYS - {"METEOR"}
    assert first["BLEU-4"] == pytest.approx(1.0, abs=1e-6)
    java_warnings = [r for r in caplog.records if "Java not found" in r.getMessage()]
    assert len(java_warnings) == 1
    assert os.environ["PATH"] == str(tmp_path)


def test_predictions_without_references_are_refused() -> None:
    with pytest.raises(ValueError, match="no references, e.g. image id 9"):
        caption_scores({9: "a bag"}, REFERENCES)


def test_deduplicate_keeps_one_result_per_image() -> None:
    gathered = [{"image_id": 1, "caption": "a"}, {"image_id": 2, "caption": "b"}, {"image_id": 1, "caption": "a"}]
    assert deduplicate(gathered) == [{"image_id": 1, "caption": "a"}, {"image_id": 2, "caption": "b"}]


def _record(tokens, alphas, grid=(3, 3), size=(96, 96)) -> dict:
    return {"image_id": 7, "tokens": tokens, "grid": list(grid), "image_size": list(size), "alphas": alphas}


def one_hot(cell: int, cells: int = 9) -> list[float]:
    return [1.0 if i == cell else 0.0 for i in range(cells)]


def test_pointing_accuracy_and_mass_by_hand() -> None:
    boxes = {7: [("sneaker", [0, 0, 28, 28]), ("bag", [64, 64, 30, 30])]}  # cells (0, 0) and (2, 2) of 32 px
    record = _record(
        ["a", "red", "sneaker", "left", "of", "a", "bag", "and", "coat"],
        [one_hot(4)] * 2 + [one_hot(0)] + [one_hot(4)] * 3 + [one_hot(4)] + [one_hot(4)] * 2,
    )
    scores = pointing_scores([record], boxes)
    # counted words: "sneaker" (hit: centre (16, 16) in the box) and "bag" (miss: centre (48, 48) is outside
    # the box grown by 16 px = [48, 48]..; on the edge counts as inside) -> choose cell 4 centre (48, 48)
    assert scores["pointing_words"] == 2  # "coat" is not in the scene, the other words are not class words
    assert scores["pointing_accuracy"] == pytest.approx(1.0)  # (48, 48) lies on the grown box's edge
    # mass: sneaker cell (0,0) covers [0,32)² and the box [0,28]² -> 28²/32²; bag: cell (1,1) misses [64,94]
    assert scores["alpha_mass_in_box"] == pytest.approx((28 * 28 / (32 * 32) + 0.0) / 2)


def test_pointing_by_mention_splits_by_scene_size_and_class_word_order() -> None:
    from vision_attn.metrics import pointing_by_mention

    boxes = {7: [("sneaker", [0, 0, 28, 28]), ("bag", [70, 70, 20, 20])]}
    # "sneaker" (1st mention) hits at cell 0; "bag" (2nd) misses at cell 4; "coat" is not in the scene
    record = _record(["a", "sneaker", "and", "a", "bag", "coat"], [one_hot(4), one_hot(0)] + [one_hot(4)] * 4)
    split = pointing_by_mention([record], boxes)
    assert sorted(split) == [(2, 1), (2, 2), (2, 3)]
    assert split[(2, 1)]["pointing_accuracy"] == 1.0 and split[(2, 1)]["pointing_words"] == 1
    assert split[(2, 2)]["pointing_accuracy"] == 0.0 and split[(2, 2)]["pointing_words"] == 1
    assert split[(2, 3)]["pointing_words"] == 0  # a class word of an object the scene does not hold


def test_pointing_miss_outside_the_grown_box() -> None:
    boxes = {7: [("bag", [70, 70, 20, 20])]}  # grown by 16 px: [54, 106]; cell 4 centre (48, 48) is out
    scores = pointing_scores([_record(["bag"], [one_hot(4)])], boxes)
    assert scores["pointing_accuracy"] == 0.0 and scores["alpha_mass_in_box"] == 0.0


def test_pointing_with_scaled_boxes_and_no_class_words() -> None:
    boxes = {7: [("boot", [0, 0, 10, 10])]}  # original image 3x smaller than the network input
    record = _record(["boot"], [[0.5, 0.5] + [0.0] * 7])
    scores = pointing_scores([record], boxes, box_scale={7: (3.0, 3.0)})
    assert scores["pointing_accuracy"] == 1.0
    assert scores["alpha_mass_in_box"] == pytest.approx(0.5 * (30 * 30) / (32 * 32) + 0.0)
    empty = pointing_scores([_record(["a", "thing"], [one_hot(0)] * 2)], boxes)
    assert empty["pointing_words"] == 0


def test_cider_d_reward_equals_pycocoevalcap_cider_with_the_same_document_frequencies() -> None:
    import random

    from pycocoevalcap.cider.cider import Cider

    rng = random.Random(0)
    words = "a red green blue white bag top sneaker boot next to the left of right above below there is and".split()
    references = {i: [" ".join(rng.choices(words, k=rng.randint(4, 12))) for _ in range(5)] for i in range(40)}
    candidates = {i: [" ".join(rng.choices(words, k=rng.randint(1, 12)))] for i in range(40)}
    candidates[0] = [references[0][2]]  # an exact copy of one reference
    expected_mean, expected = Cider().compute_score(references, candidates)
    reward = metrics.CiderD([[r.split() for r in refs] for refs in references.values()])
    ours = reward([candidates[i][0].split() for i in range(40)],
                  [[r.split() for r in references[i]] for i in range(40)])
    assert ours == pytest.approx(list(expected), abs=1e-9)
    assert sum(ours) / len(ours) == pytest.approx(expected_mean, abs=1e-9)
    assert ours[0] > max(ours[1:])  # the copy of a reference scores above every random word string
    with pytest.raises(ValueError, match="corpus of references"):
        metrics.CiderD([])


def test_scene_scores_on_hand_made_captions() -> None:
    import math

    from vision_attn.metrics import scene_scores

    scenes = {1: [("sneaker", "red"), ("bag", "white")], 2: [("top", "blue"), ("boot", "green"), ("coat", "red")],
              3: [("dress", "yellow"), ("shirt", "green")]}
    records = [
        {"image_id": 1, "tokens": "a red sneaker to the left of a white bag".split()},  # all right
        # omits the coat and names its one boot twice
        {"image_id": 2, "tokens": "a blue top next to a green boot and a green boot".split()},
        {"image_id": 3, "tokens": "a red dress next to a green sandal".split()},  # miscoloured dress, invents sandal
    ]
    scores = scene_scores(records, scenes)
    assert scores["object_recall"] == 5 / 7  # sneaker, bag, top, boot, dress of 7 objects
    assert scores["object_precision"] == 6 / 7  # every emitted class word but the invented sandal
    assert scores["colour_accuracy"] == 5 / 6  # the red dress is yellow
    assert scores["repeated_object_rate"] == 1 / 3  # the second caption names its one boot twice
    unknown = scene_scores([{"image_id": 1, "tokens": ["a", "bag"]}], {1: [("bag", None)]})
    assert unknown["object_recall"] == 1.0 and math.isnan(unknown["colour_accuracy"])
    empty = scene_scores([], {})
    assert all(math.isnan(value) for value in empty.values())


@pytest.mark.skipif(not java_available(), reason="METEOR runs on Java")
def test_one_meteor_process_serves_every_scoring_and_a_dead_one_is_replaced() -> None:
    """Scoring twice starts Java once (each start costs seconds); if that process has ended, the next scoring
    starts another and still scores."""
    from vision_attn.metrics import meteor_scorer

    predictions, references = {1: "a red bag"}, {1: ["a red bag", "a bag that is red"]}
    first = caption_scores(predictions, references)
    process = meteor_scorer().meteor_p
    second = caption_scores(predictions, references)
    assert meteor_scorer().meteor_p is process and first == second
    process.kill()
    process.wait()
    assert caption_scores(predictions, references) == first and meteor_scorer().meteor_p is not process


def test_a_caption_is_unfinished_when_it_ends_on_a_word_the_references_use_but_never_last() -> None:
    references = ["a red coat next to a blue bag", "there is a red coat and a blue bag"]
    records = [{"caption": caption, "references": references} for caption in (
        "a red coat next to a blue bag",  # ends as a reference does
        "a red coat next",                # "next" is always followed by a word
        "a red coat and a blue",          # a colour with no garment after it
        "",                               # says nothing
        "a red zebra",                    # a word the references never use: not counted
    )]
    assert word_order_rates(records)["unfinished_caption_rate"] == 3 / 5
    assert math.isnan(word_order_rates([])["unfinished_caption_rate"])


def test_a_caption_with_two_words_no_reference_puts_side_by_side_counts_as_an_unseen_pair() -> None:
    references = ["there is a red coat and a blue bag", "a blue bag on its own"]
    records = [{"caption": caption, "references": references} for caption in (
        "there is a red coat and a blue bag on its own",  # every pair is in one reference or the other
        "there is a red coat and a with a own",  # "a with", "with a", "a own": never side by side
        "a red coat and and a blue bag",         # "and and"
        "a red zebra",                           # "zebra" is no reference's word: not counted
        "",                                      # no pair
    )]
    assert word_order_rates(records)["unseen_pair_rate"] == 2 / 5
    assert math.isnan(word_order_rates([])["unseen_pair_rate"])
