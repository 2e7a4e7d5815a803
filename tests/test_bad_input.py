"""Bad input of every kind users meet: a one-line error naming the file or field, or a counted, logged skip.

Each test names the kind it covers. Errors from the command line are checked through ``main`` in-process
(the same code path as the console script, minus the start-up time) and, for a few, the real console script.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process, tiny
from vision_attn.cli import main
from vision_attn.data.coco import load_caption_image, read_coco_captions, read_karpathy
from vision_attn.data.images import BadImageError, open_image
from vision_attn.data.vocabulary import Vocabulary
from vision_attn.datamodules import CocoCaptionsDataModule

# --- helpers ----------------------------------------------------------------------------------------


def one_line_error(capsys, arguments: list[str]) -> str:
    """Run ``vision-attn ARGS`` in-process; it must exit 2 with exactly one ``error: ...`` line on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def write_bad_images(folder: Path) -> dict[str, Path]:
    """Unreadable files, one per kind."""
    folder.mkdir(parents=True, exist_ok=True)
    good = folder / "good.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(good, quality=90)
    truncated = folder / "truncated.jpg"
    truncated.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    empty = folder / "empty.jpg"
    empty.write_bytes(b"")
    text = folder / "text.jpg"
    text.write_text("this is not an image\n")
    return {"truncated": truncated, "empty": empty, "not an image": text}


def write_coco(root: Path, images: dict[int, tuple[str, list[str]]], *, split: str = "train",
               extra_images: list[dict] | None = None) -> Path:
    """captions_<split>.json for ``{image id: (file name, captions)}``; files that do not exist stay missing."""
    entries = [{"id": image_id, "file_name": name} for image_id, (name, _) in images.items()]
    entries += extra_images or []
    annotations = [{"id": 1000 * image_id + k, "image_id": image_id, "caption": caption}
                   for image_id, (_, captions) in images.items() for k, caption in enumerate(captions)]
    path = root / "annotations" / f"captions_{split}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"images": entries, "annotations": annotations}))
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    return path


