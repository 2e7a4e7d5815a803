"""The word just said, an attention input: the score's query also reads E y_{t−1},
e_ti = f_att(a_i, W_h h_{t−1} + W_y E y_{t−1}), so the attention knows what the decoder has just said of the object
it describes (as the attention of Anderson et al. 2018 is queried by an LSTM that has read the previous word)."""

from __future__ import annotations

from torch import Tensor, nn

from vision_attn.captioning.seams import AttentionInput, ScoreWidths


class PreviousWord(AttentionInput):
    """W_y E y_{t−1}, added to the score's query."""

    kind = "query"

    def __init__(self, options: object, *, widths: ScoreWidths, embed_dim: int, **_: object) -> None:
        super().__init__()
        self.proj = nn.Linear(embed_dim, widths.query, bias=False)  # W_y

    def term(self, carried: Tensor | None, word: Tensor | None) -> Tensor:
        """W_y E y_{t−1}, (B', W)."""
        if word is None:
            raise ValueError("this attention reads the word just emitted: pass E y_{t-1}")
        return self.proj(word)
