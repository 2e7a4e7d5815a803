"""Causal tests of attention: the captioner's erasure test and the ViT's deletion curves, first on hand-built cases
whose answer is known (a scorer or classifier written here that reads only chosen pixels), then end to end through
`vision-attn erasure` and `vision-attn deletion` on the session's small checkpoints, with their one-line errors."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.conftest import REPO, run_in_process
from tests.test_output_folders import one_line_error
from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.erasure import (
    caption_ids,
    captioner_scorer,
    erase_and_score,
    erase_box,
    plan_erasures,
    read_scenes,
    scene_pixels,
    summarise,
)
from vision_attn.data.images import normalize
from vision_attn.vit.rollout_mass import curve_area, deletion_curves, erase_steps

LEGACY_CAPTIONER = REPO / "tests" / "fixtures" / "legacy" / "captioner.ckpt"  # it names garments; the fixture's not yet

# --- the erasure test on a hand-built scene ------------------------------------------------------------------------

SIZE, GRID = 32, (4, 4)  # 8-pixel cells
COAT, BAG, SHOE = (0.0, 0.0, 8.0, 8.0), (16.0, 16.0, 24.0, 24.0), (24.0, 0.0, 32.0, 8.0)
IDS = {"coat": 5, "bag": 6, "red": 7, "and": 8}  # the word ids the hand-written scorers read


def alpha_on(cell: int) -> Tensor:
    """An α row over the 4×4 grid with its peak on ``cell`` and some mass everywhere."""
    row = torch.full((16,), 0.5)
    row[cell] = 3.0
    return row.softmax(0)


def box_evidence(pixels: Tensor, box: tuple[float, float, float, float]) -> Tensor:
    """The mean brightness inside ``box`` of each image (N,), in [0, 1]."""
    x0, y0, x1, y1 = (int(v) for v in box)
    return pixels[:, :, y0:y1, x0:x1].float().mean(dim=(1, 2, 3)) / 255


def scorer_reading(boxes: dict[int, tuple[float, float, float, float]]):
    """A scorer whose log-probability of word id w reads only the pixels of ``boxes[w]`` (other words: 0)."""
    def score(pixels: Tensor, captions: Tensor) -> Tensor:
        targets = captions[:, 1:]
        found = torch.zeros(targets.shape)
        for word, box in boxes.items():
            found = torch.where(targets == word, (box_evidence(pixels, box) + 1e-3).log()[:, None], found)
        return found
    return score


def blind(pixels: Tensor, captions: Tensor) -> Tensor:
    """A scorer that ignores the image: every word's log-probability the same whatever is erased."""
    return torch.full(captions[:, 1:].shape, -1.0)


def hand_built(alphas: list[Tensor] | None = None):
    """Three scenes at 32×32: a coat and a bag (captioned "red coat and bag", α on each as it is named), the coat
    alone, and a coat, a bag and a shoe whose caption's α points at empty ground."""
    pixels = torch.zeros(3, 3, SIZE, SIZE, dtype=torch.uint8)
    for image, boxes in enumerate(([COAT, BAG], [COAT], [COAT, BAG, SHOE])):
        for x0, y0, x1, y1 in boxes:
            pixels[image, :, int(y0):int(y1), int(x0):int(x1)] = 200
    objects = [[("coat", COAT), ("bag", BAG)], [("coat", COAT)], [("coat", COAT), ("bag", BAG), ("shoe", SHOE)]]
    words = [["red", "coat", "and", "bag"], ["coat"], ["coat"]]
    alphas = alphas or [torch.stack([alpha_on(0), alpha_on(0), alpha_on(5), alpha_on(10)]),
                        alpha_on(0)[None], alpha_on(12)[None]]  # cell 12: the bottom-left corner, nothing there
    captions = caption_ids([[IDS[w] for w in caption if w in IDS] or [IDS["coat"]] for caption in words])
    return pixels, objects, words, alphas, captions


def run_hand_built(score, alphas: list[Tensor] | None = None):
    """Plan, erase and score the hand-built scenes on a black background: (scored words, skips)."""
    pixels, objects, words, alphas, captions = hand_built(alphas)
    planned, skipped = plan_erasures(words, alphas, objects, grid=GRID, image_size=(SIZE, SIZE),
                                     class_words={"coat", "bag", "shoe"}, image_ids=["a", "b", "c"])
    found = erase_and_score(score, pixels, torch.zeros_like(pixels), captions, planned, objects, ["a", "b", "c"])
    return found, skipped


