"""The revisit penalty, a decoding processor of beam search: ρ · max_{s<t, y_s ∈ O} Σ_i min(α_ti, α_si) comes off the
score of each object word of O at step t. An object word whose α lies where an earlier object word's lay (naming
the same object twice) costs up to ρ; two objects of one class in two places cost nothing. α_t is the same for
every word of the step, so the penalty only moves the search to another beam: one that ended, or named that object
before, or looks elsewhere. The model's own log-probabilities are left as they are.

With ``measure: peak`` the revisit is 1 where α_t peaks within ``radius`` cells of where an earlier object word's α
peaked, else 0: a diffuse α_t that peaks on another object no longer costs anything. The grid is square (images
are squashed to a square), so its side is √L. ``modifiers`` (the colours) cost the same as object words, compared
with the object words said before them only: "a blue coat" costs nothing, "a blue coat and a blue" on that coat
again costs ρ at the second "blue"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

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
    measure: Literal["overlap", "peak"] = "overlap"
    """how α_t revisits an earlier α_s: their overlap Σ_i min(α_ti, α_si), or whether their peaks are near"""
    radius: int = 1
    """with ``measure: peak``, how many cells apart (in rows and in columns) two peaks count as one place"""
    modifiers: list[str] = field(default_factory=list)
    """words said before an object word (the Fashion scenes: their colours), that cost the same where their α
    revisits an earlier object word's: a caption that may not leave a colour without its garment (``next_words``)
    then does not start naming an object twice"""

    def check(self) -> None:
        """Refuse a negative or non-finite penalty, no words, an empty or repeated word, an unknown measure or a
        negative radius."""
        require(finite(self.penalty) and self.penalty >= 0, self.name, f"penalty must be 0 or more, got {self.penalty}")
        require(bool(self.words), self.name, "words: the penalty needs the words that name objects")
        checked_words(self.name, self.words)
        checked_words(self.name, self.modifiers)
        require(not set(self.words) & set(self.modifiers), self.name, "a word is in words and in modifiers")
        require(self.measure in ("overlap", "peak"), self.name,
                f"measure must be one of overlap, peak, got {self.measure!r}")
        require(self.radius >= 0, self.name, f"radius must be 0 or more, got {self.radius}")


class RevisitPenalty(DecodingProcessor):
    """ρ × the largest overlap of α_t with the α of an object word already said, off each object word's score."""

    Options = RevisitPenaltyOptions
    sampling = False  # a search-time preference: self-critical samples come from the model as it is

    def __init__(self, options: RevisitPenaltyOptions, *, vocab: Vocabulary, **_: object) -> None:
        super().__init__()
        self.penalty, self.measure, self.radius = options.penalty, options.measure, options.radius
        self.register_buffer("ids", word_ids(vocab, options.words), persistent=False)
        self.register_buffer("charged", torch.cat([self.ids, word_ids(vocab, options.modifiers)]), persistent=False)

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The scores less the penalty on the object words and modifiers (beam search: it reads the beams' history)."""
        if not self.penalty or not len(self.ids) or step.history_tokens is None or not step.history_tokens.shape[1]:
            return scores
        said = torch.isin(step.history_tokens, self.ids)  # (N, T): which words so far name objects
        if self.measure == "peak":
            side = math.isqrt(step.alpha.shape[1])
            if side * side != step.alpha.shape[1]:  # every encoder's grid is square: a caller's bug, not a user's
                raise ValueError(f"revisit_penalty: measure peak needs a square grid, got {step.alpha.shape[1]} cells")
            now, before = step.alpha.argmax(-1, keepdim=True), step.history_alphas.argmax(-1)  # (N, 1), (N, T)
            near = ((now // side - before // side).abs() <= self.radius) & \
                ((now % side - before % side).abs() <= self.radius)
            overlap = near.float()  # (N, T): 1 where α_t peaks near α_s's peak
        else:
            overlap = torch.minimum(step.alpha.float().unsqueeze(1), step.history_alphas).sum(-1)  # (N, T)
        revisit = overlap.masked_fill(~said, 0.0).amax(dim=1)  # (N,): the most α_t shares with one of them
        scores = scores.clone()
        scores[:, self.charged] -= self.penalty * revisit.unsqueeze(-1)
        return scores
