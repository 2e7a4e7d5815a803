"""The format pages of docs/formats/ against the code: the results JSON that `caption` and `test` write against
its JSON Schema (and the schema against the reader's checks), the scenes page's words against the generator's
constants, the metrics page's logged names against the tasks; and the repository standing on its own (no file
cites a document outside it, or an issue tracker's numbers)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.conftest import REPO, run_in_process

FORMATS = REPO / "docs" / "formats"
SCHEMA = json.loads((FORMATS / "results.schema.json").read_text(encoding="utf-8"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def schema_errors(document: object) -> list[str]:
    """Every error the results schema finds in ``document`` (a list of records), as text."""
    return [error.message for error in VALIDATOR.iter_errors(document)]


def check_written(records: list[dict], count: int) -> None:
    """A results list as the code writes it: valid by the schema and by the reader, keys as the page lists."""
    from vision_attn.results import OPTIONAL_KEYS, RECORD_KEYS, record_problem

    assert len(records) == count
    assert schema_errors(records) == []
    for record in records:
        assert record_problem(record) is None
        assert set(RECORD_KEYS) <= set(record) <= set(RECORD_KEYS) | set(OPTIONAL_KEYS)
        assert set(record) <= set(SCHEMA["$defs"]["record"]["properties"])
        for beam in record.get("beams") or []:
            assert set(beam) <= set(SCHEMA["$defs"]["beam"]["properties"])


# --- (a) real output of `caption` and `test` against the schema ----------------------------------------------------

def test_caption_output_matches_the_schema(trained_captioner, tmp_path) -> None:
    """`caption` on image files (string ids, with every beam) and on a COCO split (integer ids) writes records the
    schema accepts, each with exactly the documented keys."""
    scenes = trained_captioner["scenes"]
    photo = tmp_path / "wide photo.jpg"
    Image.new("RGB", (120, 80), (200, 40, 40)).save(photo)
    own = tmp_path / "own.json"
    result = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), str(scenes / "images" / "test" /
                            "1.png"), str(photo), "--beam", "2", "--all-beams", "--out", str(own))
    assert result.returncode == 0, result.stderr
    records = json.loads(own.read_text())
    check_written(records, 2)
    assert [r["image_id"] for r in records] == ["1.png", "wide photo.jpg"] and all(r["beams"] for r in records)

    coco = tmp_path / "coco.json"
    result = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), "--coco-annotations",
                            str(scenes / "annotations" / "captions_test.json"), "--image-dir",
                            str(scenes / "images" / "test"), "--out", str(coco))
    assert result.returncode == 0, result.stderr
    records = json.loads(coco.read_text())
    check_written(records, 6)
    assert all(isinstance(r["image_id"], int) and "beams" not in r for r in records)


def test_the_shipped_caption_outputs_match_the_schema() -> None:
    """The caption outputs kept beside the legacy checkpoints are valid results files too."""
    for name in ("captioner_captions.json", "captioner_vit_captions.json"):
        assert schema_errors(json.loads((REPO / "tests" / "fixtures" / "legacy" / name).read_text())) == [], name


# --- (b) the schema and the reader agree ------------------------------------------------------------------------------

GOOD = {"image_id": 7, "file_name": "scene.png", "caption": "a red top", "tokens": ["a", "red", "top"],
        "grid": [2, 2], "image_size": [96, 96], "alphas": [[0.25] * 4, [0.7, 0.1, 0.1, 0.1], [1, 0, 0, 0]],
        "betas": [0.5, 0.25, 1.0]}
BEAM = {"caption": "a red top", "tokens": ["a", "red", "top"], "alphas": GOOD["alphas"], "betas": GOOD["betas"],
        "log_prob": -1.5, "score": -0.5}


def changed(path: tuple, value: object) -> dict:
    """GOOD with the field at ``path`` set to ``value`` (``...``: the field removed)."""
    record = copy.deepcopy(GOOD)
    *parents, last = path
    target = record
    for key in parents:
        target = target[key]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return record


ACCEPTED = [changed(("image_id",), "photo.png"), changed(("betas",), None), changed(("betas",), ...),
            changed(("image_size",), None), changed(("image_size",), ...), changed(("references",), ["a top"]),
            changed(("head_alphas",), [[[0.25] * 4, [0.5, 0.5, 0, 0]]] * 3), changed(("beams",), None),
            changed(("beams",), [BEAM, {**BEAM, "log_prob": -3, "betas": None}]),
            {**GOOD, "caption": "", "tokens": [], "alphas": [], "betas": []}]
REFUSED = [changed(("file_name",), ...), changed(("file_name",), ""), changed(("image_id",), True),
           changed(("image_id",), 1.5), changed(("image_id",), None), changed(("caption",), 3),
           changed(("caption",), ...), changed(("tokens",), "a red top"), changed(("tokens",), ["a", 1, "top"]),
           changed(("grid",), [4]), changed(("grid",), [0, 4]), changed(("grid",), [2, "2"]),
           changed(("grid",), ...), changed(("image_size",), [96]), changed(("image_size",), [96, -96]),
           changed(("alphas",), ...), changed(("alphas",), "none"), changed(("alphas", 1, 0), -0.1),
           changed(("alphas", 2, 3), "0"), changed(("alphas", 0, 0), True), changed(("betas", 1), -1),
           changed(("betas",), "0.5"), changed(("head_alphas",), [[]] * 3), changed(("head_alphas",), [[3]] * 3),
           changed(("beams",), []), changed(("beams",), ["a red top"]),
           changed(("beams",), [{k: v for k, v in BEAM.items() if k != "caption"}]),
           changed(("beams",), [{**BEAM, "tokens": None}]), changed(("beams",), [{**BEAM, "log_prob": "-1"}]),
           changed(("beams",), [{**BEAM, "alphas": [[0.25] * 4, [-1, 1, 1, 0], [1, 0, 0, 0]]}]), ["not a record"]]
# What JSON Schema cannot say (docs/formats/results.md): lengths that depend on other fields
SCHEMA_CANNOT_SAY = [changed(("alphas",), GOOD["alphas"][:2]), changed(("alphas", 1), [0.5, 0.5]),
                     changed(("betas",), [0.5]), changed(("head_alphas",), [[[0.25] * 4]] * 2),
                     changed(("head_alphas",), [[[0.25] * 4], [[0.25] * 4] * 2, [[0.25] * 4]]),
                     changed(("beams",), [{**BEAM, "alphas": [[0.5, 0.5]] * 3}])]


@pytest.mark.parametrize("record", ACCEPTED, ids=range(len(ACCEPTED)))
def test_records_the_reader_accepts_the_schema_accepts(record: dict, tmp_path) -> None:
    """A valid record passes the schema, ``record_problem`` and ``read_results`` alike."""
    from vision_attn.results import read_results, record_problem

    assert record_problem(record) is None and schema_errors([record]) == []
    (tmp_path / "scene.png").write_bytes(b"")
    (tmp_path / "results.json").write_text(json.dumps([GOOD, record]))
    assert [found for found, _ in read_results(tmp_path / "results.json")] == [GOOD, record]


@pytest.mark.parametrize("record", REFUSED, ids=range(len(REFUSED)))
def test_records_the_schema_refuses_the_reader_refuses(record: object, tmp_path) -> None:
    """A bad record fails the schema, ``record_problem`` and ``read_results`` alike."""
    from vision_attn.results import read_results, record_problem

    assert schema_errors([record]) != []
    assert record_problem(record) is not None
    (tmp_path / "scene.png").write_bytes(b"")
    (tmp_path / "results.json").write_text(json.dumps([GOOD, record]))
    with pytest.raises(ValueError, match="results.json"):
        read_results(tmp_path / "results.json")


@pytest.mark.parametrize("record", SCHEMA_CANNOT_SAY, ids=range(len(SCHEMA_CANNOT_SAY)))
def test_what_the_schema_cannot_say_the_reader_checks(record: dict) -> None:
    """Lengths tied to other fields (tokens, grid, the heads of the first token) are the reader's alone."""
    from vision_attn.results import record_problem

    assert schema_errors([record]) == [] and record_problem(record) is not None


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 40) | st.floats(-1, 2, allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(list(BEAM)), inner, max_size=3),
    max_leaves=16)


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from([*GOOD, "head_alphas", "beams"]), JSON_VALUES, max_size=3))
def test_fuzz_whatever_the_reader_accepts_the_schema_accepts(changes: dict) -> None:
    """Records with random JSON in up to three fields: the schema never refuses one the reader accepts (the other
    way round it may, only where the page says JSON Schema cannot)."""
    from vision_attn.results import record_problem

    record = {**GOOD, **changes}
    if record_problem(record) is None:
        assert schema_errors([record]) == [], record


