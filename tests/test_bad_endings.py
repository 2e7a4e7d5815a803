"""The blocked endings (a decoding processor): no caption ends right after one of its words, in beam search (which
then finds the best caption that does not) and in self-critical sampling, and its words are checked and read from
the vocabulary."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.test_captioner_model import END, START, _sequence_log_prob, tiny_decoder
from vision_attn.captioning.beam_search import beam_search, sample_captions
from vision_attn.captioning.extensions import PROCESSORS
from vision_attn.captioning.options import DecodingOptions
from vision_attn.captioning.seams import DecodingProcessor, built
from vision_attn.data.vocabulary import SPECIALS, Vocabulary
from vision_attn.tasks import CaptionerTask

BAD = 4  # the word a caption may not end on, as "and"
VOCABULARY = Vocabulary([*SPECIALS, "and", "red"])  # the tiny decoders' six words, BAD among them


def processor(name: str, ids: tuple[int, ...], **options: object) -> DecodingProcessor:
    """The processor ``name`` over the words of ``ids`` in ``VOCABULARY``."""
    return built([{"name": name, "words": [VOCABULARY.tokens[i] for i in ids], **options}], PROCESSORS,
                 vocab=VOCABULARY)[name]


def test_beam_search_finds_the_best_caption_that_does_not_end_on_a_bad_word() -> None:
    """Exhaustively: every caption of up to 3 words, less those ending on word 4 before the third word (at
    max_length <end> is the only way on); the beam keeps all prefixes, so it must find the best of the rest."""
    decoder = tiny_decoder(vocab_size=6).eval()
    annotations, words, max_length = torch.randn(4, 9, 8), [3, 4, 5], 3
    allowed = [seq for n in range(max_length + 1) for seq in itertools.product(words, repeat=n)
               if not (seq and seq[-1] == BAD and n < max_length)]
    free = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=27, max_length=max_length)
    blocked = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=27, max_length=max_length,
                          processors=[processor("blocked_endings", (BAD,))])
    changed = 0
    for b in range(len(annotations)):
        best_score, best = max((_sequence_log_prob(decoder, annotations[b : b + 1], c), c) for c in allowed)
        assert tuple(blocked[b][0].tokens) == best
        assert blocked[b][0].log_prob == pytest.approx(best_score, abs=1e-4)  # the model's own log-probability
        for hypothesis in blocked[b]:
            assert not (hypothesis.tokens and hypothesis.tokens[-1] == BAD and len(hypothesis.tokens) < max_length)
        changed += any(h.tokens and h.tokens[-1] == BAD and len(h.tokens) < max_length for h in free[b])
    assert changed  # unblocked, some beams do end on it: the block is what removed them


def test_no_sample_ends_on_a_bad_word_before_the_last_step() -> None:
    decoder = tiny_decoder(vocab_size=6)
    annotations = torch.randn(3, 9, 8)
    torch.manual_seed(1)
    free = sample_captions(decoder, annotations, per_image=200, start_id=START, end_id=END, max_length=4)
    torch.manual_seed(1)
    blocked = sample_captions(decoder, annotations, per_image=200, start_id=START, end_id=END, max_length=4,
                              processors=[processor("blocked_endings", (BAD,))])

    def endings(tokens: torch.Tensor) -> tuple[int, int]:
        """(captions ending on the bad word before max_length, captions saying it at all)"""
        early = said = 0
        for row in tokens.tolist():
            words = row[: row.index(END)] if END in row else row
            said += BAD in words
            early += bool(words) and words[-1] == BAD and len(words) < 4
        return early, said

    assert endings(free.tokens)[0] > 0  # the untouched policy does end on it
    early, said = endings(blocked.tokens)
    assert early == 0 and said > 0  # the word is still said, only never last
    blocked.log_probs.sum().backward()  # the policy stays differentiable


def test_bad_endings_are_checked_and_read_from_the_vocabulary() -> None:
    for bad, message in (([""], "decoding.processors.blocked_endings: words are words"),
                         (["and", "and"], "names a word twice")):
        with pytest.raises(ValueError, match=message):
            DecodingOptions.coerce({"processors": [{"name": "blocked_endings", "words": bad}]})
    task = CaptionerTask(vocabulary=[*SPECIALS, "a", "and", "red", "top"], image={"size": 96}, encoder={"width": 8},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         decoding={"processors": [{"name": "blocked_endings", "words": ["and", "a", "of"]}]})
    blocked = task.model.processors[0]  # "of": not a word of this vocabulary, left out
    assert blocked.ids.tolist() == [task.model.vocab.id("and"), task.model.vocab.id("a")]
    plain = CaptionerTask(vocabulary=[*SPECIALS, "a"], image={"size": 96}, encoder={"width": 8})
    assert not len(plain.model.processors)


def test_the_scenes_default_blocks_every_ending_but_a_garment_and_on_its_own() -> None:
    """The shipped default blocks <end> after every word of the scenes' captions that needs another after it: every
    word of their templates, relation phrases and colours but "own" ("a red coat on its own"), the one a template
    ends on. So no caption ends "... and a blue", "... next" or "... on"; the garments' names end them."""
    import re

    import yaml

    from tests.conftest import REPO
    from vision_attn.data.scenes import CAPTION_FORMS, CLASS_WORDS, COLOURS, ONE_ITEM_FORMS, RELATIONS

    config = yaml.safe_load((REPO / "configs" / "captioner" / "fashion_scenes.yaml").read_text())
    processors = config["model"]["init_args"]["decoding"]["processors"]
    blocked = next(p for p in processors if p["name"] == "blocked_endings")["words"]
    templates = [template for forms in CAPTION_FORMS.values() for template, _ in forms] + list(ONE_ITEM_FORMS)
    phrases = [*RELATIONS, ", with", "and"]  # and the joiners of four or five items
    words = {word for text in templates + phrases for word in re.findall(r"[a-z]+", re.sub(r"{[^}]*}", " ", text))}
    assert set(blocked) == (words | set(COLOURS)) - {"own"}
    assert {"name": "forbidden_words", "words": ["<unk>"]} in processors
    rule = next(p for p in processors if p["name"] == "next_words")  # a colour names the garment after it
    assert set(rule["after"]) == set(COLOURS) and set(rule["only"]) == set(CLASS_WORDS)
