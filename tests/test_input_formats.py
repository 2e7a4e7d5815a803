"""Every JSON file the tools read goes through one reader (``vision_attn.data.formats.read_json``: size and nesting
bounded before decoding) and its format's validator: each bad file below, through the real commands in this
process, is one ``error:`` line naming the file (and the record and field) and exit 2, before any scoring or
drawing; then hypothesis fuzzes each format's reader, which must accept or refuse with one of our errors."""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import run_in_process
from vision_attn.data.coco import read_coco_captions, read_instances, read_karpathy, read_object_targets
from vision_attn.data.formats import MAX_JSON_DEPTH, nesting_depth, read_json
from vision_attn.data.scenes import make_scenes
from vision_attn.data.vocabulary import Vocabulary, has_words
from vision_attn.results import read_scored_results

DEEP = "[" * 100_000


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> dict[str, Any]:
    """Three generated test scenes: their captions, instances and attributes files, images, and the files' content."""
    root = tmp_path_factory.mktemp("formats") / "scenes"
    make_scenes(root, counts={"train": 0, "val": 0, "test": 3})
    found: dict[str, Any] = {kind: root / "annotations" / f"{kind}_test.json"
                             for kind in ("captions", "instances", "attributes")}
    found |= {f"{kind}_data": json.loads(found[kind].read_text()) for kind in ("captions", "instances", "attributes")}
    found["images"] = root / "images" / "test"
    return found


def attention_record(image_id: int, file_name: str, caption: str) -> dict[str, Any]:
    """A results record as `caption` writes it, with uniform attention on a 2x2 grid."""
    tokens = caption.replace(",", "").split()
    return {"image_id": image_id, "file_name": file_name, "caption": " ".join(tokens), "tokens": tokens,
            "grid": [2, 2], "image_size": [96, 96], "alphas": [[0.25] * 4 for _ in tokens],
            "betas": [0.5] * len(tokens)}


