"""Inputs bounded after they are parsed, not only by their bytes: a YAML config (or a command-line value) whose
aliases expand it, or that nests too deeply, and results, captions and instances files whose captions, ids, sizes
or arrays hold more than a decoder writes or memory can hold. Each is one ``error:`` line naming the file (or the
option), the record and the field, within seconds, before any model, scoring or Java runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_in_process, tiny
from tests.test_input_formats import evaluate, good_results, refused_in_one_line, write
from vision_attn.data import formats
from vision_attn.data.formats import MAX_CAPTION_CHARS, MAX_CAPTION_WORDS, MAX_JSON_CONTAINERS, read_json
from vision_attn.data.scenes import make_scenes
from vision_attn.results import MAX_RESULTS_WORDS

CAPTIONER = tiny("captioner_tiny.yaml")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> dict[str, Any]:
    """Three generated test scenes: their captions and instances files, and their images."""
    root = tmp_path_factory.mktemp("bounded") / "scenes"
    make_scenes(root, counts={"train": 0, "val": 0, "test": 3})
    found: dict[str, Any] = {kind: root / "annotations" / f"{kind}_test.json" for kind in ("captions", "instances")}
    return found | {"captions_data": json.loads(found["captions"].read_text()), "images": root / "images" / "test"}


def nested_aliases(levels: int = 9, width: int = 9) -> str:
    """The probes' config: ``levels`` lists, each of ``width`` aliases of the one before (width**levels leaves)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]" for n in range(1, levels)]
    return "trainer:\n  max_epochs: 1\ndata:\n  " + "\n  ".join(lines) + "\n"


def deep_aliases(levels: int = 8) -> str:
    """Aliases that each nest the one before 20 levels deeper: shallow as written, 160 levels once expanded."""
    lines = ["a0: &a0 [1]"] + [f"a{n}: &a{n} {'[' * 20}*a{n - 1}{']' * 20}" for n in range(1, levels + 1)]
    return "data:\n  " + "\n  ".join(lines) + "\n"


CONFIGS = {
    "nested aliases": (nested_aliases(), "grows past 16 MiB once its YAML aliases (*name) are expanded"),
    "an alias inside itself": ("trainer: &t\n  callbacks: [*t]\n", "holds a YAML alias inside the node it names"),
    "deep aliases": (deep_aliases(), "levels deep (aliases expanded), more than the 64 a config may"),
    "deep nesting": ("trainer: " + "[" * 5000 + "]" * 5000 + "\n", "nests too deeply to be a config"),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_config_that_expands_is_one_line_naming_it(kind: str, tmp_path: Path) -> None:
    text, expected = CONFIGS[kind]
    config = write(tmp_path / "config.yaml", text)
    assert config.stat().st_size < 100_000  # small as bytes: the size check alone lets it through
    start = time.perf_counter()
    result = run_in_process("fit", *CAPTIONER, "--config", str(config), "--trainer.default_root_dir",
                            str(tmp_path / "run"))
    assert time.perf_counter() - start < 20
    line = one_line(result)
    assert line.startswith(f"error: {config}: ") and expected in line, line
    assert not (tmp_path / "run").exists()


def test_an_expanding_yaml_file_named_anywhere_is_one_line(tmp_path: Path) -> None:
    """As the value of any option, and named inside a config (jsonargparse reads both as YAML)."""
    bomb = write(tmp_path / "decoding.yaml", nested_aliases())
    outer = write(tmp_path / "outer.yaml", f"model:\n  init_args:\n    decoding: {bomb.name}\n")
    for args in (["--model.init_args.decoding", str(bomb)], ["--config", str(outer)]):
        result = run_in_process("fit", *CAPTIONER, *args, "--trainer.default_root_dir", str(tmp_path / "run"))
        line = one_line(result)
        assert line.startswith(f"error: {bomb}: ") and "YAML aliases" in line, line


FLOW_ALIASES = "{" + ", ".join([f"l0: &l0 [{', '.join(['lol'] * 9)}]"] + [
    f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, 9)]) + "}"  # nested_aliases, in one line


@pytest.mark.parametrize("value", [FLOW_ALIASES, "[" * 5000 + "]" * 5000])
def test_an_expanding_command_line_value_is_one_line_naming_the_option(value: str, tmp_path: Path) -> None:
    result = run_in_process("fit", *CAPTIONER, "--model.init_args.decoding", value, "--trainer.default_root_dir",
                            str(tmp_path / "run"))
    line = one_line(result)
    assert line.startswith("error: --model.init_args.decoding: the value "), line
    assert "YAML aliases" in line or "nests too deeply" in line, line


def test_an_anchor_used_once_or_twice_is_still_a_config(tmp_path: Path) -> None:
    """Anchors within the bound are YAML that configs may use: the bound refuses growth, not the syntax."""
    config = write(tmp_path / "anchors.yaml", "trainer: &t\n  max_epochs: 1\n")
    result = run_in_process("fit", *CAPTIONER, "--config", str(config), "--print_config")
    assert result.returncode == 0, result.stderr[-2000:]


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


def long_caption(records: list[dict[str, Any]], caption: str, index: int = 1) -> list[dict[str, Any]]:
    """``records`` with record ``index``'s caption replaced (and its tokens, to match)."""
    changed = [dict(record) for record in records]
    changed[index] |= {"caption": caption, "tokens": caption.split()[:1], "alphas": changed[index]["alphas"][:1],
                       "betas": changed[index]["betas"][:1]}
    return changed


