"""Caption tokens and the word <-> id mapping of the captioner. ``tokenize`` approximates what the COCO
evaluation's PTB tokenizer leaves once it drops punctuation; the vocabulary is built from the training captions.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vision_attn.data.formats import read_json
from vision_attn.errors import CheckpointError

SPECIALS = ("<pad>", "<start>", "<end>", "<unk>")
PAD_ID, START_ID, END_ID, UNK_ID = range(len(SPECIALS))

_WORD = re.compile(r"\w+(?:['\-]\w+)*")  # letters/digits/underscores, joined by single inner ' or -
_WORD_OR_BREAK = re.compile(r"\n|" + _WORD.pattern)
_BREAK = "\n"  # never inside a word, so it can separate captions in one string


def tokenize(text: str) -> list[str]:
    """Lower-case words of a caption, punctuation dropped: "A man's T-shirt, red." -> [a, man's, t-shirt, red]."""
    return _WORD.findall(text.lower())


def has_words(text: str) -> bool:
    """Whether ``tokenize(text)`` is non-empty (one regex search: cheap on 600k captions)."""
    return _WORD.search(text) is not None


def word_ids(caption: Sequence[int]) -> list[int]:
    """The word ids of an encoded caption, without <start>, <end> and <pad>."""
    return [word for word in caption if word not in (START_ID, END_ID, PAD_ID)]


def _tokenize_joined(captions: Sequence[str]) -> list[str]:
    # The tokens of all ``captions``, a ``_BREAK`` between two: one regex pass, and no word can span a break
    text = _BREAK.join(captions)
    if text.count(_BREAK) != len(captions) - 1:  # some caption holds line breaks of its own
        text = _BREAK.join(caption.replace(_BREAK, " ") for caption in captions)
    return _WORD_OR_BREAK.findall(text.lower())


class Vocabulary:
    """Word <-> id mapping with ``<pad>``=0, ``<start>``=1, ``<end>``=2, ``<unk>``=3, then the words."""

    def __init__(self, tokens: Sequence[str], *, min_count: int = 1) -> None:
        if tuple(tokens[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary's tokens must start with {list(SPECIALS)}, got {list(tokens[:4])}")
        if len(set(tokens)) != len(tokens):
            duplicates = sorted(word for word, n in Counter(tokens).items() if n > 1)
            raise ValueError(f"a vocabulary's tokens must be unique; repeated: {duplicates[:5]}")
        self._tokens = list(tokens)
        self._ids = {word: index for index, word in enumerate(self._tokens)}
        self.min_count = min_count

    @classmethod
    def build(cls, captions: Iterable[str] | Iterable[Sequence[str]], *, min_count: int = 1) -> Vocabulary:
        """The words seen at least ``min_count`` times in ``captions`` (strings or token lists), most frequent first."""
        if min_count < 1:
            raise ValueError(f"min_count must be at least 1, got {min_count}")
        captions = list(captions)
        if captions and isinstance(captions[0], str):
            counts = Counter(_tokenize_joined(captions))
        else:
            counts = Counter(chain.from_iterable(captions))
        for special in (*SPECIALS, _BREAK):
            counts.pop(special, None)
        words = sorted((word for word, n in counts.items() if n >= min_count), key=lambda word: (-counts[word], word))
        return cls([*SPECIALS, *words], min_count=min_count)

    @property
    def tokens(self) -> list[str]:
        """Every token in id order, specials first (a plain list, to store in checkpoints)."""
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, word: object) -> bool:
        return word in self._ids

    def id(self, word: str) -> int:
        """The id of ``word``, ``<unk>``'s if it is not in the vocabulary."""
        return self._ids.get(word, UNK_ID)

    def encode(self, tokens: Sequence[str], max_length: int | None = None) -> list[int]:
        """``<start>`` w1 .. wn ``<end>`` as ids, keeping at most ``max_length`` words."""
        return [START_ID, *[self._ids.get(word, UNK_ID) for word in tokens[:max_length]], END_ID]

    def encode_batch(self, captions: Sequence[str], max_length: int) -> tuple[Tensor, Tensor]:
        """Encode many captions at once: ids (N, T) of ``encode`` padded with ``<pad>``, and lengths (N,);
        ``self.truncated`` then says how many had more than ``max_length`` words and were cut."""
        self.truncated = 0
        if not captions:
            return torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        flat = _tokenize_joined(captions)
        lookup = {**self._ids, _BREAK: -1}
        ids = np.fromiter(map(lookup.get, flat, repeat(UNK_ID)), dtype=np.int64, count=len(flat))  # (F,)
        is_break = ids < 0
        caption = np.cumsum(is_break) - is_break  # (F,) index of the caption each entry belongs to
        starts = np.concatenate(([0], np.flatnonzero(is_break) + 1))  # (N,) where each caption begins in flat
        keep = ~is_break & (np.arange(len(ids)) - starts[caption] < max_length)  # (F,) words within max_length
        words = np.bincount(caption[keep], minlength=len(captions))  # (N,)
        self.truncated = int((np.bincount(caption[~is_break], minlength=len(captions)) > max_length).sum())
        lengths = words + 2
        columns = np.arange(int(lengths.max()))
        matrix = np.full((len(captions), len(columns)), PAD_ID, dtype=np.int64)  # (N, T)
        matrix[:, 0] = START_ID
        matrix[(columns >= 1) & (columns <= words[:, None])] = ids[keep]  # row-major: captions, then words
        matrix[np.arange(len(captions)), words + 1] = END_ID
        return torch.from_numpy(matrix), torch.from_numpy(lengths)

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The words of ``ids`` up to the first ``<end>``, special tokens left out."""
        words = []
        for index in ids:
            index = int(index)
            if index == END_ID:
                break
            if not 0 <= index < len(self._tokens):
                raise ValueError(f"token id {index} is outside this vocabulary of {len(self._tokens)} tokens")
            if index >= len(SPECIALS):
                words.append(self._tokens[index])
        return words

    def require_same(self, tokens: Sequence[str] | None) -> None:
        """Refuse another vocabulary's ``tokens`` (a checkpoint's) that differ from these; None or empty passes."""
        saved = list(tokens or [])
        if saved and saved != self._tokens:
            where = next((i for i, (a, b) in enumerate(zip(saved, self._tokens, strict=False)) if a != b),
                         min(len(saved), len(self._tokens)))
            raise CheckpointError(f"the checkpoint's vocabulary ({len(saved)} tokens) does not match the data's "
                                  f"({len(self)} tokens; first difference at id {where}); pass the vocab.json saved "
                                  "beside the checkpoint as --data.init_args.vocab_file")

    def to_json(self, path: str | Path) -> None:
        """Save as ``{"tokens": [...], "min_count": n}`` (the folder is made if needed)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"tokens": self._tokens, "min_count": self.min_count}, indent=0))

    @classmethod
    def from_json(cls, path: str | Path) -> Vocabulary:
        """Load a vocabulary saved by ``to_json``."""
        data = read_json(path, "a vocabulary JSON")
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(word, str) for word in tokens):
            raise ValueError(f"{path}: expected {{\"tokens\": [strings], \"min_count\": n}}")
        try:
            return cls(tokens, min_count=int(data.get("min_count", 1)))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None
