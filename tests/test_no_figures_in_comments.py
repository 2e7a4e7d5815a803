"""Comments say what and why, never a measured figure: a timing, a speed-up or an accuracy goes stale with the next
change. What was measured goes to docs/experiment-log.md (dated), the current figures to docs/benchmarks.md.

Every comment is read: the ``#`` comments (``tokenize``) and docstrings (every string statement, ``ast``: module,
class, function and attribute docstrings) of vision_attn/**/*.py, and the comments of configs/**/*.yaml and
tests/configs/**/*.yaml. Consecutive comment lines are read as one text, so a figure split over two lines is
found. A measured figure (``RULES``) is:

- a percentage: ``30%``, ``1-2.7%``, ``89.64%``;
- a time in seconds or less: ``2 s``, ``4.4 ms``, ``300 µs`` (a time that is a setting is the option's value, or
  in minutes: ``7.5 minutes`` of a ``max_time``);
- a speed-up or ratio: ``~4x``, ``80×``, ``1.2-1.3x the steps``, ``4 × faster``, ``3 times slower``; a shape or a
  product is not one (``12×12``, ``14x14x512``, ``8 × width``, ``4 × MAX_PIXELS``, ``σ(2x)``);
- an approximate or peak size in bytes: ``~400 KB``, ``about 2 GB``, ``1.7 GB at its peak``; an exact size is a
  bound or follows from a shape or a file (``1 GiB``, ``448 MB``, ``19900×19900 = 1.2 GB``);
- two figures compared: ``0.85 against 0.29``, ``~170 per caption against an NLL of ~2.5``;
- the machine a figure was taken on: ``measured on``/``under``, ``timed on``, ``a 2-core``, ``on 2 cores``,
  ``on one core``, ``the slower CPU``/``machine``, ``on an H100``.

Shapes, equations, bounds and defaults stated as facts (``at most 50``, ``0 to 1``), citations with years,
section and version numbers carry none of these. ``SETTINGS`` lists the few percentages that restate a
setting of their own file; each must still be found, so that the list cannot outlive its lines.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

NUMBER = r"(?<![\w.:])~?\d+(?:[.,]\d+)*"
COMPARATIVE = r"(?:faster|slower|quicker|smaller|larger|bigger|more|fewer|less)\b"
APPROXIMATE = r"(?:~\s?|\b(?:about|around|roughly|nearly|almost|some)\s+)"
BYTES = r"\s?(?:[KMGT]i?B|bytes)\b"

RULES: dict[str, re.Pattern[str]] = {
    "a percentage": re.compile(NUMBER + r"[⅓⅔¼½¾]?%"),
    "a time": re.compile(NUMBER + r"\s?(?:s|ms|µs|μs|us|ns)\b"),
    "a speed-up": re.compile(NUMBER + r"(?:[x×](?=[\s,;:.!?]|$)|\s?[x×]\s+(?=" + COMPARATIVE + r")"
                             r"|\s+times\s+(?=(?:faster|slower|quicker|smaller|larger|bigger)\b))"),
    "a measured size": re.compile(APPROXIMATE + r"\d+(?:\.\d+)?" + BYTES + r"|\d+(?:\.\d+)?" + BYTES
                                  + r"[^.;]{0,25}\bpeak\b|\bpeak\b[^.;]{0,25}\d+(?:\.\d+)?" + BYTES),
    "a comparison": re.compile(NUMBER + r"[^;()\d]{0,40}?\b(?:against|vs\.?|versus)\s+(?:\S+\s+){0,3}?~?\d[\d.,]*"),
    "a machine": re.compile(r"\b(?:measured|timed|profiled|benchmarked)\s+(?:on|under|at|in|with|by)\b"
                            r"|\b\d+-core\b|\bon (?:\d+|one|two) cores?\b|\bthe slower (?:CPU|machine)\b"
                            r"|\bon an? (?:NVIDIA )?[AHLTV]\d{2,3}\b"),
}

# (file, phrase, the setting it restates): a percentage within one of these phrases is that file's own value
SETTINGS: list[tuple[str, str, str]] = [
    ("configs/captioner/fashion_scenes.yaml", "70-107% size", "the training style's scale: [0.7, 1.07]"),
    ("configs/captioner/fashion_scenes.yaml", "black 75%; noise, texture, distractors 8⅓% each",
     "background_weights: [9, 1, 1, 1]"),
]


@dataclass(frozen=True)
class Comment:
    """One comment (consecutive comment lines, or one docstring): its file, first line and text, a line each."""

    path: str
    line: int
    text: str


@dataclass(frozen=True, order=True)
class Finding:
    """A measured figure in a comment: where, by which rule, and the text matched."""

    path: str
    line: int
    rule: str
    match: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {' '.join(self.match.split())!r}"


def joined(path: str, lines: list[tuple[int, str]]) -> list[Comment]:
    """Comment lines (line number, text without its ``#``) as comments, one per run of consecutive lines."""
    comments: list[Comment] = []
    run: list[tuple[int, str]] = []
    for number, text in lines:
        if run and number != run[-1][0] + 1:
            comments.append(Comment(path, run[0][0], "\n".join(t for _, t in run)))
            run = []
        run.append((number, text))
    if run:
        comments.append(Comment(path, run[0][0], "\n".join(t for _, t in run)))
    return comments


def python_comments(path: Path) -> list[Comment]:
    """The ``#`` comments and the docstrings (every string statement) of a Python file."""
    source = path.read_text(encoding="utf-8")
    name = path.relative_to(REPO).as_posix()
    hashes = [(token.start[0], token.string.lstrip("#").strip())
              for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT]
    docstrings = [Comment(name, node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str)]
    return joined(name, hashes) + docstrings


def yaml_comment_start(line: str) -> int | None:
    """Where the comment of one YAML line starts: a ``#`` at the line's start or after a blank, outside a quoted
    scalar (which opens after ``:``, ``-``, ``[``, ``{``, ``,``, ``?`` or at the line's start); None without one."""
    quote = ""
    previous = ""
    i = 0
    while i < len(line):
        char = line[i]
        if quote == "'" and char == "'" and line[i + 1:i + 2] == "'":
            i += 1
        elif quote == '"' and char == "\\":
            i += 1
        elif quote and char == quote:
            quote = ""
        elif not quote and char == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
        elif not quote and char in "'\"" and previous in ("", ":", "-", "[", "{", ",", "?"):
            quote = char
        if not quote and not char.isspace():
            previous = char
        i += 1
    return None


def yaml_comments(path: Path) -> list[Comment]:
    """The comments of a YAML file. The file less them must load as the file does: else a ``#`` taken for a
    comment's start was part of a value."""
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(REPO).as_posix()
    lines: list[tuple[int, str]] = []
    kept: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        start = yaml_comment_start(line)
        kept.append(line if start is None else line[:start].rstrip())
        if start is not None:
            lines.append((number, line[start:].lstrip("#").strip()))
    assert yaml.safe_load("\n".join(kept)) == yaml.safe_load(text), f"{name}: a '#' inside a value read as a comment"
    return joined(name, lines)


def every_comment() -> list[Comment]:
    """The comments of the package's Python files and of the configs."""
    comments = [c for path in sorted((REPO / "vision_attn").rglob("*.py")) for c in python_comments(path)]
    for folder in (REPO / "configs", REPO / "tests" / "configs"):
        comments += [c for path in sorted(folder.rglob("*.yaml")) for c in yaml_comments(path)]
    return comments


def figures(text: str) -> list[tuple[int, str, str]]:
    """The measured figures of a text: (offset, rule, the text matched), in order."""
    found = [(m.start(), rule, m.group()) for rule, pattern in RULES.items() for m in pattern.finditer(text)]
    return sorted(found)


def allowed(comment: Comment, start: int, end: int) -> tuple[str, str, str] | None:
    """The entry of ``SETTINGS`` whose phrase holds text[start:end] of ``comment``, if any."""
    for entry in SETTINGS:
        path, phrase, _ = entry
        if path == comment.path and any(m.start() <= start and end <= m.end()
                                        for m in re.finditer(re.escape(phrase), comment.text)):
            return entry
    return None


def test_no_comment_or_docstring_states_a_measured_figure() -> None:
    findings: list[Finding] = []
    used: set[tuple[str, str, str]] = set()
    for comment in every_comment():
        for start, rule, match in figures(comment.text):
            entry = allowed(comment, start, start + len(match))
            if entry:
                used.add(entry)
            else:
                findings.append(Finding(comment.path, comment.line + comment.text.count("\n", 0, start), rule, match))
    if findings:
        pytest.fail("measured figures in comments (move them to docs/experiment-log.md; the comment keeps the what "
                    "and why):\n" + "\n".join(map(str, sorted(set(findings)))))
    assert not set(SETTINGS) - used, f"SETTINGS entries that match nothing any more: {set(SETTINGS) - used}"


@pytest.mark.parametrize("text", [
    "4.4 ms against 9.6 ms for the fused kernel",
    "repeats with 4-5 objects 1-2.7% -> 0.3-1%",
    "encode each image once: ~4x faster on a CPU",
    "width 96 got 12 epochs (89.64%); 64 gets 19-20 (90.67-90.86%)",
    "the encoder's step ~30% faster",
    "Both fits end within 15 minutes on the slower CPU",
    "(measured under scripts/slower_cpu.sh)",
    "importing torchvision costs about 2 s",
    "its cheaper step gives 1.2-1.3x the steps",
    "ran 80× slower than in fp32",
    "drawing one costs ~300 µs",
    "rollout mass 0.85 against 0.29 without",
    "cached (~400 KB an image)",
    "the suite needs 1.7 GB at its peak",
    "~170 per\ncaption against an NLL of ~2.5 per token",
    "17 epochs on one core of a 2-core CPU",
    "logging cost a step on 2 cores",
    "GPU code equals eager (checked on an H100)",
    "3 times faster",
])
def test_a_measured_figure_is_found(text: str) -> None:
    assert figures(text), text


@pytest.mark.parametrize("text", [
    "annotations (B, L, D) over a Gh×Gw grid",
    "a 12×12 grid of 8-px cells, ~3×3 per item",
    "S/stride × S/stride × 8 × width",
    "here 4 × MAX_PIXELS",
    "computed as 2w·σ(2x) + (b − Σw), since tanh(x) = 2σ(2x) − 1",
    "+ 1.0 x -log(rollout mass)",
    "a beam size at most 50; a share from 0 to 1",
    "Show, Attend and Tell (Xu et al. 2015, §4.2, eq. 14)",
    "two private methods of Lightning 2.6; torch 2.14.1",
    "Training stops at 7.5 minutes",
    'print(f"{result.probability:.1%}")',
    "rank r fills the shards i with i % world_size == r",
    "VGG-19 conv5_4 (14x14x512 at 224 px); 16x16 Words",
    "40 x 125 = the full 5k Karpathy val split",
    "1 GiB: MS COCO's largest annotation file is 448 MB",
    "a 385 KB PNG can claim 19900×19900 = 1.2 GB of RGB",
    "redrawn at most 5 times a second",
    "the cross-entropy of softmax(W a_k + b) against its class (Anderson et al. 2018)",
    "60k 32×32 colour images of 10 classes",
])
def test_a_fact_is_not_a_measured_figure(text: str) -> None:
    assert not figures(text), figures(text)


def test_a_yaml_comment_starts_at_a_hash_outside_quotes() -> None:
    assert yaml_comment_start("a: 1  # one") == 6
    assert yaml_comment_start("# all of it") == 0
    assert yaml_comment_start("a: 'x # y'  # z") == 12
    assert yaml_comment_start('a: ["#", "it\'s"] # z') == 17
    assert yaml_comment_start("a: b#c") is None
    assert yaml_comment_start("a: it's # z") == 8
