"""Coverage, an attention input: the score also reads c_ti = Σ_{s<t} α_si, how much attention each location has had
so far, e_ti = f_att(a_i, h_{t−1}) + w_c c_ti (Tu et al. 2016, See et al. 2017), so the decoder can tell the
objects it has described from the ones it has not."""

from __future__ import annotations

from torch import Tensor, nn

from vision_attn.captioning.seams import AttentionInput, LocationTerm, ScoreWidths


class Coverage(AttentionInput):
    """c_t carried per row, from c_1 = 0; its term w_c c_ti at each location, in the score's location width."""

    kind = "location"

    def __init__(self, options: object, *, widths: ScoreWidths, **_: object) -> None:
        super().__init__()
        self.proj = nn.Linear(1, widths.location, bias=False)  # w_c

    def start(self, rows: int, locations: int, like: Tensor) -> Tensor:
        """c_1 = 0: nothing attended yet, (B', L)."""
        return like.new_zeros(rows, locations)

    def term(self, carried: Tensor | None, word: Tensor | None) -> LocationTerm:
        """w_c c_ti: c_t (B', L) and w_c (W, 1)."""
        return LocationTerm(carried, self.proj.weight)

    def advance(self, carried: Tensor | None, alpha: Tensor) -> Tensor:
        """c_{t+1} = c_t + α_t."""
        return carried + alpha
