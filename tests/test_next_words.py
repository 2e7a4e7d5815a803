"""The next words (a decoding processor): right after a word of ``after`` only a word of ``only`` comes, in beam search
(which then finds the best caption that keeps the rule), and its words are checked and read from the vocabulary."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.test_captioner_model import END, START, _sequence_log_prob, tiny_decoder
from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.extensions import PROCESSORS
from vision_attn.captioning.options import DecodingOptions
from vision_attn.captioning.seams import built
from vision_attn.data.vocabulary import SPECIALS, Vocabulary
from vision_attn.tasks import CaptionerTask

VOCABULARY = Vocabulary([*SPECIALS, "blue", "coat"])  # the tiny decoders' six words: 4 "blue", 5 "coat"
BLUE, COAT = 4, 5


def next_words(after: list[str], only: list[str]):
    return built([{"name": "next_words", "after": after, "only": only}], PROCESSORS, vocab=VOCABULARY)["next_words"]


def keeps_the_rule(tokens: tuple[int, ...], max_length: int) -> bool:
    """After "blue" comes "coat", except at the last step, where <end> must come."""
    return all(tokens[i + 1] == COAT for i in range(len(tokens) - 1) if tokens[i] == BLUE) and \
        not (tokens and tokens[-1] == BLUE and len(tokens) < max_length)


def test_beam_search_finds_the_best_caption_in_which_a_colour_is_followed_by_a_garment() -> None:
    """Exhaustively: every caption of up to 3 words from words 3..5, less those where "blue" is followed by anything
    but "coat" (<end> included, before the last step); the beam keeps all prefixes, so it must find the best."""
    decoder = tiny_decoder(vocab_size=6).eval()
    annotations, words, max_length = torch.randn(4, 9, 8), [3, BLUE, COAT], 3
    allowed = [seq for n in range(max_length + 1) for seq in itertools.product(words, repeat=n)
               if keeps_the_rule(seq, max_length)]
    search = {"start_id": START, "end_id": END, "beam_size": 27, "max_length": max_length}
    free = beam_search(decoder, annotations, **search)
    ruled = beam_search(decoder, annotations, **search, processors=[next_words(["blue"], ["coat"])])
    for b in range(len(annotations)):
        best_score, best = max((_sequence_log_prob(decoder, annotations[b : b + 1], c), c) for c in allowed)
        assert tuple(ruled[b][0].tokens) == best
        assert ruled[b][0].log_prob == pytest.approx(best_score, abs=1e-4)  # the model's own log-probability
        assert all(keeps_the_rule(tuple(h.tokens), max_length) for h in ruled[b])
    assert not all(keeps_the_rule(tuple(h.tokens), max_length) for beams in free for h in beams)  # it did something


def test_next_words_are_listed_by_a_config_checked_and_read_from_the_vocabulary() -> None:
    task = CaptionerTask(vocabulary=[*SPECIALS, "a", "blue", "coat"], image={"size": 96}, encoder={"width": 8},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         decoding={"processors": [{"name": "next_words", "after": ["blue", "red"],
                                                   "only": ["coat", "bag"]}]})
    rule = task.model.processors[0]
    vocab = task.model.vocab
    assert rule.after.tolist() == [vocab.id("blue")]  # "red", "bag": not words here, left out
    assert rule.barred.tolist() == [token != "coat" for token in vocab.tokens]
    for decoded in task.model.eval().decode(torch.randn(3, 3, 96, 96)).hypotheses:
        words = task.model.words(decoded)
        assert all(words[i + 1] == "coat" for i in range(len(words) - 1) if words[i] == "blue")
    nothing = next_words(["blue"], ["zebra"])  # no word could follow: the rule is left out, not every word barred
    assert not nothing.barred.any()
    for options, message in (({"after": [], "only": ["coat"]}, "after and only each need at least one word"),
                             ({"after": ["blue", "blue"], "only": ["coat"]}, "names a word twice"),
                             ({"after": ["blue"], "only": [""]}, "words are words")):
        with pytest.raises(ValueError, match=f"decoding.processors.next_words: .*{message}"):
            DecodingOptions.coerce({"processors": [{"name": "next_words", **options}]})


def test_next_words_listed_again_is_one_more_rule_and_each_applies() -> None:
    """The scenes' word order is several rules (after "a" a colour, after a colour a garment): the processors may
    list next_words once per rule, each built and applied in order, where another seam refuses a name twice."""
    options = DecodingOptions.coerce({"processors": [{"name": "next_words", "after": ["a"], "only": ["blue"]},
                                                     {"name": "next_words", "after": ["blue"], "only": ["coat"]}]})
    task = CaptionerTask(vocabulary=[*SPECIALS, "a", "blue", "coat"], image={"size": 96}, encoder={"width": 8},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         decoding={"processors": options.processors})
    assert len(task.model.processors) == 2
    vocab = task.model.vocab
    with torch.no_grad():  # "a" the likeliest at every step, then "blue" and "coat", far above <end>: a caption
        # says "a" whatever the random weights, and without the rules "a" would follow "a" and "blue"
        task.model.decoder.output_words.bias[vocab.id("a")] += 20.0
        task.model.decoder.output_words.bias[[vocab.id("blue"), vocab.id("coat")]] += 10.0
    captions = [task.model.words(h) for beams in task.model.eval().decode(torch.randn(3, 3, 96, 96), beam_size=4,
                                                                           all_beams=True).beams for h in beams]
    for words in captions:
        assert all(words[i + 1] == "blue" for i in range(len(words) - 1) if words[i] == "a")
        assert all(words[i + 1] == "coat" for i in range(len(words) - 1) if words[i] == "blue")
    assert any("a" in words for words in captions)
    with pytest.raises(ValueError, match="objective.auxiliary: concept is listed twice"):
        CaptionerTask(vocabulary=[*SPECIALS, "a"], objective={"auxiliary": ["concept", "concept"]})