def test_the_results_file_is_a_list() -> None:
    """The schema, as the reader, takes a list of records only."""
    assert schema_errors({"0": GOOD}) and schema_errors(GOOD) and not schema_errors([])


# --- (c) the pages name what the code has ---------------------------------------------------------------------------

def table_after(page: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first Markdown table after ``heading`` in ``page``."""
    text = (FORMATS / page).read_text(encoding="utf-8")
    assert heading in text, f"{page} has no heading {heading!r}"
    rows = []
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return [row for row in rows[1:] if not set("".join(row)) <= set("-: ")]


def triples(cell: str) -> list[tuple[int, ...]]:
    """The (r, g, b) triples written in a table cell."""
    return [tuple(map(int, found)) for found in re.findall(r"\((\d+), (\d+), (\d+)\)", cell)]


def test_scenes_page_lists_the_generator_words() -> None:
    """Class words in label order with their category ids, the relations, the colours and the palettes."""
    from vision_attn.data.scenes import CLASS_WORDS, COLOURS, PALETTES, RELATIONS, category_id

    classes = table_after("scenes.md", "### Class words")
    assert [int(label) for label, _, _ in classes] == list(range(len(CLASS_WORDS)))
    assert [word.strip("`") for _, _, word in classes] == CLASS_WORDS
    assert [int(category) for _, category, _ in classes] == [category_id(label) for label in range(10)]
    assert [row[0].strip("`") for row in table_after("scenes.md", "### Relations")] == list(RELATIONS)
    colours = table_after("scenes.md", "### Colours")
    assert {row[0].strip("`"): triples(row[1])[0] for row in colours} == COLOURS
    assert [row[0].strip("`") for row in colours] == list(COLOURS)
    palettes = {row[0].split("`")[1]: [triples(cell)[0] for cell in row[1:]]
                for row in table_after("scenes.md", "### Palettes")}
    assert palettes == {name: list(rgb.values()) for name, rgb in PALETTES.items()}


def test_scenes_page_examples_are_what_the_generator_writes(tmp_path) -> None:
    """The page's three JSON examples are image 2 of the seed-0 test split, as ``make-scenes --test 2`` writes it."""
    from vision_attn.data.scenes import make_scenes

    make_scenes(tmp_path, counts={"test": 2}, seed=0)
    text = (FORMATS / "scenes.md").read_text(encoding="utf-8")
    examples = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.DOTALL)]
    shown = {"captions": examples[-3], "instances": examples[-2], "attributes": examples[-1]}
    for kind, example in shown.items():
        written = json.loads((tmp_path / "annotations" / f"{kind}_test.json").read_text())
        for key, value in written.items():
            if isinstance(value, list) and value and isinstance(value[0], dict) and "image_id" in value[0]:
                value = [entry for entry in value if entry["image_id"] == 2]
            elif key == "images":
                value = [entry for entry in value if entry["id"] == 2]
            elif key == "relations":
                value = [entry for entry in value if entry["caption_id"] in (6, 7, 8, 9, 10)]
            assert example[key] == value, (kind, key)
        assert set(example) == set(written), kind