CAPTIONS = {
    "8 MB": ("a " * 4_000_000, "caption has 8000000 characters, more than the 4000"),
    "201 words": ("a " * 200 + "a", "caption has 201 words, more than the 200 a decoder writes"),
}


@pytest.mark.parametrize("kind", sorted(CAPTIONS))
@pytest.mark.parametrize("reader", ["evaluate", "overlay", "explore"])
def test_a_caption_longer_than_a_decoder_writes_is_refused_at_once(kind, reader, scenes, tmp_path) -> None:
    """The probes' 8 MB caption kept `evaluate` past 300 s with METEOR's Java at 2.2 GB: now one line naming the
    file, the record and the field, before any scoring."""
    caption, expected = CAPTIONS[kind]
    results = write(tmp_path / "results.json", long_caption(good_results(scenes), caption))
    args = {"evaluate": evaluate(results, scenes["captions"], tmp_path / "scores.json"),
            "overlay": ["overlay", results, "--out", tmp_path / "overlays"],
            "explore": ["explore", results, "--out", tmp_path / "site"]}[reader]
    start = time.perf_counter()
    refused_in_one_line(args, results, "record 1", expected)
    assert time.perf_counter() - start < 10
    assert not any((tmp_path / name).exists() for name in ("scores.json", "overlays", "site"))


def test_bare_results_and_references_are_bounded_too(scenes, tmp_path) -> None:
    """Another tool's bare results, the references of a COCO captions file, and the words of a whole file."""
    bare = [{"image_id": record["image_id"], "caption": record["caption"]} for record in good_results(scenes)]
    bare[2]["caption"] = "x" * (MAX_CAPTION_CHARS + 1)
    results = write(tmp_path / "bare.json", bare)
    refused_in_one_line(evaluate(results, scenes["captions"], tmp_path / "s.json"), results, "record 2",
                        f"more than the {MAX_CAPTION_CHARS}")
    references = json.loads(scenes["captions"].read_text())
    references["annotations"][1]["caption"] = " ".join(["word"] * (MAX_CAPTION_CHARS // 5 + 1))
    captions = write(tmp_path / "captions.json", references)
    good = write(tmp_path / "good.json", good_results(scenes))
    refused_in_one_line(evaluate(good, captions, tmp_path / "s.json"), captions, "annotations[1]",
                        f"more than the {MAX_CAPTION_CHARS}")
    many = [{"image_id": n, "caption": " ".join(["a"] * MAX_CAPTION_WORDS)}
            for n in range(MAX_RESULTS_WORDS // MAX_CAPTION_WORDS + 1)]
    crowded = write(tmp_path / "crowded.json", many)
    refused_in_one_line(evaluate(crowded, scenes["captions"], tmp_path / "s.json"), crowded,
                        f"more than the {MAX_RESULTS_WORDS} a results file may")


HUGE = {
    "an image id of 4000 digits": (lambda records: records[0].update(image_id=10**3999),
                                   "image_id must be a 64-bit whole number"),
    "a file name of 8 MB": (lambda records: records[0].update(file_name="x" * 8_000_000),
                            "file_name must be a non-empty string of at most 4096 characters"),
    "8 MB tokens": (lambda records: records[0].update(tokens=["x" * 8_000_000]), "tokens must be the caption's words"),
}


@pytest.mark.parametrize("kind", sorted(HUGE))
def test_huge_values_in_a_results_record_are_one_line(kind, scenes, tmp_path) -> None:
    change, expected = HUGE[kind]
    records = good_results(scenes)
    change(records)
    results = write(tmp_path / "results.json", records)
    line = refused_in_one_line(["overlay", results, "--out", tmp_path / "out"], results, "record 0", expected)
    assert len(line) < 1000


def test_a_width_of_4000_digits_in_an_instances_file_is_one_line(scenes, tmp_path) -> None:
    instances = json.loads(scenes["instances"].read_text())
    instances["images"][0]["width"] = 10**3999
    bad = write(tmp_path / "instances.json", instances)
    good = write(tmp_path / "results.json", good_results(scenes))
    refused_in_one_line(evaluate(good, scenes["captions"], tmp_path / "s.json", bad), bad,
                        "images[0] (id 1): 'width' must be a positive whole number", "(at most 2147483647)")


def test_a_json_of_more_arrays_than_memory_holds_is_refused_from_its_text(tmp_path, monkeypatch) -> None:
    """Each empty object is 3 bytes of text and tens of bytes decoded: their number is bounded before decoding
    (the bound lowered here, so that the file stays small; strings holding brackets do not count)."""
    monkeypatch.setattr(formats, "MAX_JSON_CONTAINERS", 1000)
    crowded = tmp_path / "crowded.json"
    crowded.write_bytes(b"[" + b"{}," * 1000 + b"{}]")
    with pytest.raises(ValueError, match="1002 JSON arrays and objects, more than the 1000 a file may hold here"):
        read_json(crowded, "a results JSON")
    quoted = write(tmp_path / "quoted.json", ["{}" * 1000])
    assert read_json(quoted, "a results JSON") == ["{}" * 1000]
    assert MAX_JSON_CONTAINERS >= 8 * 10**6  # COCO's largest file holds a few arrays and objects per annotation
