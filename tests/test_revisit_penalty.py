"""The revisit penalty (a decoding processor): beam search takes ρ · max_{s<t, y_s ∈ O} Σ_i min(α_ti, α_si) off
each object word's log-probability, and so finds the caption best by that score; the option is checked, and read
from the vocabulary."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.test_bad_endings import processor
from tests.test_captioner_model import END, START, _sequence_log_prob, tiny_decoder
from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.options import DecodingOptions
from vision_attn.captioning.seams import SearchStep
from vision_attn.data.vocabulary import SPECIALS
from vision_attn.tasks import CaptionerTask

OBJECTS = (3, 4)  # the object words, as "coat" and "bag"; word 5 names none, as "and"


def penalised_score(decoder: AttentionDecoder, annotations: torch.Tensor, words: tuple[int, ...],
                    penalty: float) -> float:
    """The caption's log-probability less ρ × each object word's largest α overlap with an earlier object word,
    computed from the teacher-forced α: the score the docstring of ``beam_search`` defines."""
    captions = torch.tensor([[START, *words, END]])
    with torch.no_grad():
        alphas = decoder(annotations, captions).alphas[0]  # (T + 1, L): α of each word and of <end>
    cost = 0.0
    for t, word in enumerate(words):
        if word in OBJECTS:
            earlier = [torch.minimum(alphas[t], alphas[s]).sum() for s in range(t) if words[s] in OBJECTS]
            cost += penalty * float(max(earlier, default=torch.tensor(0.0)))
    return _sequence_log_prob(decoder, annotations, words) - cost


def test_beam_search_finds_the_best_caption_by_the_penalised_score() -> None:
    """Exhaustively: every caption of 2 or 3 words of 3, 4, 5 (at least two, so that a second object word can be
    said); a beam as wide keeps every prefix, so it must find the best by the penalised score, and report the
    model's own log-probability for it."""
    decoder = tiny_decoder(vocab_size=6, coverage=True).eval()
    with torch.no_grad():
        decoder.output_words.bias[5] -= 2.0  # word 5 less likely: unpenalised, the best captions repeat objects
    annotations, max_length, penalty = torch.randn(8, 9, 8) * 3, 3, 4.0
    candidates = [seq for n in (2, 3) for seq in itertools.product([3, 4, 5], repeat=n)]
    search = {"start_id": START, "end_id": END, "beam_size": 27, "max_length": max_length, "min_length": 2}
    free = beam_search(decoder, annotations, **search)
    penalised = beam_search(decoder, annotations, **search,
                            processors=[processor("revisit_penalty", OBJECTS, penalty=penalty)])
    changed = 0
    for b in range(len(annotations)):
        image = annotations[b : b + 1]
        best_score, best = max((penalised_score(decoder, image, c, penalty), c) for c in candidates)
        assert tuple(penalised[b][0].tokens) == best
        assert penalised[b][0].score == pytest.approx(best_score, abs=1e-4)
        assert penalised[b][0].log_prob == pytest.approx(_sequence_log_prob(decoder, image, best), abs=1e-4)
        changed += tuple(free[b][0].tokens) != best
    assert changed  # the penalty changed the best caption of some image: it is what chose these


def test_revisit_penalty_is_checked_and_its_words_read_from_the_vocabulary() -> None:
    for options, message in (({"penalty": -1.0, "words": ["coat"]}, "revisit_penalty: penalty must be 0 or"),
                             ({"penalty": float("nan"), "words": ["coat"]}, "revisit_penalty: penalty must be"),
                             ({"penalty": 1.0}, "revisit_penalty: words: the penalty needs the words"),
                             ({"words": ["coat", "coat"]}, "words names a word twice"),
                             ({"words": [" "]}, "words are words")):
        with pytest.raises(ValueError, match=message):
            DecodingOptions.coerce({"processors": [{"name": "revisit_penalty", **options}]})
    task = CaptionerTask(vocabulary=[*SPECIALS, "a", "and", "red", "top"], image={"size": 96}, encoder={"width": 8},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         decoding={"processors": [{"name": "revisit_penalty", "penalty": 2.0,
                                                   "words": ["top", "coat"]}]})  # no "coat" here
    assert task.model.processors[0].ids.tolist() == [task.model.vocab.id("top")]
    decoded = task.model.eval().decode(torch.randn(2, 3, 96, 96))  # decodes with it
    assert len(decoded.hypotheses) == 2