def good_results(scenes: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per scene, its first reference caption, its image by absolute path."""
    first: dict[int, str] = {}
    for annotation in scenes["captions_data"]["annotations"]:
        first.setdefault(annotation["image_id"], annotation["caption"])
    return [attention_record(image_id, str(scenes["images"] / f"{image_id}.png"), caption)
            for image_id, caption in first.items()]


def write(path: Path, content: Any) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def refused_in_one_line(args: list[str], named: Path, *fragments: str) -> str:
    """``vision-attn ARGS`` in process: exit 2 and one ``error:`` line naming ``named`` with every fragment."""
    result = run_in_process(*map(str, args))
    assert result.returncode == 2, (args, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}: "), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def evaluate(results: Path, annotations: Path, out: Path, instances: Path | None = None,
             attributes: Path | None = None) -> list[str]:
    return ["evaluate", results, "--annotations", annotations, "--out", out,
            *(["--instances", instances] if instances else []), *(["--attributes", attributes] if attributes else [])]


# --- 100,000 levels of nesting, in every file every command reads ----------------------------------------------
DEEP_CASES = ["evaluate results", "evaluate annotations", "evaluate instances", "evaluate attributes",
              "caption --coco-annotations", "overlay results", "explore results", "explore --instances"]


@pytest.mark.parametrize("case", DEEP_CASES)
def test_deeply_nested_json_is_one_line_in_every_reader(case: str, scenes, tmp_path: Path, request) -> None:
    deep = write(tmp_path / "deep.json", DEEP)
    results = write(tmp_path / "results.json", good_results(scenes))
    out = tmp_path / "out"
    files = {"results": results, "annotations": scenes["captions"], "instances": scenes["instances"],
             "attributes": scenes["attributes"]}
    if case.startswith("evaluate"):
        files[case.split()[1]] = deep
        args = evaluate(files["results"], files["annotations"], out / "s.json", files["instances"],
                        files["attributes"])
    elif case.startswith("caption"):
        ckpt = request.getfixturevalue("trained_captioner")["ckpt"]
        args = ["caption", "--ckpt", ckpt, "--coco-annotations", deep, "--image-dir", scenes["images"],
                "--out", out / "r.json"]
    elif case == "explore --instances":
        args = ["explore", results, "--instances", deep, "--out", out]
    else:
        args = [case.split()[0], deep, "--out", out]
    refused_in_one_line(args, deep, f"nested 100000 levels deep, more than the {MAX_JSON_DEPTH} allowed")
    assert not out.exists()


# --- evaluate's ordinary mistakes --------------------------------------------------------------------------------
def without_references(scenes: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(scenes["captions_data"])
    data["annotations"] = [a for a in data["annotations"] if a["image_id"] != 3]
    return data


def with_caption(scenes: dict[str, Any], caption: Any) -> dict[str, Any]:
    data = copy.deepcopy(scenes["captions_data"])
    data["annotations"][4]["caption"] = caption
    return data


def with_image_field(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    data["images"][1][key] = value
    return data


# name -> (which file is bad: results/annotations/instances/attributes, its content from the scenes, fragments)
MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], Any], tuple[str, ...]]] = {
    "instances given as --annotations": ("annotations", lambda s: s["instances_data"],
                                         ("annotations[0] (id 1): 'caption' must be a string", "instances file")),
    "annotations without annotations": ("annotations", lambda s: {"images": s["captions_data"]["images"]},
                                        ("not a COCO captions file: no 'annotations' list",)),
    "an image without references": ("annotations", without_references,
                                    ("images of", "have no reference captions", "image ids 3")),
    "reference caption 123": ("annotations", lambda s: with_caption(s, 123),
                              ("annotations[4] (id 5): 'caption' must be a string, got 123",)),
    "reference caption null": ("annotations", lambda s: with_caption(s, None),
                               ("annotations[4] (id 5): 'caption' must be a string, got None",)),
    "captions image width text": ("annotations", lambda s: with_image_field(s["captions_data"], "width", "96"),
                                  ("images[1] (id 2): 'width' must be a positive whole number, got '96'",)),
    "instances image width text": ("instances", lambda s: with_image_field(s["instances_data"], "width", "96"),
                                   ("images[1] (id 2): 'width' must be a positive whole number, got '96'",)),
    "instances without images": ("instances", lambda s: {k: v for k, v in s["instances_data"].items()
                                                         if k != "images"},
                                 ("not a COCO instances file: no 'images' list",)),
    "instances category unknown": ("instances", lambda s: {**s["instances_data"], "categories": []},
                                   ("annotations[0] (id 1): category_id", "is not one of 'categories'")),
    "attributes colour a number": ("attributes", lambda s: {**s["attributes_data"], "instances": [
        {**s["attributes_data"]["instances"][0], "colour": 5}]}, ("instances[0] (id 1): 'colour' must be",)),
    "attributes of another split": ("attributes", lambda s: {**s["attributes_data"], "instances": [
        {"id": 999, "colour": "red"}]}, ("instances[0] (id 999): no annotation of the instances file",)),
    "results caption 123": ("results", lambda s: [*good_results(s)[:2], {"image_id": 3, "caption": 123}],
                            ("record 2 (image 3): caption must be a string, got 123",)),
    "results caption null": ("results", lambda s: [{"image_id": 1, "caption": None}],
                             ("record 0 (image 1): caption must be a string, got None",)),
    "results image not in annotations": ("results", lambda s: [{"image_id": 77, "caption": "a top"}],
                                         ("1 image ids are not in", "e.g. 77")),
    "results not a list": ("results", lambda s: {"image_id": 1, "caption": "a top"},
                           ("expected the COCO results format",)),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_evaluate_refuses_an_ordinary_mistake_naming_file_record_and_field(mistake: str, scenes,
                                                                           tmp_path: Path) -> None:
    which, content, fragments = MISTAKES[mistake]
    files = {"results": tmp_path / "results.json", "annotations": scenes["captions"],
             "instances": scenes["instances"], "attributes": scenes["attributes"]}
    write(files["results"], good_results(scenes))
    files[which] = write(tmp_path / f"bad_{which}.json", content(scenes))
    named = files["annotations"] if mistake == "an image without references" else files[which]
    out = tmp_path / "scores.json"
    refused_in_one_line(evaluate(files["results"], files["annotations"], out, files["instances"],
                                 files["attributes"]), named, *fragments)
    assert not out.exists()


def test_a_bbox_of_three_numbers_is_refused_before_any_scoring(scenes, tmp_path: Path) -> None:
    instances = copy.deepcopy(scenes["instances_data"])
    instances["annotations"][2]["bbox"] = [1, 2, 3]
    bad = write(tmp_path / "instances.json", instances)
    results = write(tmp_path / "results.json", good_results(scenes))
    start = time.perf_counter()
    refused_in_one_line(evaluate(results, scenes["captions"], tmp_path / "s.json", bad), bad,
                        "annotations[2] (id 3): 'bbox' must be four finite numbers", "[1, 2, 3]")
    assert time.perf_counter() - start < 5, "scoring ran before the instances were checked"


# --- what used to be wrong successes -----------------------------------------------------------------------------
@pytest.mark.parametrize("size", [[0, 96], [96, 96, 96], ["96", "96"], [1e308, 96]])
def test_one_bad_image_size_is_refused_not_pointing_dropped_for_the_whole_file(size, scenes, tmp_path: Path) -> None:
    records = good_results(scenes)
    records[1]["image_size"] = size
    results = write(tmp_path / "results.json", records)
    refused_in_one_line(evaluate(results, scenes["captions"], tmp_path / "s.json", scenes["instances"]), results,
                        "record 1 (image 2): image_size must be two positive whole numbers")


def test_two_records_of_one_image_with_different_captions_are_refused_naming_both(scenes, tmp_path: Path) -> None:
    records = good_results(scenes)
    records.append({"image_id": 2, "caption": "a different caption"})
    results = write(tmp_path / "results.json", records)
    refused_in_one_line(evaluate(results, scenes["captions"], tmp_path / "s.json"), results,
                        "records 1 and 3 both caption image 2", "a different caption")


def test_a_key_given_twice_in_one_object_is_refused_naming_the_file_and_key(scenes, tmp_path: Path) -> None:
    """JSON keeps a repeated key's last value without a word; every reader refuses the file instead, in one line."""
    record = json.dumps(good_results(scenes)[0])
    results = write(tmp_path / "results.json", "[" + record.replace('"caption": ', '"caption": "a red top", '
                                                                     '"caption": ', 1) + "]")
    refused_in_one_line(evaluate(results, scenes["captions"], tmp_path / "scores.json"), results,
                        "the key 'caption' is given twice in one object")
    annotations = scenes["captions"].read_text()
    captions = write(tmp_path / "captions.json", annotations.replace('"images":[', '"images":[],"images":[', 1))
    refused_in_one_line(evaluate(write(tmp_path / "ok.json", good_results(scenes)), captions, tmp_path / "s.json"),
                        captions, "the key 'images' is given twice")
    assert not (tmp_path / "scores.json").exists() and not (tmp_path / "s.json").exists()
    assert read_json(write(tmp_path / "same.json", '[{"a": 1}, {"a": 2}]'), "a list") == [{"a": 1}, {"a": 2}]


def test_valid_results_score_with_pointing_a_repeat_kept_once_and_image_size_optional(scenes, tmp_path: Path) -> None:
    records = good_results(scenes)
    del records[0]["image_size"]  # the grid then covers the image file, whose size the instances give
    records.append(copy.deepcopy(records[2]))  # DDP's padding repeats an image: scored once
    results = write(tmp_path / "results.json", records)
    out = tmp_path / "scores.json"
    result = run_in_process(*map(str, evaluate(results, scenes["captions"], out, scenes["instances"],
                                               scenes["attributes"])))
    assert result.returncode == 0, result.stderr[-2000:]
    scores = json.loads(out.read_text())
    assert scores["images"] == 3 and scores["pointing_words"] > 0 and scores["object_recall"] == 1.0


def test_explore_reads_its_instances_before_drawing_and_shows_each_images_objects(scenes, tmp_path: Path) -> None:
    results = write(tmp_path / "results.json", good_results(scenes))
    result = run_in_process("explore", str(results), "--instances", str(scenes["instances"]), "--attributes",
                            str(scenes["attributes"]), "--out", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-2000:]
    item = (tmp_path / "site" / "data" / "items" / "0.js").read_text()
    assert '"objects":[{"name":' in item and '"colour":"' in item
    bad = copy.deepcopy(scenes["attributes_data"])
    bad["instances"][0]["colour"] = ["red"]
    attributes = write(tmp_path / "attributes.json", bad)
    refused_in_one_line(["explore", results, "--instances", scenes["instances"], "--attributes", attributes,
                         "--out", tmp_path / "site2"], attributes, "instances[0] (id 1): 'colour'")
    assert not (tmp_path / "site2").exists()


def test_the_training_readers_refuse_deep_and_malformed_files_in_one_line(scenes, tmp_path: Path) -> None:
    deep = write(tmp_path / "deep.json", DEEP)
    for read in (lambda path: read_object_targets(path), lambda path: read_karpathy(path, tmp_path),
                 lambda path: Vocabulary.from_json(path), lambda path: read_coco_captions(path, tmp_path)):
        with pytest.raises(ValueError, match=f"^{deep}: JSON nested 100000 levels deep"):
            read(deep)
    unsized = copy.deepcopy(scenes["instances_data"])
    del unsized["images"][0]["width"]
    path = write(tmp_path / "unsized.json", unsized)
    with pytest.raises(ValueError, match=r"images\[0\] \(id 1\) has no width and height"):
        read_object_targets(path)
    targets = read_object_targets(scenes["instances"], scenes["attributes"])
    assert len(targets.per_image) == 3 and targets.colours == scenes["attributes_data"]["colours"]


# --- read_json's bounds ------------------------------------------------------------------------------------------
def test_read_json_bounds_depth_size_and_encoding_in_one_line(tmp_path: Path) -> None:
    at_bound = write(tmp_path / "ok.json", "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert nesting_depth(at_bound.read_bytes()) == MAX_JSON_DEPTH and read_json(at_bound, "a test JSON") == [
        json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))]
    over = write(tmp_path / "over.json", "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(ValueError, match=f"nested {MAX_JSON_DEPTH + 1} levels deep"):
        read_json(over, "a test JSON")
    brackets_in_strings = write(tmp_path / "strings.json", json.dumps(["[" * 500 + '\\"{', {"a": "}" * 9}]))
    assert read_json(brackets_in_strings, "a test JSON")[1] == {"a": "}" * 9}
    big = write(tmp_path / "big.json", json.dumps(list(range(100))))
    with pytest.raises(ValueError, match=r"big.json: \d+ bytes, more than the 100 bytes"):
        read_json(big, "a test JSON", max_bytes=100)
    latin = tmp_path / "latin.json"
    latin.write_bytes('["café"]'.encode("latin-1"))
    with pytest.raises(ValueError, match="latin.json: not a readable JSON file \\(not UTF-8"):
        read_json(latin, "a test JSON")
    for text in ("[1, 2", "9" * 5000, ""):
        with pytest.raises(ValueError, match="not a readable JSON file") as error:
            read_json(write(tmp_path / "bad.json", text), "a test JSON")
        assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match=r"nope.json: no such file \(a test JSON was expected\)"):
        read_json(tmp_path / "nope.json", "a test JSON")