def logged_names() -> set[str]:
    """The ``stage/name`` metric names of the metrics page's logged-names section."""
    text = (FORMATS / "metrics.md").read_text(encoding="utf-8")
    section = text.split("## Logged metric names", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`((?:train|val|test)/[\w\-]+)`", section))


def test_metrics_page_names_what_the_tasks_log(monkeypatch) -> None:
    """Every listed name is one the code logs, at that stage; every name the captioner's scoring, the ViT's map
    scores and the pinned test runs (``tests/fixtures/legacy``, METEOR included) produce is listed. Scored here
    without Java (METEOR and the PTB tokenizer left out), which takes a tenth of the time."""
    from vision_attn import metrics
    from vision_attn.captioning.evaluation import score_records
    from vision_attn.data.coco import SceneObject
    from vision_attn.tasks.classifiers import MAP_SCORES

    listed = logged_names()
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(metrics, "_warned", set())  # its one warning stays out of the other tests' way
    record = {"image_id": 1, "caption": "a red top", "tokens": ["a", "red", "top"], "grid": [2, 2],
              "image_size": [64, 64], "alphas": [[0.25] * 4, [0.25] * 4, [1, 0, 0, 0]],
              "references": ["a red top", "there is a red top"], "objects": [SceneObject("top", [0, 0, 20, 20], "red")]}
    scores = set(score_records([record]))
    assert {"CIDEr-D", "pointing_accuracy", "object_recall", "images"} <= scores
    code = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "vision_attn").rglob("*.py"))
    aids = "\n".join(path.read_text(encoding="utf-8")
                     for path in (REPO / "vision_attn" / "captioning" / "extensions").glob("*.py"))
    unknown = []
    for name in sorted(listed):
        stage, metric = name.split("/")
        if not (f'"{name}"' in code or f'{{stage}}/{metric}"' in code or f'"{metric}": (' in aids
                or (stage != "train" and (metric in scores | set(MAP_SCORES) or f'scores["{metric}"]' in code))):
            unknown.append(name)
    assert not unknown, f"docs/formats/metrics.md lists names the code does not log: {unknown}"
    produced = {f"{stage}/{metric}" for stage in ("val", "test") for metric in scores | set(MAP_SCORES)}
    for pinned in (REPO / "tests" / "fixtures" / "legacy").glob("*_test_metrics.json"):
        produced |= set(json.loads(pinned.read_text()))
    assert not produced - listed, f"logged but not in docs/formats/metrics.md: {sorted(produced - listed)}"


