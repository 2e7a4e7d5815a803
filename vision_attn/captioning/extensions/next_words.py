"""Next words, a decoding processor of beam search: right after a word of ``after``, only a word of ``only`` may come.
The Fashion scenes list their colours and garments, so "a blue" is followed by a garment's name, never by "on its
own", "and" or another colour: the fault that blocking the colours as endings alone moves inside the caption. At the
last step, where <end> must come, nothing is changed. Words the vocabulary lacks are left out; with none of
``only`` in it, the processor changes nothing (no word could follow)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vision_attn.captioning.extensions.blocked_endings import checked_words, word_ids
from vision_attn.captioning.seams import DecodingProcessor, SearchStep
from vision_attn.data.vocabulary import Vocabulary
from vision_attn.option_groups import OptionGroup, require


@dataclass(frozen=True)
class NextWordsOptions(OptionGroup):
    """The next words' options."""

    after: list[str] = field(default_factory=list)
    """the words that must be followed by one of ``only`` (the Fashion scenes: their five colours)"""
    only: list[str] = field(default_factory=list)
    """the words that may follow one of ``after`` (the Fashion scenes: their ten class words)"""

    def check(self) -> None:
        """Refuse an empty list, or an empty or repeated word."""
        require(bool(self.after) and bool(self.only), self.name, "after and only each need at least one word")
        checked_words(self.name, self.after)
        checked_words(self.name, self.only)


class NextWords(DecodingProcessor):
    """Every word but those of ``only``, <end> included, at −inf right after a word of ``after`` (but at the last
    step)."""

    Options = NextWordsOptions
    sampling = False  # a search-time constraint: self-critical samples come from the model as it is

    def __init__(self, options: NextWordsOptions, *, vocab: Vocabulary, **_: object) -> None:
        super().__init__()
        self.register_buffer("after", word_ids(vocab, options.after), persistent=False)
        barred = torch.ones(len(vocab), dtype=torch.bool)
        barred[word_ids(vocab, options.only)] = False
        self.register_buffer("barred", barred if not barred.all() else torch.zeros_like(barred), persistent=False)

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The scores with every barred word at −inf in the rows whose input word is one of ``after``."""
        if step.t >= step.max_length or not len(self.after):
            return scores
        rows = torch.isin(step.words, self.after)  # (N,)
        return scores.masked_fill(rows.unsqueeze(1) & self.barred.unsqueeze(0), float("-inf"))
