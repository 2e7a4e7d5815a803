"""Beam search keeps the captions that end apart from its live beams: on a hand-built model where ending now is the
best caption, but k continuations look better for one more step, the search still returns the caption that ended."""

from __future__ import annotations

import math

import pytest
import torch

from vision_attn.captioning.beam_search import beam_search

PAD, START, END, A, WITH, COAT = range(6)


class WordChain:
    """A decoder whose next word depends only on the word just said (a table of probabilities), with uniform α."""

    def __init__(self, table: dict[int, dict[int, float]]) -> None:
        self.logits = torch.full((6, 6), -30.0)
        for word, following in table.items():
            for nxt, p in following.items():
                self.logits[word, nxt] = math.log(p)

    def encode(self, annotations: torch.Tensor) -> torch.Tensor:
        return annotations

    def initial_state(self, annotations: torch.Tensor, per_image: int) -> Rows:
        return Rows(annotations.shape[0] * per_image)

    def step(self, words, image, state):
        rows, locations = len(words), image.shape[1]
        return (self.logits[words], torch.full((rows, locations), 1 / locations), torch.ones(rows), state, None,
                None)


class Rows:
    def __init__(self, count: int) -> None:
        self.count = count

    def select(self, rows: torch.Tensor) -> Rows:
        return Rows(len(rows))


# "coat" then <end> (0.9 × 0.2) is the best caption; "coat a" and "coat with" (0.9 × 0.4 each) look better for one
# step, and after either every word is unlikely.
CHAIN = WordChain({START: {COAT: 0.9, WITH: 0.1}, COAT: {END: 0.2, A: 0.4, WITH: 0.4},
                   A: {END: 0.01, A: 0.33, WITH: 0.33, COAT: 0.33}, WITH: {END: 0.01, A: 0.33, WITH: 0.33, COAT: 0.33}})


@pytest.mark.parametrize("beam_size", [2, 3])
def test_a_caption_that_ended_is_not_pushed_out_by_live_beams_that_turn_out_worse(beam_size: int) -> None:
    beams = beam_search(CHAIN, torch.zeros(2, 4, 3), start_id=START, end_id=END, beam_size=beam_size, max_length=6)
    for image in beams:
        assert image[0].tokens == [COAT]
        assert image[0].log_prob == pytest.approx(math.log(0.9 * 0.2), abs=1e-5)
        assert image[0].alphas.shape == (1, 4)
        assert len(image) == beam_size and all(a.score >= b.score for a, b in zip(image, image[1:], strict=False))


def test_the_search_stops_once_no_live_beam_can_beat_the_finished_ones() -> None:
    """"coat" and "a" each end with 0.9; what goes on ("with") never ends before the last step. Once both have
    ended (step 2), the live beams are already worse than both, so the search stops there, whatever the max length."""
    chain = WordChain({START: {COAT: 0.5, A: 0.5}, COAT: {END: 0.9, WITH: 0.1}, A: {END: 0.9, WITH: 0.1},
                       WITH: {WITH: 1.0}})
    steps = []
    step = chain.step
    chain.step = lambda *args: steps.append(1) or step(*args)
    beams = beam_search(chain, torch.zeros(1, 4, 3), start_id=START, end_id=END, beam_size=2, max_length=60)
    assert sorted(h.tokens for h in beams[0]) == [[A], [COAT]]
    assert len(steps) == 2
