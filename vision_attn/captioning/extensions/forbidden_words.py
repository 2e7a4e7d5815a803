"""Forbidden words, a decoding processor: no caption says any of ``words`` (a user's list: names, slurs, a brand),
in beam search and in self-critical sampling. Words the vocabulary lacks are never said anyway."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from vision_attn.captioning.extensions.blocked_endings import checked_words, word_ids
from vision_attn.captioning.seams import DecodingProcessor, SearchStep
from vision_attn.data.vocabulary import SPECIALS, Vocabulary
from vision_attn.option_groups import OptionGroup, require


@dataclass(frozen=True)
class ForbiddenWordsOptions(OptionGroup):
    """The forbidden words' options."""

    words: list[str] = field(default_factory=list)
    """the words no caption may say; ``<unk>`` too, the word a caption says for one its vocabulary lacks"""

    def check(self) -> None:
        """Refuse an empty or repeated word, or a special token but <unk> (<end> forbidden, no caption could end)."""
        checked_words(self.name, self.words)
        special = [word for word in self.words if word in SPECIALS and word != "<unk>"]
        require(not special, self.name, f"words: {', '.join(special)} are special tokens, not words")


class ForbiddenWords(DecodingProcessor):
    """Every forbidden word's score at −inf, at every step."""

    Options = ForbiddenWordsOptions

    def __init__(self, options: ForbiddenWordsOptions, *, vocab: Vocabulary, **_: object) -> None:
        super().__init__()
        self.register_buffer("ids", word_ids(vocab, options.words), persistent=False)

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The scores with the forbidden words at −inf."""
        return scores.index_fill(1, self.ids, float("-inf")) if len(self.ids) else scores