def solid(path: Path, size: tuple[int, int] = (40, 30), colour: tuple[int, int, int] = (200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


# --- images --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["truncated", "empty", "not an image"])
def test_unreadable_image_is_a_one_line_error_in_caption(kind, trained_captioner, tmp_path, capsys) -> None:
    path = write_bad_images(tmp_path / "images")[kind]
    message = one_line_error(capsys, ["caption", "--ckpt", str(trained_captioner["ckpt"]), str(path),
                                      "--out", str(tmp_path / "r.json")])
    assert f"{path}: cannot decode image" in message
    assert not (tmp_path / "r.json").exists()


def test_unreadable_images_are_skipped_and_counted_with_the_skip_policy(trained_captioner, tmp_path, capsys,
                                                                         caplog) -> None:
    bad = write_bad_images(tmp_path / "images")
    out = tmp_path / "r.json"
    with caplog.at_level(logging.WARNING):
        main(["caption", "--ckpt", str(trained_captioner["ckpt"]), str(tmp_path / "images"), "--out", str(out),
              "--on-bad-image", "skip"])
    assert [r["file_name"] for r in json.loads(out.read_text())] == [str(tmp_path / "images" / "good.jpg")]
    assert "(3 unreadable images skipped)" in capsys.readouterr().out
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert all(str(path) in warned for path in bad.values())


def test_training_skips_and_counts_unreadable_and_missing_images(tmp_path, caplog) -> None:
    root = tmp_path / "coco"
    images = {i: (f"{i}.png", [f"a red square number {i}", "a square"]) for i in range(1, 7)}
    images[7] = ("missing.png", ["a square that is not there"])
    images[8] = ("truncated.jpg", ["a broken square"])
    write_coco(root, images)
    for i in range(1, 7):
        solid(root / "images" / "train" / f"{i}.png")
    bad = write_bad_images(tmp_path / "bad")["truncated"]
    (root / "images" / "train" / "truncated.jpg").write_bytes(bad.read_bytes())
    write_coco(root, {1: ("1.png", ["a square"])}, split="val")
    solid(root / "images" / "val" / "1.png")
    data = CocoCaptionsDataModule(str(root), image_size=32, loader={"batch_size": 3}, group_captions=True)
    data.setup("fit")
    with caplog.at_level(logging.WARNING):
        batches = [batch for batch in data.train_dataloader() if batch is not None]
        assert data.report_skipped("train epoch 0") == 2
    assert sum(len(batch.images) for batch in batches) == 6
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "missing.png: file not found" in messages and "truncated.jpg: cannot decode image" in messages
    assert "train epoch 0: skipped 2 unreadable images" in messages

    strict = CocoCaptionsDataModule(str(root), image_size=32, loader={"batch_size": 8, "on_bad_image": "error"})
    strict.setup("fit")
    with pytest.raises(BadImageError, match="missing.png: file not found"):
        list(strict.train_dataloader())
    with pytest.raises(ValueError, match="loader.on_bad_image must be 'skip' or 'error'"):
        CocoCaptionsDataModule(str(root), loader={"on_bad_image": "ignore"})


def test_missing_image_of_a_coco_split_is_a_one_line_error_in_caption(trained_captioner, tmp_path, capsys) -> None:
    root = tmp_path / "coco"
    captions = write_coco(root, {1: ("here.png", ["a square"]), 2: ("gone.png", ["a square"])}, split="val")
    solid(root / "images" / "val" / "here.png")
    message = one_line_error(capsys, ["caption", "--ckpt", str(trained_captioner["ckpt"]), "--coco-annotations",
                                      str(captions), "--image-dir", str(root / "images" / "val"),
                                      "--out", str(tmp_path / "r.json")])
    assert "gone.png: file not found" in message


def test_odd_but_valid_images_decode_to_rgb_in_their_colours(tmp_path) -> None:
    folder = tmp_path / "odd"
    folder.mkdir()
    Image.new("CMYK", (30, 20), (255, 0, 0, 0)).save(folder / "cmyk.jpg", quality=95)  # CMYK JPEG: pure cyan
    rgba = Image.new("RGBA", (20, 20), (255, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 10, 20, 20))
    rgba.save(folder / "rgba.png")  # RGBA PNG: transparent top over black, opaque red bottom
    Image.fromarray(np.full((10, 10), 40000, dtype=np.uint16)).save(folder / "sixteen.png")  # 16-bit PNG
    Image.new("L", (12, 12), 128).save(folder / "grey.png")  # grayscale
    Image.new("RGB", (16, 16), (0, 0, 255)).convert("P").save(folder / "palette.gif")  # palette GIF
    Image.new("RGB", (1, 1), (0, 255, 0)).save(folder / "one.png")  # 1×1
    expected = {"cmyk.jpg": (0, 255, 255), "sixteen.png": (156, 156, 156), "grey.png": (128, 128, 128),
                "palette.gif": (0, 0, 255), "one.png": (0, 255, 0)}
    for name, colour in expected.items():
        pixels = load_caption_image(folder / name, 8)
        assert pixels.shape == (3, 8, 8) and pixels.dtype == torch.uint8
        assert np.allclose(pixels[:, 4, 4].tolist(), colour, atol=6), (name, pixels[:, 4, 4])
    rgba_pixels = load_caption_image(folder / "rgba.png", 8)
    assert rgba_pixels[:, 1, 4].tolist() == [0, 0, 0] and rgba_pixels[0, 6, 4] > 250


def test_a_12000_by_9000_jpeg_is_decoded_at_a_fraction_of_its_size(tmp_path) -> None:
    path = tmp_path / "huge.jpg"
    Image.new("RGB", (12000, 9000), (10, 120, 200)).save(path, quality=70)
    image = open_image(path, mode="RGB", max_side=96)
    assert image.width * image.height <= 1500 * 1125  # decoded at ≤ 1/8 scale: ~5 MB instead of ~324 MB
    pixels = load_caption_image(path, 96)
    assert pixels.shape == (3, 96, 96) and abs(int(pixels[2, 48, 48]) - 200) < 6


def test_exif_rotated_photo_is_decoded_upright(tmp_path) -> None:
    path = tmp_path / "rotated.jpg"
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue as stored
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    image.save(path, exif=exif, quality=95)
    upright = open_image(path)
    assert upright.size == (20, 40)
    assert upright.getpixel((10, 5))[2] > 200  # the stored left half is on top once upright


# --- annotations ---------------------------------------------------------------------------------------


def test_invalid_json_and_wrong_schema_name_the_file(tmp_path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [')
    with pytest.raises(ValueError, match="broken.json: not a readable JSON file"):
        read_coco_captions(broken, tmp_path)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"pictures": [], "annotations": [{"caption": "x"}]}))
    with pytest.raises(ValueError, match="wrong.json: not a COCO captions file"):
        read_coco_captions(wrong, tmp_path)


def test_invalid_annotations_through_the_cli_are_one_line(tmp_path, capsys) -> None:
    root = tmp_path / "coco"
    path = write_coco(root, {1: ("a.png", ["a square"])})
    path.write_text("not json at all")
    message = one_line_error(capsys, ["fit", *tiny("captioner_tiny.yaml"),
                                      "--data.init_args.root", str(root), "--data.init_args.scenes.generate", "false",
                                      "--trainer.default_root_dir", str(tmp_path / "run")])
    assert "captions_train.json: not a readable JSON file" in message


def test_duplicate_image_ids_are_refused(tmp_path) -> None:
    path = write_coco(tmp_path, {1: ("a.png", ["a square"])}, extra_images=[{"id": 1, "file_name": "b.png"}])
    with pytest.raises(ValueError, match="image id 1 appears twice"):
        read_coco_captions(path, tmp_path / "images" / "train")


def test_empty_and_punctuation_only_captions_are_left_out_and_counted(tmp_path, caplog) -> None:
    path = write_coco(tmp_path, {1: ("a.png", ["a red square", "", "  "]), 2: ("b.png", ["?!...", "—"]),
                                 3: ("c.png", ["a blue circle"])})
    with caplog.at_level(logging.WARNING):
        records = read_coco_captions(path, tmp_path / "images" / "train")
    assert [(r.image_id, r.captions) for r in records] == [(1, ["a red square"]), (3, ["a blue circle"])]
    assert "4 captions without any word left out" in caplog.text


def test_non_ascii_captions_keep_their_words() -> None:
    vocab = Vocabulary.build(["Ein Mädchen trägt ein Café-Tablett", "一只猫 sits", "naïve résumé"])
    for word in ("mädchen", "trägt", "café-tablett", "一只猫", "naïve", "résumé"):
        assert word in vocab.tokens
    ids, lengths = vocab.encode_batch(["naïve résumé"], 10)
    assert vocab.decode(ids[0].tolist()) == ["naïve", "résumé"] and lengths.tolist() == [4]


def test_a_500_word_caption_is_cut_to_the_maximum_and_said_so(tmp_path, caplog) -> None:
    root = tmp_path / "coco"
    long_caption = " ".join(["word"] * 500)
    write_coco(root, {1: ("a.png", [long_caption, "a short one"])})
    solid(root / "images" / "train" / "a.png")
    data = CocoCaptionsDataModule(str(root), image_size=16, vocabulary={"max_caption_length": 12})
    from vision_attn.data.caption_datasets import CaptionTrainDataset

    with caplog.at_level(logging.WARNING):
        dataset = CaptionTrainDataset(data.records("train"), data.vocab, max_caption_length=12, image_size=16)
    assert "1 training captions are longer than max_caption_length=12 words and were cut" in caplog.text
    assert dataset.lengths.tolist() == [14, 5]  # <start> + 12 words + <end>; <start> + 3 + <end>


def test_karpathy_file_with_an_unknown_split_names_the_entry(tmp_path) -> None:
    (tmp_path / "images").mkdir()
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps({"images": [{"split": "training", "filename": "a.jpg", "filepath": "images",
                                            "sentences": [{"raw": "a cat"}]}]}))
    with pytest.raises(ValueError, match=r"images\[0\]: unknown split 'training'"):
        read_karpathy(path, tmp_path)


