"""Every subcommand against a matrix of bad paths, and ``overlay`` against a matrix of bad results-JSON fields:
each case ends in exactly one ``error:`` line and exit 2, with no traceback, no output left behind, and
its inputs unchanged. Then fuzzing (hypothesis) of the results-JSON reader and the image loader."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.conftest import tiny
from vision_attn.cli import main
from vision_attn.data.images import open_image
from vision_attn.errors import BadImageError
from vision_attn.overlay import caption_overlay
from vision_attn.results import read_results, record_problem

BAD_INPUTS = ("missing", "folder", "empty", "text", "fifo", "under_a_file")


def bad_input(kind: str, folder: Path, suffix: str) -> Path:
    """A path of ``kind`` that is not a usable input file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}{suffix}"
    if kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("this is not what it claims to be\n")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "under_a_file":
        (folder / "plain.txt").write_text("a file")
        path = folder / "plain.txt" / f"inner{suffix}"
    return path


def fails_in_one_line(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    """Run ``vision-attn ARGS`` in this process: exit 2, and one ``error:`` line as the last word, no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, (args, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    error_lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(error_lines) == 1 and err.strip().splitlines()[-1] == error_lines[0], err[-2000:]
    return error_lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", BAD_INPUTS)
@pytest.mark.parametrize("command", ["classify --ckpt", "classify image", "caption --ckpt", "caption image",
                                     "overlay --ckpt", "overlay image", "overlay results", "rollout-mass --ckpt",
                                     "test --ckpt_path", "evaluate results"])
def test_a_bad_input_path(command: str, kind: str, tmp_path: Path, capsys, vit_checkpoint, trained_captioner) -> None:
    image = tmp_path / "good.png"
    Image.new("RGB", (16, 16), "red").save(image)
    suffix = {"--ckpt": ".ckpt", "--ckpt_path": ".ckpt", "image": ".png", "results": ".json"}[command.split()[1]]
    bad = str(bad_input(kind, tmp_path / "bad", suffix))
    out = tmp_path / "out"
    ckpt = str(trained_captioner["ckpt"] if command.startswith(("caption", "overlay")) else vit_checkpoint)
    args = {
        "classify --ckpt": ["classify", "--ckpt", bad, str(image)],
        "classify image": ["classify", "--ckpt", ckpt, bad],
        "caption --ckpt": ["caption", "--ckpt", bad, str(image), "--out", str(out / "r.json")],
        "caption image": ["caption", "--ckpt", ckpt, bad, "--out", str(out / "r.json")],
        "overlay --ckpt": ["overlay", "--ckpt", bad, str(image), "--out", str(out)],
        "overlay image": ["overlay", "--ckpt", ckpt, bad, "--out", str(out)],
        "overlay results": ["overlay", bad, "--out", str(out)],
        "rollout-mass --ckpt": ["rollout-mass", "--ckpt", bad, "--count", "4"],
        "test --ckpt_path": ["test", *tiny("vit_tiny.yaml"), "--ckpt_path", bad,
                             "--trainer.default_root_dir", str(out)],
        "evaluate results": ["evaluate", bad, "--annotations",
                             str(trained_captioner["scenes"] / "annotations" / "captions_test.json"),
                             "--out", str(out / "scores.json")],
    }[command]
    before = snapshot(tmp_path)
    line = fails_in_one_line(capsys, args)
    assert "bad" in line or "plain.txt" in line, line  # the message names the file
    assert not out.exists() and snapshot(tmp_path) == before  # nothing written, nothing changed


BAD_OUTPUTS = {  # command -> (its output option, the kinds of bad output it must refuse)
    "caption": ("--out", ("folder", "under_a_file", "an_input")),
    "overlay": ("--out", ("file", "under_a_file")),
    "export-samples": ("--out", ("file", "under_a_file")),
    "make-scenes": ("--root", ("file", "under_a_file")),
}


@pytest.mark.parametrize("case", [(c, k) for c, (_, kinds) in BAD_OUTPUTS.items() for k in kinds], ids=str)
def test_a_bad_output_path(case: tuple[str, str], tmp_path: Path, capsys, trained_captioner) -> None:
    command, kind = case
    image = tmp_path / "scene.png"
    image.write_bytes((trained_captioner["scenes"] / "images" / "test" / "1.png").read_bytes())
    (tmp_path / "plain.txt").write_text("a file")
    target = {"folder": tmp_path, "file": tmp_path / "plain.txt", "under_a_file": tmp_path / "plain.txt" / "out",
              "an_input": image}[kind]
    ckpt = str(trained_captioner["ckpt"])
    args = {"caption": ["caption", "--ckpt", ckpt, str(image)], "overlay": ["overlay", "--ckpt", ckpt, str(image)],
            "export-samples": ["export-samples", "--count", "2"],
            "make-scenes": ["make-scenes", "--train", "2", "--val", "1", "--test", "1"]}[command]
    before = snapshot(tmp_path)
    line = fails_in_one_line(capsys, [*args, BAD_OUTPUTS[command][0], str(target)])
    assert str(target) in line
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt", "scene.png"]


BAD_NUMBERS = [
    ["caption", "--ckpt", "c.ckpt", "x.png", "--batch-size", "-3"], ["caption", "--ckpt", "c.ckpt", "x.png",
                                                                    "--batch-size", "0"],
    ["caption", "--ckpt", "c.ckpt", "x.png", "--beam", "0"], ["classify", "--ckpt", "c.ckpt", "x.png", "--top-k", "0"],
    ["overlay", "x.json", "--out", "o", "--opacity", "nan"], ["overlay", "x.json", "--out", "o", "--opacity", "1.5"],
    ["overlay", "x.json", "--out", "o", "--sigma", "-1"], ["overlay", "x.json", "--out", "o", "--sigma", "inf"],
    ["overlay", "x.json", "--out", "o", "--discard-ratio", "1"], ["overlay", "x.json", "--out", "o", "--columns", "0"],
    ["overlay", "x.json", "--out", "o", "--panel-size", "8"], ["export-samples", "--out", "o", "--count", "-1"],
    ["export-samples", "--out", "o", "--count", "20000"], ["export-samples", "--out", "o", "--canvas-size", "20"],
    ["make-scenes", "--root", "o", "--train", "-5"], ["make-scenes", "--root", "o", "--grid-size", "1"],
    ["rollout-mass", "--ckpt", "c.ckpt", "--count", "0"], ["rollout-mass", "--ckpt", "c.ckpt", "--count", "20000"],
    ["classify", "--ckpt", "c.ckpt", "x.png", "--device", "cuda"],
    ["classify", "--ckpt", "c.ckpt", "x.png", "--device", "cdua:0"],
    ["caption", "--ckpt", "c.ckpt", "x.png", "--device", "cuda:3"],
]


@pytest.mark.parametrize("args", BAD_NUMBERS, ids=" ".join)
def test_a_bad_number_or_device(args: list[str], tmp_path: Path, capsys, monkeypatch, vit_checkpoint) -> None:
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (8, 8)).save("x.png")
    Path("c.ckpt").write_bytes(vit_checkpoint.read_bytes())
    before = snapshot(tmp_path)
    fails_in_one_line(capsys, args)
    assert snapshot(tmp_path) == before and not Path("o").exists()


def good_record(name: str) -> dict:
    return {"image_id": 1, "file_name": name, "caption": "a red top", "tokens": ["a", "red", "top"], "grid": [2, 2],
            "image_size": [96, 96], "alphas": [[0.25] * 4, [0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]],
            "betas": [0.5, 0.5, 0.5]}


BAD_FIELDS = {
    "grid zero": {"grid": [0, 4]}, "grid fractional": {"grid": [2.5, 2]}, "grid of three": {"grid": [1, 2, 2]},
    "grid text": {"grid": "2x2"}, "tokens not strings": {"tokens": [1, 2, 3]}, "caption null": {"caption": None},
    "alpha NaN": {"alphas": [[math.nan] * 4] * 3}, "alpha infinite": {"alphas": [[math.inf] * 4] * 3},
    "alpha negative": {"alphas": [[-1.0] * 4] * 3}, "alpha row short": {"alphas": [[0.5] * 3] * 3},
    "alphas per token": {"alphas": [[0.25] * 4]}, "beta NaN": {"betas": [math.nan] * 3},
    "image id a list": {"image_id": [1]}, "file name empty": {"file_name": ""}, "image size negative":
    {"image_size": [-1, 96]},
}


@pytest.mark.parametrize("field", sorted(BAD_FIELDS))
def test_overlay_refuses_a_bad_results_field_before_drawing(field: str, tmp_path: Path, capsys) -> None:
    Image.new("RGB", (32, 32), "blue").save(tmp_path / "scene.png")
    records = [good_record("scene.png"), {**good_record("scene.png"), **BAD_FIELDS[field]}]
    results = tmp_path / "results.json"
    results.write_text(json.dumps(records))  # NaN and Infinity written as JSON's common extension
    line = fails_in_one_line(capsys, ["overlay", str(results), "--out", str(tmp_path / "gallery")])
    assert line.startswith(f"error: {results}: record 1 ")
    assert not (tmp_path / "gallery").exists()  # not a half-made gallery: the first, good record was not drawn


# --- fuzzing -----------------------------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True)
                           | st.text(max_size=5), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=12)
record_fields = st.fixed_dictionaries({}, optional={key: json_values for key in good_record("x")})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.one_of(json_values, st.lists(record_fields, max_size=3),
                          st.lists(st.builds(lambda base, extra: {**base, **extra},
                                             st.just(good_record("scene.png")), record_fields), max_size=3)))
def test_fuzz_the_results_reader_refuses_cleanly_or_gives_drawable_records(document, tmp_path: Path) -> None:
    Image.new("RGB", (24, 24), "green").save(tmp_path / "scene.png")
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(document))
    try:
        found = read_results(path)
    except (ValueError, FileNotFoundError) as error:
        assert str(error).startswith(str(path)) and "\n" not in str(error).strip()
        return
    for record, image in found:
        assert record_problem(record) is None
        caption_overlay(Image.open(image), record, panel_size=32)  # what the reader passes, the drawing takes


def png_bytes(size: tuple[int, int], mode: str) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def one_byte_changed(at: int, value: int) -> bytes:
    """A small grey PNG with the byte at ``at`` (modulo its length) set to ``value``."""
    data = bytearray(png_bytes((13, 7), "L"))
    data[at % len(data)] = value
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300),
                      st.builds(lambda cut, junk: png_bytes((20, 9), "RGBA")[:cut] + junk, st.integers(0, 200),
                                st.binary(max_size=40)),
                      st.builds(one_byte_changed, st.integers(0, 10_000), st.integers(0, 255))),
       mode=st.sampled_from(["RGB", "L"]))
def test_fuzz_the_image_loader_gives_an_image_or_one_bad_image_error(data: bytes, mode: str, tmp_path: Path) -> None:
    path = tmp_path / "fuzz.png"
    path.write_bytes(bytes(data))
    try:
        image = open_image(path, mode=mode, max_side=64)
    except BadImageError as error:
        assert str(error).startswith(str(path)) and "\n" not in str(error)
        return
    assert image.mode == mode and image.width * image.height > 0


def test_no_error_line_carries_a_control_or_bidi_character_of_a_name(tmp_path: Path, capsys) -> None:
    """A file's name may hold a newline, a terminal escape or a bidi override: the error names it on one line with
    those shown escaped, so nothing it holds reaches the terminal."""
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    name = str(tmp_path / "bad\nname\x1b[31m\u202egnp.ckpt")
    line = fails_in_one_line(capsys, ["caption", "--ckpt", name, str(image)])
    assert line.isprintable() and "bad name\\x1b[31m\\u202egnp.ckpt" in line, line


def test_what_a_tool_prints_shows_a_names_control_characters_escaped(tmp_path: Path, vit_checkpoint) -> None:
    """`classify` prints each image's name: a terminal escape or bidi override in it is shown escaped, while the
    JSON it writes keeps the name as it is (for programs, not terminals)."""
    from tests.conftest import run_in_process

    image = tmp_path / "evil\x1b[2J\u202egnp.png"
    Image.new("L", (28, 28), 128).save(image)
    result = run_in_process("classify", "--ckpt", str(vit_checkpoint), str(image), "--out", str(tmp_path / "c.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "evil\\x1b[2J\\u202egnp.png" in result.stdout and "\x1b" not in result.stdout
    assert "\u202e" not in result.stdout and "\n" in result.stdout
    assert json.loads((tmp_path / "c.json").read_text())[0]["file_name"] == str(image)


def test_a_logged_skip_shows_a_names_control_characters_escaped(tmp_path: Path, vit_checkpoint) -> None:
    """A skipped image is logged by name, through the command line's log handler: escaped there too."""
    from tests.conftest import run_script

    good, bad = tmp_path / "good.png", tmp_path / "bad\x1b[2J\u202e.png"
    Image.new("L", (28, 28), 128).save(good)
    bad.write_bytes(b"not an image")
    result = run_script("classify", "--ckpt", str(vit_checkpoint), str(good), str(bad), "--on-bad-image", "skip",
                        "--out", str(tmp_path / "c.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bad\\x1b[2J\\u202e.png" in result.stderr and "\x1b" not in result.stderr + result.stdout
    assert "\u202e" not in result.stderr + result.stdout