# --- the repository stands on its own ------------------------------------------------------------------------------

NOT_SCANNED: set[str] = set()  # every file is scanned
OUTSIDE_REFERENCES = [  # each pattern written so that it does not match itself
    re.compile(r"\bS" r"PEC\b"),  # the external specification the formats pages replace
    re.compile(r"(?:\.\./|/work/)shared\b"),  # a folder beside the checkout
    re.compile(r"\b(?:issues?|PRs?|pull requests?|tickets?)\s*#?\d+\b", re.IGNORECASE),  # an issue tracker's numbers
    re.compile(r"\(#\d+\)|\b(?:see|fix(?:es|ed)?|close[sd]?|resolve[sd]?)\s+#\d+", re.IGNORECASE),
]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    """No tracked (or new, not ignored) text file cites the external specification, a folder outside the
    checkout or issue numbers: the repository stands on its own."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode("utf-8").split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found = []
    for name in filter(None, listed):
        path = REPO / name
        if name in NOT_SCANNED or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if any(pattern.search(line) for pattern in OUTSIDE_REFERENCES):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_the_results_page_links_a_valid_schema() -> None:
    """The results page links its schema; the schema file is valid draft 2020-12."""
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert "(results.schema.json)" in (FORMATS / "results.md").read_text(encoding="utf-8")
    assert Path(FORMATS / "results.schema.json").is_file()
