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
