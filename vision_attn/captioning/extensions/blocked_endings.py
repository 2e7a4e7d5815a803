"""Blocked endings, a decoding processor: a caption may not end right after one of ``words`` ("and", "a"). Beam
search and self-critical sampling never put <end> there (before the last step, where <end> must come);
self-critical training otherwise learns endings such as "... a red coat and" for its reward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vision_attn.captioning.seams import DecodingProcessor, SearchStep
from vision_attn.data.vocabulary import END_ID, Vocabulary
from vision_attn.option_groups import OptionGroup, require


def checked_words(group: str, words: list[str]) -> None:
    """Refuse, in one line, a list of words with an empty or repeated one."""
    require(all(isinstance(word, str) and word.strip() for word in words), group, f"words are words, got {words}")
    require(len(set(words)) == len(words), group, f"words names a word twice: {words}")


def word_ids(vocab: Vocabulary, words: list[str]) -> Tensor:
    """The ids of ``words`` the vocabulary has (the others are left out)."""
    return torch.tensor([vocab.id(word) for word in words if word in vocab], dtype=torch.long)


@dataclass(frozen=True)
class BlockedEndingsOptions(OptionGroup):
    """The blocked endings' options."""

    words: list[str] = field(default_factory=list)
    """the words a caption may not end on"""

    def check(self) -> None:
        """Refuse an empty or repeated word."""
        checked_words(self.name, self.words)


class BlockedEndings(DecodingProcessor):
    """<end> is impossible right after a blocked word."""

    Options = BlockedEndingsOptions

    def __init__(self, options: BlockedEndingsOptions, *, vocab: Vocabulary, **_: object) -> None:
        super().__init__()
        self.register_buffer("ids", word_ids(vocab, options.words), persistent=False)

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The scores with <end> at −inf where the word just input is blocked (not at the last step)."""
        if step.t >= step.max_length or not len(self.ids):
            return scores
        scores = scores.clone()
        scores[:, END_ID].masked_fill_(torch.isin(step.words, self.ids), float("-inf"))
        return scores