def test_the_peak_measure_costs_an_object_word_only_where_alpha_peaks_near_an_earlier_object_words_peak() -> None:
    """A hand-built step on a 4×4 grid, earlier words "coat" (α peaked at cell (1, 1)) and "and" (α at (3, 3)):
    α_t peaked at (2, 2) is one cell from (1, 1), so the object words lose ρ; at (3, 3) it is near only the
    non-object word, and a diffuse α_t whose peak is at (0, 3) costs nothing though it overlaps both."""
    grid = torch.zeros(3, 16)
    grid[0, 2 * 4 + 2] = grid[1, 3 * 4 + 3] = 1.0  # α_t peaks at (2, 2), then at (3, 3)
    grid[2] = 0.05
    grid[2, 0 * 4 + 3] = 0.3  # diffuse, over (1, 1) too, peaked at (0, 3)
    history = torch.zeros(3, 2, 16)
    history[:, 0, 1 * 4 + 1] = 1.0
    history[:, 1, 3 * 4 + 3] = 1.0
    step = SearchStep(t=2, words=torch.tensor([5, 5, 5]), alpha=grid, max_length=5,
                      history_tokens=torch.tensor([[3, 5]] * 3), history_alphas=history)
    scores = torch.zeros(3, 6)
    changed = processor("revisit_penalty", OBJECTS, penalty=2.5, measure="peak")(scores, step)
    assert changed[0, list(OBJECTS)].tolist() == [-2.5, -2.5] and changed[1:].abs().sum() == 0
    assert changed[0, [0, 1, 2, 5]].abs().sum() == 0 and scores.abs().sum() == 0  # other words; input untouched
    exact = processor("revisit_penalty", OBJECTS, penalty=2.5, measure="peak", radius=0)(scores, step)
    assert exact.abs().sum() == 0  # (2, 2) is not (1, 1)
    overlap = processor("revisit_penalty", OBJECTS, penalty=2.5)(scores, step)
    assert overlap[2, 3] < 0  # the overlap measure does cost the diffuse α_t
    uneven = SearchStep(t=2, words=step.words, alpha=grid[:, :15], max_length=5, history_tokens=step.history_tokens,
                        history_alphas=history[..., :15])
    with pytest.raises(ValueError, match="measure peak needs a square grid, got 15 cells"):
        processor("revisit_penalty", OBJECTS, measure="peak")(scores, uneven)
    for bad, message in (({"radius": -1}, "radius must be 0 or more"),
                         ({"measure": "peaks"}, "measure must be one of overlap, peak, got 'peaks'")):
        with pytest.raises(ValueError, match=message):
            DecodingOptions.coerce({"processors": [{"name": "revisit_penalty", "words": ["coat"], **bad}]})


def test_modifiers_cost_the_same_but_are_compared_with_earlier_object_words_only() -> None:
    """The same 4×4 step with word 5 a modifier (a colour): α_t peaked one cell from the earlier object word's peak
    costs the object words and the modifier ρ; peaked on the earlier modifier's own peak it costs nothing ("a blue
    coat": the garment looks where its colour did)."""
    grid = torch.zeros(2, 16)
    grid[0, 2 * 4 + 2] = grid[1, 3 * 4 + 3] = 1.0  # α_t peaks at (2, 2), then at (3, 3)
    history = torch.zeros(2, 2, 16)
    history[:, 0, 1 * 4 + 1] = 1.0  # the object word 3 looked at (1, 1)
    history[:, 1, 3 * 4 + 3] = 1.0  # the modifier 5 at (3, 3)
    step = SearchStep(t=2, words=torch.tensor([5, 5]), alpha=grid, max_length=5,
                      history_tokens=torch.tensor([[3, 5]] * 2), history_alphas=history)
    penalty = processor("revisit_penalty", (3,), penalty=2.5, measure="peak", modifiers=["red"])
    charged = penalty(torch.zeros(2, 6), step)
    assert charged[0].tolist() == [0, 0, 0, -2.5, 0, -2.5] and charged[1].abs().sum() == 0
    with pytest.raises(ValueError, match="a word is in words and in modifiers"):
        DecodingOptions.coerce({"processors": [{"name": "revisit_penalty", "words": ["coat"], "modifiers": ["coat"]}]})