def test_erasing_the_attended_object_lowers_a_word_that_rests_on_it_more_every_time() -> None:
    scored, skipped = run_hand_built(scorer_reading({IDS["coat"]: COAT, IDS["bag"]: BAG}))
    assert [(w.image_id, w.position, w.word, w.attended, w.other) for w in scored] == \
        [("a", 1, "coat", "coat", "bag"), ("a", 3, "bag", "bag", "coat")]
    assert skipped == Counter(single_object=1, no_attended_object=1)  # the lone coat; α on empty ground
    assert all(w.drop_attended > 5 and w.drop_other == 0 for w in scored)  # 200/255 -> 1e-3: a large drop
    summary = summarise(scored, images=3, skipped=skipped)
    assert summary["attended_drop_larger"] == 1.0 and summary["attended_is_named"] == 1.0
    assert summary["words"] == 2 and summary["skipped"] == {"single_object": 1, "no_attended_object": 1}
    assert summary["mean_drop_attended"] > 5 and summary["mean_drop_other"] == 0


def test_an_image_blind_scorer_or_attention_on_the_wrong_object_never_counts_as_a_larger_drop() -> None:
    scored, _ = run_hand_built(blind)
    assert len(scored) == 2 and all(w.drop_attended == w.drop_other == 0 for w in scored)
    assert summarise(scored, images=3, skipped={})["attended_drop_larger"] == 0.0  # a tie is not lower
    swapped = [torch.stack([alpha_on(0), alpha_on(10), alpha_on(5), alpha_on(0)]), alpha_on(0)[None],
               alpha_on(12)[None]]  # α on the bag at "coat", on the coat at "bag"
    scored, _ = run_hand_built(scorer_reading({IDS["coat"]: COAT, IDS["bag"]: BAG}), swapped)
    assert [(w.word, w.attended) for w in scored] == [("coat", "bag"), ("bag", "coat")]
    summary = summarise(scored, images=3, skipped={})
    assert summary["attended_drop_larger"] == 0.0 and summary["attended_is_named"] == 0.0
    assert summary["mean_drop_other"] > 5 and summary["mean_drop_attended"] == 0


def test_erasing_fills_the_box_from_the_background_and_the_other_object_is_drawn_among_the_rest() -> None:
    image = torch.full((3, 8, 8), 9, dtype=torch.uint8)
    background = torch.arange(3 * 64, dtype=torch.uint8).view(3, 8, 8)
    erased = erase_box(image, background, (1.5, 2.0, 4.0, 8.0))  # a fractional edge takes the pixel it touches
    assert torch.equal(erased[:, 2:8, 1:4], background[:, 2:8, 1:4])
    assert int((erased != image).flatten(1).any(0).sum()) == 18 and int((image != 9).sum()) == 0  # a copy
    objects = hand_built()[1]
    others = {plan_erasures([["coat"]], [alpha_on(0)[None]], [objects[2]], grid=GRID,
                            image_size=(SIZE, SIZE), class_words={"coat"}, image_ids=[i], seed=0)[0][0].other
              for i in range(40)}
    assert others == {1, 2}  # the bag or the shoe, never the attended coat


def test_teacher_forcing_the_beams_caption_gives_the_beams_own_log_probability(trained_captioner) -> None:
    captioner = Captioner.from_checkpoint(LEGACY_CAPTIONER)  # coverage and word counts: the step and the loop agree
    scenes, _ = read_scenes(trained_captioner["scenes"], "test", 4)
    pixels = torch.stack([scene_pixels(scene, captioner.image_size)[0] for scene in scenes])
    with torch.inference_mode():
        decoded = captioner.decode(normalize(pixels, captioner.mean, captioner.std), beam_size=1)
    captions = caption_ids([h.tokens for h in decoded.hypotheses])
    log_probs = captioner_scorer(captioner)(pixels, captions)
    for row, hypothesis in enumerate(decoded.hypotheses):
        said = len(hypothesis.tokens) + 1  # the words and <end>
        assert float(log_probs[row, :said].sum()) == pytest.approx(hypothesis.log_prob, abs=1e-4)


