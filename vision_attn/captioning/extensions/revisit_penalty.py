"""The revisit penalty, a decoding processor of beam search: ρ · max_{s<t, y_s ∈ O} Σ_i min(α_ti, α_si) comes off the
score of each object word of O at step t. An object word whose α lies where an earlier object word's lay (naming
the same object twice) costs up to ρ; two objects of one class in two places cost nothing. α_t is the same for
every word of the step, so the penalty only moves the search to another beam: one that ended, or named that object
before, or looks elsewhere. The model's own log-probabilities are left as they are."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vision_attn.captioning.extensions.blocked_endings import checked_words, word_ids
from vision_attn.captioning.seams import DecodingProcessor, SearchStep
from vision_attn.data.vocabulary import Vocabulary
from vision_attn.option_groups import OptionGroup, finite, require


@dataclass(frozen=True)
class RevisitPenaltyOptions(OptionGroup):
    """The revisit penalty's options."""

    penalty: float = 1.0
    """ρ, the most naming again a place already named costs"""
    words: list[str] = field(default_factory=list)
    """the words that name objects (the Fashion scenes: their ten class words)"""

    def check(self) -> None:
        """Refuse a negative or non-finite penalty, no words, or an empty or repeated word."""
        require(finite(self.penalty) and self.penalty >= 0, self.name, f"penalty must be 0 or more, got {self.penalty}")
        require(bool(self.words), self.name, "words: the penalty needs the words that name objects")
        checked_words(self.name, self.words)


class RevisitPenalty(DecodingProcessor):
    """ρ × the largest overlap of α_t with the α of an object word already said, off each object word's score."""

    Options = RevisitPenaltyOptions
    sampling = False  # a search-time preference: self-critical samples come from the model as it is

    def __init__(self, options: RevisitPenaltyOptions, *, vocab: Vocabulary, **_: object) -> None:
        super().__init__()
        self.penalty = options.penalty
        self.register_buffer("ids", word_ids(vocab, options.words), persistent=False)

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The scores less the penalty on the object words (beam search: it reads the beams' history)."""
        if not self.penalty or not len(self.ids) or step.history_tokens is None or not step.history_tokens.shape[1]:
            return scores
        said = torch.isin(step.history_tokens, self.ids)  # (N, T): which words so far name objects
        overlap = torch.minimum(step.alpha.float().unsqueeze(1), step.history_alphas).sum(-1)  # (N, T)
        revisit = overlap.masked_fill(~said, 0.0).amax(dim=1)  # (N,): the most α_t shares with one of them
        scores = scores.clone()
        scores[:, self.ids] -= self.penalty * revisit.unsqueeze(-1)
        return scores