# --- checkpoints and config -----------------------------------------------------------------------------


def test_a_vit_checkpoint_given_to_caption_and_the_reverse(vit_checkpoint, trained_captioner, tmp_path,
                                                           capsys) -> None:
    image = solid(tmp_path / "x.png")
    message = one_line_error(capsys, ["caption", "--ckpt", str(vit_checkpoint), str(image)])
    assert "this is a ViT classifier checkpoint, but a Show-Attend-Tell captioner is needed" in message
    message = one_line_error(capsys, ["classify", "--ckpt", str(trained_captioner["ckpt"]), str(image)])
    assert "this is a Show-Attend-Tell captioner checkpoint, but a ViT classifier is needed" in message
    message = one_line_error(capsys, ["test", *tiny("vit_tiny.yaml"),
                                      "--ckpt_path", str(trained_captioner["ckpt"]),
                                      "--trainer.default_root_dir", str(tmp_path / "run")])
    assert "Show-Attend-Tell captioner checkpoint, but the config trains a ViT classifier" in message
    saved = torch.load(vit_checkpoint, map_location="cpu", weights_only=True)
    saved["vision_attn_kind"] = "\u202egnp.exe\x1b[2J"  # a bidi override and a terminal escape
    spoofed = tmp_path / "spoofed.ckpt"
    torch.save(saved, spoofed)
    message = one_line_error(capsys, ["classify", "--ckpt", str(spoofed), str(image)])
    assert "this is a '\\u202egnp.exe\\x1b[2J' checkpoint, but a ViT classifier is needed" in message


