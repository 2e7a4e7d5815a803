"""Word counts, an output term: the word scores add ρ ⊙ n_t, where n_t counts how often each word has been input so
far and ρ is learnt per word (0 at the start: the paper's output). With ``context``, ρ_t = ρ + U h_t: whether a word
may be said again depends on where the sentence is ("the red coat" may name the coat again, "and a red coat" may
not); U = 0 at the start."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vision_attn.captioning.seams import OutputTerm
from vision_attn.option_groups import OptionGroup


@dataclass(frozen=True)
class WordCountsOptions(OptionGroup):
    """The word counts' options."""

    context: bool = False
    """ρ_t = ρ + U h_t: the weight of a word's count depends on the state"""


class WordCounts(OutputTerm):
    """ρ ⊙ n_t (or ρ_t ⊙ n_t) on the logits; n_t carried per row, (B', V)."""

    Options = WordCountsOptions

    def __init__(self, options: WordCountsOptions, *, vocab_size: int, hidden_dim: int, **_: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size))  # ρ
        self.context = None
        if options.context:  # U, from 0
            self.context = nn.Linear(hidden_dim, vocab_size)
            nn.init.zeros_(self.context.weight)
            nn.init.zeros_(self.context.bias)

    def start(self, rows: int, like: Tensor) -> Tensor:
        """n_1 = 0: nothing said yet."""
        return like.new_zeros(rows, len(self.weight))

    def advance(self, carried: Tensor | None, words: Tensor) -> Tensor:
        """n_{t+1} = n_t + onehot(y_t)."""
        return carried.scatter_add(1, words.unsqueeze(1), carried.new_ones(len(words), 1))

    def _rho(self, hidden: Tensor) -> Tensor:
        return self.weight if self.context is None else self.weight + self.context(hidden)  # ρ_t = ρ + U h_t

    def step(self, logits: Tensor, hidden: Tensor, carried: Tensor | None) -> Tensor:
        """logits + ρ_t ⊙ n_t."""
        return logits + self._rho(hidden) * carried

    def teacher_forced(self, logits: Tensor, hidden: Tensor, inputs: Tensor) -> Tensor:
        """logits + ρ_t ⊙ n_t at every step, n_t from the input words up to step t."""
        counts = nn.functional.one_hot(inputs, len(self.weight)).to(hidden.dtype).cumsum(1)  # (B, T, V)
        return logits + self._rho(hidden) * counts
