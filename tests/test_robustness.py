"""Reliability under hostile inputs: decompression bombs, outputs that would overwrite inputs or runs."""

from __future__ import annotations

import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from tests.conftest import console_script, run_in_process, tiny
from vision_attn.data.images import MAX_PIXELS, open_image
from vision_attn.errors import BadImageError


def png_bomb(path: Path, side: int = 19900) -> Path:
    """A real, valid grey PNG of side × side black pixels, a few hundred KB on disk: written row by row through
    zlib, so making it never holds the image in memory."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    compressor, row, parts = zlib.compressobj(9), b"\x00" * (side + 1), []  # filter byte 0, then the pixels
    for _ in range(side):
        parts.append(compressor.compress(row))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts))
                     + chunk(b"IEND", b""))
    return path


def test_a_png_bomb_is_refused_from_its_header_in_one_line(tmp_path: Path, trained_captioner) -> None:
    bomb = png_bomb(tmp_path / "bomb.png")
    assert bomb.stat().st_size < 1_000_000
    with pytest.raises(BadImageError, match=r"19900×19900 pixels is more than the 120-megapixel limit"):
        open_image(bomb)
    with pytest.raises(BadImageError, match=r"over 480,000,000 pixels is more than the 120-megapixel limit"):
        open_image(png_bomb(tmp_path / "larger_bomb.png", side=23000))  # beyond Pillow's own backstop (4×)
    result = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb %M", console_script(), "caption", "--ckpt",
                             str(trained_captioner["ckpt"]), str(bomb), "--out", str(tmp_path / "r.json")],
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if not line.startswith(("maxrss_kb", "Command exited"))]
    assert result.returncode == 2 and lines == [f"error: {bomb}: 19900×19900 pixels is more than the 120-megapixel "
                                                "limit; refused before decoding"]
    peak_kb = int(result.stderr.split("maxrss_kb ")[1].split()[0])
    assert peak_kb < 1_500_000, f"{peak_kb / 1e6:.1f} GB peak: the image was decoded"
    assert not (tmp_path / "r.json").exists()


def test_a_100_megapixel_photo_is_within_the_limit_and_decodes_by_draft(tmp_path: Path) -> None:
    from PIL import Image

    assert 11648 * 8736 <= MAX_PIXELS
    path = tmp_path / "camera.jpg"
    Image.new("L", (11648, 8736), 90).save(path, quality=50)
    image = open_image(path, max_side=448)
    assert image.mode == "RGB" and max(image.size) < 11648 // 4  # JPEG draft decoded a fraction of the pixels


run = run_in_process


def one_line_error(result: subprocess.CompletedProcess, *parts: str, after_logs: bool = False) -> None:
    """Exit 2 and one ``error:`` line naming ``parts``; nothing else on stderr (``after_logs``: but Lightning's
    start-up INFO lines before it), and never a traceback."""
    assert result.returncode == 2, result.stderr[-1500:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("error: "), lines
    assert all(part in lines[-1] for part in parts), lines[-1]
    assert all(line.startswith("INFO") for line in lines[:-1]) if after_logs else len(lines) == 1, lines


def test_overlay_never_writes_over_its_inputs(tmp_path: Path, trained_captioner) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.png", "b.png"):
        (photos / name).write_bytes((trained_captioner["scenes"] / "images" / "test" / "1.png").read_bytes())
    before = {path.name: path.read_bytes() for path in photos.iterdir()}
    one_line_error(run("overlay", "--ckpt", str(trained_captioner["ckpt"]), str(photos), "--out", str(photos)),
                   str(photos), "did not write")  # a folder of the user's files, without --overwrite
    one_line_error(run("overlay", "--ckpt", str(trained_captioner["ckpt"]), str(photos), "--out", str(photos),
                       "--overwrite"), str(photos / "a.png"), "is one of the inputs")
    assert {path.name: path.read_bytes() for path in photos.iterdir()} == before  # nothing changed, nothing added
    results = tmp_path / "results.json"
    assert run("caption", "--ckpt", str(trained_captioner["ckpt"]), str(photos), "--out", str(results)).returncode == 0
    one_line_error(run("overlay", str(results), "--out", str(photos), "--overwrite"), "is one of the inputs")
    assert {path.name: path.read_bytes() for path in photos.iterdir()} == before


def test_a_second_fit_in_the_same_folder_is_refused_unless_overwrite(tmp_path: Path) -> None:

    fit = ("fit", *tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path))
    assert run(*fit).returncode == 0
    best = tmp_path / "checkpoints" / "best.ckpt"
    first, written = best.read_bytes(), best.stat().st_mtime_ns
    one_line_error(run(*fit), str(tmp_path / "checkpoints"), "best.ckpt, last.ckpt", "--overwrite true",
                   after_logs=True)
    assert best.read_bytes() == first and best.stat().st_mtime_ns == written  # the first run's are untouched
    assert run(*fit, "--overwrite", "true").returncode == 0
    # written again, as asked for (this config keeps Lightning's version counter: best-v1.ckpt beside best.ckpt)
    assert any(path.stat().st_mtime_ns > written for path in best.parent.glob("best*.ckpt"))


def test_ctrl_c_during_caption_keeps_the_finished_captions(tmp_path: Path, trained_captioner) -> None:
    import json
    import os
    import signal

    count = 2000  # far more than are captioned before the interrupt lands, even on a loaded machine
    photos = tmp_path / "photos"
    photos.mkdir()
    scene = (trained_captioner["scenes"] / "images" / "test" / "1.png").read_bytes()
    for index in range(count):
        (photos / f"{index:04d}.png").write_bytes(scene)
    out = tmp_path / "results.json"
    process = subprocess.Popen([console_script(), "caption", "--ckpt", str(trained_captioner["ckpt"]), str(photos),
                                "--batch-size", "1", "--out", str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               # as from a terminal: pytest-xdist's workers ignore SIGINT, and a child would inherit it
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    printed = [process.stdout.readline() for _ in range(5)]  # five captions made: interrupt
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=120)
    printed += [line for line in rest.splitlines(keepends=True) if line.strip()]
    assert process.returncode == 130 and "Traceback" not in stderr
    records = json.loads(out.read_text())
    # every printed caption was kept (the interrupt may also land after a caption was kept, before it was printed)
    assert 5 <= len(records) < count and len(records) - len(printed) in (0, 1)
    assert stderr.strip().splitlines()[-1] == \
        f"interrupted: wrote the {len(records)} of {count} captions finished so far to {out}"
    assert [f"{r['file_name']}: {r['caption']}\n" for r in records][: len(printed)] == printed


@pytest.mark.parametrize("root", ["missing", "a_file", "empty"])
def test_a_bad_data_root_is_named_in_one_line_not_in_a_union_dump(root: str, tmp_path: Path) -> None:
    from tests.conftest import shipped

    path = {"missing": tmp_path / "nothing", "a_file": tmp_path / "file.txt", "empty": tmp_path / "empty"}[root]
    if root == "a_file":
        path.write_text("x")
    if root == "empty":
        (path / "train").mkdir(parents=True)
    result = run("fit", *shipped("trainer/cpu.yaml", "tasks/classifier.yaml", "vit/imagefolder.yaml"),
                 "--data.init_args.root", str(path), "--trainer.default_root_dir", str(tmp_path / "run"))
    one_line_error(result, str(path), after_logs=True)
    assert "Union" not in result.stderr and "Namespace" not in result.stderr


def test_a_min_word_count_that_keeps_no_word_is_refused(tmp_path: Path) -> None:

    result = run("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(tmp_path / "s"),
                 "--data.init_args.vocabulary.min_word_count", "100000",
                 "--trainer.default_root_dir", str(tmp_path / "run"))
    one_line_error(result, "min_word_count 100000 keeps no word", after_logs=True)
    assert not (tmp_path / "run").exists()


def test_vocab_json_records_the_min_word_count_used(tmp_path: Path) -> None:
    import json


    result = run("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(tmp_path / "s"),
                 "--data.init_args.vocabulary.min_word_count", "2", "--trainer.default_root_dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads(next((tmp_path / "run").rglob("vocab.json")).read_text())
    assert saved["min_count"] == 2


def test_overlay_that_fails_half_way_leaves_no_half_made_gallery(tmp_path: Path, trained_captioner) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.png").write_bytes((trained_captioner["scenes"] / "images" / "test" / "1.png").read_bytes())
    (photos / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # unreadable: drawn second, after a.png
    new, existing = tmp_path / "new_gallery", tmp_path / "old_gallery"
    existing.mkdir()
    (existing / "keep.txt").write_text("earlier work")
    for out in (new, existing):  # --overwrite: write beside the user's keep.txt
        one_line_error(run("overlay", str(photos / "a.png"), str(photos / "b.png"), "--ckpt",
                           str(trained_captioner["ckpt"]), "--out", str(out), "--overwrite"), str(photos / "b.png"))
    assert not new.exists()  # the folder it would have made is gone with the staging area
    assert sorted(path.name for path in existing.iterdir()) == ["keep.txt"]  # no a.png, no index.html, no staging


@pytest.mark.parametrize("setting", [("--data.init_args.loader.batch_size", "-3", "batch_size must be at least 1"),
                                     ("--data.init_args.loader.num_workers", "-1", "num_workers"),
                                     ("--trainer.max_epochs", "-5", "Lightning refused a setting: `max_epochs`")])
def test_a_bad_number_in_the_training_config_is_one_line(setting: tuple[str, str, str], tmp_path: Path) -> None:

    option, value, message = setting
    result = run("fit", *tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path / "run"),
                 option, value)
    one_line_error(result, message, after_logs=True)
    assert not list((tmp_path / "run").rglob("*.ckpt"))