def test_a_vocabulary_that_does_not_match_the_checkpoint(trained_captioner, tmp_path, capsys) -> None:
    vocab_file = trained_captioner["ckpt"].parent / "vocab.json"
    tokens = json.loads(vocab_file.read_text())
    tokens = tokens["tokens"] if isinstance(tokens, dict) else tokens
    swapped = tokens[:4] + [tokens[5], tokens[4]] + tokens[6:]  # two words trade ids: same size, other meaning
    other = tmp_path / "other_vocab.json"
    Vocabulary(swapped).to_json(other)
    message = one_line_error(capsys, ["test", *tiny("captioner_tiny.yaml"),
                                      "--data.init_args.root", str(trained_captioner["scenes"]),
                                      "--data.init_args.vocabulary.vocab_file", str(other),
                                      "--ckpt_path", str(trained_captioner["ckpt"]),
                                      "--trainer.default_root_dir", str(tmp_path / "run")])
    assert "vocabulary" in message and "does not match" in message and "first difference at id 4" in message


def test_a_config_key_typo_is_lightningclis_error_without_a_traceback(tmp_path) -> None:
    result = run_in_process("fit", *tiny("vit_tiny.yaml"), "--model.init_args.architecture.embed_dimm", "8",
                            "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode == 2
    assert "embed_dimm" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_dataset_names_where_it_looked(tmp_path, capsys, monkeypatch) -> None:
    message = one_line_error(capsys, ["fit", *tiny("captioner_tiny.yaml"),
                                      "--data.init_args.root", str(tmp_path / "nowhere"),
                                      "--data.init_args.scenes.generate", "false",
                                      "--trainer.default_root_dir", str(tmp_path / "run")])
    assert f"{tmp_path / 'nowhere'}/annotations/captions_train.json: captions file not found" in message
    from vision_attn.data import fashion_mnist

    monkeypatch.setattr(fashion_mnist, "SYSTEM_DIR", tmp_path / "no_system")
    with pytest.raises(fashion_mnist.DatasetNotFoundError) as error:
        fashion_mnist.find_fashion_mnist(tmp_path / "fm", download=False)
    message = str(error.value)
    assert str(tmp_path / "no_system") in message and str(tmp_path / "fm") in message and "download" in message


# --- environment -------------------------------------------------------------------------------------------


def test_without_java_meteor_is_skipped_with_one_warning_and_the_rest_computed(monkeypatch, tmp_path, caplog) -> None:
    from vision_attn import metrics

    monkeypatch.setenv("PATH", str(tmp_path))  # no java on this PATH
    monkeypatch.setattr(metrics, "_warned", set())
    predictions = {1: "a red bag", 2: "a blue shoe"}
    references = {1: ["a red bag", "red bag"], 2: ["a blue sneaker", "blue shoe"]}
    with caplog.at_level(logging.WARNING):
        first = metrics.caption_scores(predictions, references)
        second = metrics.caption_scores(predictions, references)
    assert "METEOR" not in first and first == second
    assert {"BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr-D"} <= set(first) and first["BLEU-1"] > 0.5
    assert sum("Java not found" in r.getMessage() for r in caplog.records) == 1