# --- the erasure command -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scenes_with_a_background(trained_captioner, tmp_path_factory) -> Path:
    """A copy of the fixture's scenes where the first test scene has a saved background (a grey canvas)."""
    root = tmp_path_factory.mktemp("erasure") / "scenes"
    shutil.copytree(trained_captioner["scenes"], root)
    (root / "backgrounds" / "test").mkdir(parents=True)
    first = json.loads((root / "annotations" / "instances_test.json").read_text())["images"][0]["file_name"]
    from PIL import Image

    Image.new("RGB", (96, 96), (90, 90, 90)).save(root / "backgrounds" / "test" / first)
    return root


def test_the_erasure_command_scores_the_class_words_and_writes_its_measures(scenes_with_a_background,
                                                                              tmp_path) -> None:
    out = tmp_path / "erasure.json"
    result = run_in_process("erasure", "--ckpt", str(LEGACY_CAPTIONER), "--root", str(scenes_with_a_background),
                            "--count", "5", "--batch-size", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(out.read_text())
    assert found["images"] == 5 and found["split"] == "test" and found["backgrounds"] == 1
    assert found["words"] == len(found["records"]) > 0  # the legacy captioner names a garment in every caption
    assert found["words"] + sum(found["skipped"].values()) >= 5
    larger = [r["drop_attended"] > r["drop_other"] for r in found["records"]]
    assert found["attended_drop_larger"] == pytest.approx(sum(larger) / len(larger))
    assert found["mean_drop_attended"] == pytest.approx(
        sum(r["drop_attended"] for r in found["records"]) / len(larger), abs=1e-5)
    assert all(r["attended"] != r["other"] and r["log_prob"] < 0 for r in found["records"])
    assert f"{found['words']} class words scored" in result.stdout and f"wrote {out}" in result.stdout


def test_the_erasure_command_refuses_bad_input_in_one_line_before_any_work(trained_captioner, vit_checkpoint,
                                                                             tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt, scenes = str(trained_captioner["ckpt"]), str(trained_captioner["scenes"])
    (tmp_path / "empty").mkdir()
    cases = [(["--ckpt", ckpt, "--root", "nowhere"], ("nowhere", "no such folder")),
             (["--ckpt", ckpt, "--root", "empty"], ("instances_test.json", "not found")),
             (["--ckpt", str(vit_checkpoint), "--root", scenes], (str(vit_checkpoint),)),
             (["--ckpt", ckpt, "--root", scenes, "--out", ckpt], ("is one of the inputs",)),
             (["--ckpt", ckpt, "--root", scenes, "--out", "empty"], ("empty", "is a folder")),
             (["--ckpt", ckpt, "--root", scenes, "--count", "0"], ("--count",)),
             (["--ckpt", ckpt, "--root", scenes, "--batch-size", "257"], ("--batch-size", "at most 256"))]
    for arguments, expected in cases:
        one_line_error(run_in_process("erasure", *arguments), *expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # nothing written


# --- deletion curves on hand-made maps -----------------------------------------------------------------------------

ITEM = [5, 6, 9]  # the patches of the item on a 4×4 grid of 2-pixel patches over 8×8 images


def item_classifier(images: Tensor) -> Tensor:
    """Two classes; the first's probability is the share of the item's brightness still there (it reads only the
    item's patches), so erasing a patch without the item changes nothing."""
    kept = torch.stack([images[:, 0, 2 * (p // 4) : 2 * (p // 4) + 2, 2 * (p % 4) : 2 * (p % 4) + 2].sum((1, 2))
                        for p in ITEM], 1).sum(1) / (len(ITEM) * 4)
    return torch.stack([0.05 + 0.9 * kept, 0.95 - 0.9 * kept], 1)


def test_a_map_that_points_at_the_item_has_the_lowest_deletion_area_and_the_reverse_map_the_highest() -> None:
    images = torch.zeros(6, 1, 8, 8)
    for p in ITEM:
        images[:, :, 2 * (p // 4) : 2 * (p // 4) + 2, 2 * (p % 4) : 2 * (p % 4) + 2] = 1.0
    perfect = torch.zeros(6, 16)
    perfect[:, ITEM] = 1.0
    maps = {"perfect": perfect.view(6, 4, 4), "reverse": -perfect.view(6, 4, 4),
            "random": torch.rand(6, 4, 4, generator=torch.Generator().manual_seed(0))}
    counts, curves = deletion_curves(item_classifier, images, torch.zeros_like(images), maps, steps=16)
    assert counts == list(range(17))
    areas = {name: float(curve_area(counts, curve).mean()) for name, curve in curves.items()}
    assert areas["perfect"] < areas["random"] < areas["reverse"], areas
    assert torch.allclose(curves["perfect"][:, 3:], torch.full((6, 14), 0.05))  # the item gone after 3 patches
    assert torch.allclose(curves["reverse"][:, :14], torch.full((6, 14), 0.95))  # untouched until the last 3
    assert all(torch.equal(curve[:, 0], curves["perfect"][:, 0]) for curve in curves.values())


def test_the_erased_counts_and_the_area_under_a_curve() -> None:
    assert erase_steps(16, 4) == [0, 4, 8, 12, 16] and erase_steps(3, 10) == [0, 1, 2, 3]
    assert erase_steps(196, 16)[-1] == 196 and len(erase_steps(196, 16)) == 17
    assert float(curve_area([0, 4, 8, 12, 16], torch.ones(1, 5))) == pytest.approx(1.0)
    assert float(curve_area([0, 1, 2], torch.tensor([[1.0, 0.5, 0.0]]))) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least one patch"):
        erase_steps(0, 4)


# --- the deletion command ------------------------------------------------------------------------------------------


def test_the_deletion_command_writes_each_maps_area_and_curve(vit_checkpoint, tmp_path) -> None:
    out = tmp_path / "deletion.json"
    result = run_in_process("deletion", "--ckpt", str(vit_checkpoint), "--count", "12", "--steps", "4",
                            "--batch-size", "8", "--background-noise", "40", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(out.read_text())
    assert found["images"] == 12 and found["patches"] == 16 and found["fractions"] == [0, 0.25, 0.5, 0.75, 1.0]
    assert set(found["maps"]) == {"rollout", "gradient rollout", "last layer", "random"}
    curves = [entry["curve"] for entry in found["maps"].values()]
    assert all(len(curve) == 5 and 0 <= min(curve) and max(curve) <= 1 for curve in curves)
    assert len({round(curve[0], 6) for curve in curves}) == 1  # the untouched images: the same for every map
    assert len({round(curve[-1], 6) for curve in curves}) == 1  # every patch erased: the same for every map
    for entry in found["maps"].values():
        assert 0 <= entry["auc"] <= 1
    assert "random (baseline)" in result.stdout and f"wrote {out}" in result.stdout
    # on distractor clutter: erased patches are filled with each canvas's own background, so erasing them all
    # leaves the same canvases for every map again, and the clutter changes what the model sees
    cluttered = tmp_path / "cluttered.json"
    again = run_in_process("deletion", "--ckpt", str(vit_checkpoint), "--count", "12", "--steps", "4",
                           "--batch-size", "8", "--background", "distractors", "--background-level", "1",
                           "--out", str(cluttered))
    assert again.returncode == 0, again.stderr[-2000:]
    other = json.loads(cluttered.read_text())
    assert other["background"] == "distractors" and other["background_level"] == 1
    assert len({round(entry["curve"][-1], 6) for entry in other["maps"].values()}) == 1
    assert other["maps"]["random"]["curve"][0] != found["maps"]["random"]["curve"][0]


def test_the_deletion_command_refuses_bad_input_in_one_line_before_any_work(trained_captioner, vit_checkpoint,
                                                                              tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    vit = str(vit_checkpoint)
    cases = [(["--ckpt", str(trained_captioner["ckpt"]), "--count", "2"], (str(trained_captioner["ckpt"]),)),
             (["--ckpt", "missing.ckpt"], ("missing.ckpt",)),
             (["--ckpt", vit, "--out", vit], ("is one of the inputs",)),
             (["--ckpt", vit, "--steps", "0"], ("--steps",)),
             (["--ckpt", vit, "--steps", "257"], ("--steps", "at most 256")),
             (["--ckpt", vit, "--canvas-size", "20"], ("--canvas-size",))]
    for arguments, expected in cases:
        one_line_error(run_in_process("deletion", *arguments), *expected)
    assert list(tmp_path.iterdir()) == []  # nothing written