# --- fuzzing: each format's reader accepts, or refuses with one of our one-line errors ---------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 12) | st.floats(allow_nan=True)
                           | st.text(max_size=5), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=10)
DELETE = object()


def places(document: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON document, as the keys and indices that lead to it."""
    yield prefix
    items = document.items() if isinstance(document, dict) else enumerate(document) if isinstance(document,
                                                                                                    list) else ()
    for key, value in items:
        yield from places(value, (*prefix, key))


def changed(document: Any, changes: list[tuple[int, Any]]) -> Any:
    """``document`` with each (place number, value) change made: the value put there, or the place deleted."""
    document = copy.deepcopy(document)
    for pick, value in changes:
        found = list(places(document))
        place = found[pick % len(found)]
        if not place:
            document = None if value is DELETE else value
            continue
        parent = document
        for key in place[:-1]:
            parent = parent[key]
        if value is DELETE:
            del parent[place[-1]]
        else:
            parent[place[-1]] = value
    return document


def documents(good: Any) -> st.SearchStrategy:
    """Arbitrary JSON, or ``good`` with one to three places changed or deleted."""
    change = st.tuples(st.integers(0, 10_000), json_values | st.just(DELETE))
    return st.one_of(json_values, st.builds(changed, st.just(good), st.lists(change, min_size=1, max_size=3)))


def refused_cleanly(error: Exception, path: Path) -> None:
    assert isinstance(error, ValueError | FileNotFoundError), repr(error)
    assert str(error).startswith(str(path)) and "\n" not in str(error), str(error)


FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_fuzz_the_captions_reader(data, scenes, tmp_path: Path) -> None:
    path = write(tmp_path / "captions.json", data.draw(documents(scenes["captions_data"])))
    try:
        records = read_coco_captions(path, scenes["images"])
    except Exception as error:  # noqa: BLE001 - which exception it is is what is tested
        refused_cleanly(error, path)
        return
    assert records and all(isinstance(r.image_id, int) and r.captions and all(map(has_words, r.captions))
                           for r in records)


@FUZZ
@given(data=st.data())
def test_fuzz_the_instances_reader(data, scenes, tmp_path: Path) -> None:
    path = write(tmp_path / "instances.json", data.draw(documents(scenes["instances_data"])))
    try:
        found = read_instances(path)
    except Exception as error:  # noqa: BLE001
        refused_cleanly(error, path)
        return
    for objects in found.objects.values():
        for item in objects:
            assert isinstance(item.name, str) and len(item.box) == 4 and all(map(math.isfinite, item.box))
            assert item.box[2] >= 0 and item.box[3] >= 0
    assert all(size is None or min(size) > 0 for size in found.sizes.values())


@FUZZ
@given(data=st.data())
def test_fuzz_the_attributes_reader(data, scenes, tmp_path: Path) -> None:
    path = write(tmp_path / "attributes.json", data.draw(documents(scenes["attributes_data"])))
    try:
        found = read_instances(scenes["instances"], path)
    except Exception as error:  # noqa: BLE001
        refused_cleanly(error, path)
        return
    assert all(item.colour is None or isinstance(item.colour, str) for items in found.objects.values()
               for item in items)


@FUZZ
@given(data=st.data())
def test_fuzz_the_scored_results_reader(data, scenes, tmp_path: Path) -> None:
    path = write(tmp_path / "results.json", data.draw(documents(good_results(scenes))))
    try:
        records = read_scored_results(path)
    except Exception as error:  # noqa: BLE001
        refused_cleanly(error, path)
        return
    ids = [record["image_id"] for record in records]
    assert records and len(ids) == len(set(ids)) and all(isinstance(r["caption"], str) for r in records)
