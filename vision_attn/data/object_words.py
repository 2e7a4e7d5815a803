"""Which caption words name which object category (``docs/formats/object-words.md``), for the object metrics:
``coco`` (MS COCO's 80 categories with synonyms and plurals), ``scenes`` (the scenes' class words), or a JSON file."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from vision_attn.data.formats import read_json
from vision_attn.data.scenes import CLASS_WORDS
from vision_attn.data.vocabulary import tokenize

BUILT_IN = ("coco", "scenes")


class ObjectWords:
    """A table of categories and the phrases that name them (one or more words each; a phrase names one
    category). ``mentions`` finds them in a caption's tokens, the longest phrase first."""

    def __init__(self, categories: Mapping[str, Sequence[str]], name: str = "table") -> None:
        self.name = name
        self.categories = list(categories)
        self.phrases: dict[tuple[str, ...], str] = {}
        for category, phrases in categories.items():
            for phrase in phrases:
                words = tuple(tokenize(phrase))
                if self.phrases.get(words, category) != category:
                    raise ValueError(f"{name}: the phrase {phrase!r} names both {self.phrases[words]!r} and "
                                     f"{category!r}; a phrase names one category")
                self.phrases[words] = category
        self.longest = max((len(words) for words in self.phrases), default=0)

    def mentions(self, tokens: Sequence[str]) -> list[tuple[int, str]]:
        """(position of the phrase's last word, category) of each object the tokens name, the longest phrase first
        ("teddy bear" is a teddy bear, not a bear)."""
        found, index = [], 0
        while index < len(tokens):
            for size in range(min(self.longest, len(tokens) - index), 0, -1):
                category = self.phrases.get(tuple(tokens[index:index + size]))
                if category is not None:
                    found.append((index + size - 1, category))
                    index += size
                    break
            else:
                index += 1
        return found

    def single_words(self, category: str) -> list[str]:
        """The one-word phrases that name ``category`` (what a word-level model can emit for it)."""
        return [phrase[0] for phrase, named in self.phrases.items() if named == category and len(phrase) == 1]

    def named_in(self, captions: Sequence[str]) -> set[str]:
        """The categories some of ``captions`` (raw text) name."""
        return {category for caption in captions for _, category in self.mentions(tokenize(caption))}


def read_object_words(path: str | Path) -> ObjectWords:
    """A table from a JSON file ``{"categories": {"<category>": ["<phrase>", ...]}}``, checked."""
    data = read_json(Path(path), "an object-words table")
    categories = data.get("categories") if isinstance(data, dict) else None
    if not isinstance(categories, dict) or not categories:
        raise ValueError(f"{path}: an object-words table is {{\"categories\": {{\"<category>\": [\"<phrase>\", "
                         f"...]}}}} with at least one category")
    for category, phrases in categories.items():
        if not category.strip() or not isinstance(phrases, list) or not phrases or not all(
                isinstance(phrase, str) and tokenize(phrase) for phrase in phrases):
            raise ValueError(f"{path}: category {category!r} must have a non-empty list of phrases, each with a "
                             f"word, got {json.dumps(phrases)[:80]}")
    return ObjectWords(categories, name=str(data.get("name") or path))


@cache
def built_in(name: str) -> ObjectWords:
    """``coco`` or ``scenes``."""
    if name == "coco":
        return read_object_words(Path(__file__).with_name("coco_object_words.json"))
    if name == "scenes":
        return ObjectWords({word: [word] for word in CLASS_WORDS}, name="scenes")
    raise ValueError(f"no built-in object-words table {name!r}: {' or '.join(BUILT_IN)}, or a JSON file")


def object_words(spec: str | Path) -> ObjectWords:
    """The table ``spec`` names: ``coco``, ``scenes`` or a JSON file's path."""
    return built_in(str(spec)) if str(spec) in BUILT_IN else read_object_words(spec)
