"""The Python API (``vision_attn.api``) against the command line it shares its code with: captions are the records
``vision-attn caption`` writes, a PIL image gives what its file gives, classes are ``classify_batches``' and the
network's own, figures are the PNGs ``vision-attn overlay`` draws; and ``vision-attn classify`` on folders, with
its JSON, its bad-image policy and its one-line refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import REPO, run_in_process
from vision_attn.api import (
    CaptionResult,
    ClassificationResult,
    caption,
    caption_figure,
    classifier_figure,
    classify,
    load_captioner,
    load_classifier,
)
from vision_attn.vit.classifier import classify_batches, ranked

LEGACY = Path(__file__).parent / "fixtures" / "legacy"
GARMENTS = [LEGACY / "02890_Sandal.png", LEGACY / "06044_Trouser.png"]


def scenes(trained_captioner: dict[str, Path], count: int) -> list[Path]:
    return sorted((trained_captioner["scenes"] / "images" / "test").glob("*.png"))[:count]


def variants(image: Image.Image, folder: Path) -> list[Path]:
    """``image`` saved as PNGs the readers must convert alike from a file and from a PIL image: RGB, rotated by
    its EXIF orientation (wider than tall), with transparency, in a palette, and 16-bit grey."""
    folder.mkdir(exist_ok=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to show"
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(image.size))
    made = {"rgb": (image.convert("RGB"), {}), "exif": (image.convert("RGB").resize((60, 40)), {"exif": exif}),
            "rgba": (rgba, {}), "palette": (image.convert("P"), {}),
            "grey16": (Image.fromarray(np.asarray(image.convert("L"), dtype=np.uint16) * 257), {})}
    for name, (variant, options) in made.items():
        variant.save(folder / f"{name}.png", **options)
    return [folder / f"{name}.png" for name in made]


def without_names(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in ("image_id", "file_name")}


def test_captions_are_the_records_caption_writes(trained_captioner, tmp_path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    first, second, third = scenes(trained_captioner, 3)
    for image in (first, second):
        shutil.copy(image, folder / image.name)
    out = tmp_path / "results.json"
    written = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), str(folder), str(third),
                             "--beam", "3", "--batch-size", "2", "--out", str(out))
    assert written.returncode == 0, written.stderr[-2000:]
    results = caption(load_captioner(trained_captioner["ckpt"]), [folder, str(third)], beam_size=3, batch_size=2)
    assert all(isinstance(result, CaptionResult) for result in results)
    assert [result.to_record() for result in results] == json.loads(out.read_text())
    for result in results:
        assert result.source == result.to_record()["file_name"] and result.image_id == Path(result.source).name
        assert result.caption == " ".join(result.tokens) and result.betas.shape == (len(result.tokens),)
        assert result.alphas.shape == (len(result.tokens), *result.grid) and result.image_size == (96, 96)
        assert np.allclose(result.alphas.sum(axis=(1, 2)), 1.0, atol=1e-4)
        with pytest.raises(ValueError):
            result.alphas[0, 0, 0] = 1.0  # frozen, its arrays too


def test_a_pil_image_captions_as_its_file(trained_captioner, tmp_path) -> None:
    with Image.open(scenes(trained_captioner, 1)[0]) as image:
        files = variants(image, tmp_path / "variants")
    captioner = load_captioner(trained_captioner["ckpt"])
    from_files = caption(captioner, files, batch_size=len(files))
    opened = [Image.open(path) for path in files]
    from_pil = caption(captioner, [str(files[0]), *opened[1:]], batch_size=len(files))  # mixed
    assert [without_names(r.to_record()) for r in from_pil] == [without_names(r.to_record()) for r in from_files]
    assert [r.source for r in from_pil] == [str(files[0]), "<image 1>", "<image 2>", "<image 3>", "<image 4>"]
    assert [r.image_id for r in from_pil] == [files[0].name, 1, 2, 3, 4]


def test_classes_are_classify_batches_and_the_networks_own(vit_checkpoint, tmp_path) -> None:
    classifier = load_classifier(vit_checkpoint)
    paths = [*GARMENTS, *variants(Image.open(GARMENTS[0]), tmp_path / "variants")]
    results = classify(classifier, paths, top_k=3, batch_size=4, logits=True)
    assert all(isinstance(result, ClassificationResult) for result in results)
    assert [(r.source, list(r.top_k)) for r in results] == [
        (str(path), ranked(classifier, row, 3)) for path, row in classify_batches(classifier, paths, batch_size=4)]
    with torch.inference_mode():  # the network on the same inputs, read by hand
        probabilities = classifier.model(torch.stack([classifier.preprocess(path) for path in paths])).softmax(-1)
    for result, row in zip(results, probabilities, strict=True):
        best = row.argsort(descending=True)[:3]
        assert [name for name, _ in result.top_k] == [classifier.class_names[i] for i in best]
        assert [p for _, p in result.top_k] == pytest.approx(row[best].tolist(), abs=1e-6)
        assert (result.label, result.probability) == result.top_k[0]
        assert torch.from_numpy(result.logits).softmax(-1) == pytest.approx(row, abs=1e-6)
    from_pil = classify(classifier, [Image.open(path) for path in paths], top_k=3, batch_size=4)
    assert [r.top_k for r in from_pil] == [r.top_k for r in results]
    assert [r.source for r in from_pil] == [f"<image {n}>" for n in range(len(paths))]


def overlay_png(checkpoint: Path, image: Path, out: Path) -> np.ndarray:
    result = run_in_process("overlay", "--ckpt", str(checkpoint), str(image), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return np.asarray(Image.open(out / f"{image.stem}.png").convert("RGB"))


def test_figures_are_the_overlays_the_overlay_command_draws(trained_captioner, vit_checkpoint, tmp_path) -> None:
    image = scenes(trained_captioner, 1)[0]
    drawn = overlay_png(trained_captioner["ckpt"], image, tmp_path / "captioner")
    (result,) = caption(trained_captioner["ckpt"], [image])
    for figure in (caption_figure(result), caption_figure(result, Image.open(image))):
        assert isinstance(figure, Image.Image) and figure.size == (drawn.shape[1], drawn.shape[0])
        assert np.array_equal(np.asarray(figure), drawn)
    with pytest.raises(ValueError, match="not an image file"):
        caption_figure(caption(trained_captioner["ckpt"], [Image.open(image)])[0])
    drawn = overlay_png(vit_checkpoint, GARMENTS[0], tmp_path / "vit")
    classifier = load_classifier(vit_checkpoint)
    for figure in (classifier_figure(classifier, GARMENTS[0]), classifier_figure(classifier, Image.open(GARMENTS[0]))):
        assert figure.size == (drawn.shape[1], drawn.shape[0]) and np.array_equal(np.asarray(figure), drawn)
    assert classifier_figure(classifier, GARMENTS[0], gradient_class="Sandal").size != figure.size  # one more panel


def test_classify_on_folders_prints_and_writes_the_json(vit_checkpoint, tmp_path, caplog) -> None:
    folder = tmp_path / "garments"
    folder.mkdir()
    for image in GARMENTS:
        shutil.copy(image, folder / image.name)
    (folder / "broken.png").write_bytes(b"not a png")
    (folder / "notes.txt").write_text("not an image: not listed")
    out = tmp_path / "out" / "classes.json"
    result = run_in_process("classify", "--ckpt", str(vit_checkpoint), str(folder), str(GARMENTS[1]), "--top-k",
                            "3", "--batch-size", "2", "--on-bad-image", "skip", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    written = json.loads(out.read_text())
    expected = classify(vit_checkpoint, [folder / GARMENTS[0].name, folder / GARMENTS[1].name, GARMENTS[1]],
                        top_k=3, batch_size=2)
    assert written == [r.to_record() for r in expected]
    for entry in written:
        assert list(entry) == ["file_name", "label", "probability", "top_k"] and len(entry["top_k"]) == 3
        assert all(list(item) == ["class", "probability"] for item in entry["top_k"])
        assert (entry["label"], entry["probability"]) == (entry["top_k"][0]["class"], entry["top_k"][0]["probability"])
        assert [item["probability"] for item in entry["top_k"]] == sorted((i["probability"] for i in entry["top_k"]),
                                                                          reverse=True)
    lines = result.stdout.splitlines()
    assert lines[0] == str(folder / GARMENTS[0].name) and lines[4] == str(folder / GARMENTS[1].name)
    assert lines[-1] == f"wrote the classes of 3 images to {out} (1 unreadable images skipped)"
    assert "skipped an unreadable image" in caplog.text and "broken.png" in caplog.text


def one_line_error(args: list[str], folder: Path) -> str:
    """``vision-attn ARGS`` run in ``folder``: exit 2, one ``error:`` line, no traceback, nothing written or
    changed in ``folder``."""
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    result = run_in_process(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before
    return result.stderr.strip()


BAD = {  # what is wrong -> (the arguments after --ckpt C, in a folder holding good.png, empty/ and broken.png)
    "a missing image": (["nope.png"], "nope.png: no such file or folder"),
    "an empty folder": (["empty"], "empty: no image files"),
    "--out an input image": (["good.png", "--out", "good.png"], "good.png: is one of the inputs"),
    "--out a folder": (["good.png", "--out", "empty"], "empty: is a folder"),
    "--out under a file": (["good.png", "--out", "good.png/classes.json"], "good.png is a file, not a folder"),
    "--out the checkpoint": (["good.png", "--out", "CKPT"], "is one of the inputs"),
    "an unreadable image": (["good.png", "broken.png"], "broken.png: cannot decode image"),
    "a captioner checkpoint": (["good.png", "--ckpt", "CAPTIONER"], "but a ViT classifier is needed"),
    "--top-k 0": (["good.png", "--top-k", "0"], "argument --top-k: expected a whole number from 1 to 1000"),
}


@pytest.mark.parametrize("case", BAD, ids=str)
def test_classify_refuses_bad_input_in_one_line(case: str, vit_checkpoint, trained_captioner, tmp_path,
                                                monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # where the default --out, classes.json, would go
    shutil.copy(GARMENTS[0], tmp_path / "good.png")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    args, message = BAD[case]
    names = {"CKPT": str(vit_checkpoint), "CAPTIONER": str(trained_captioner["ckpt"])}
    line = one_line_error(["classify", "--ckpt", str(vit_checkpoint), *(names.get(a, a) for a in args)], tmp_path)
    assert message in line
    assert not (tmp_path / "classes.json").exists()


def test_the_api_imports_no_lightning() -> None:
    code = "import sys, vision_attn.api\nprint('lightning' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-2000:]


@pytest.mark.parametrize("heads", [None, 2])
def test_a_caption_without_words_keeps_its_grid_and_record(heads) -> None:
    """A model can emit <end> first: the result has no α rows, and its record is still the one `caption` writes."""
    record = {"image_id": 3, "file_name": "x.png", "caption": "", "tokens": [], "grid": [2, 3],
              "image_size": [96, 96], "alphas": [], "betas": []}
    if heads:
        record["head_alphas"] = []
    result = CaptionResult.from_record(record)
    assert result.alphas.shape == (0, 2, 3) and result.to_record() == record
    worded = {**record, "caption": "a bag", "tokens": ["a", "bag"], "alphas": [[0.5] * 6, [0.25] * 6],
              "betas": [0.5, 0.75], **({"head_alphas": [[[0.5] * 6] * heads] * 2} if heads else {})}
    assert CaptionResult.from_record(worded).to_record() == worded
