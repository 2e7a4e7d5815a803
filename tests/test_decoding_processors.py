"""The decoding processors' seam: an extension listed in ``decoding.processors`` changes what beam search and
self-critical sampling may say, with nothing else changed. ``forbidden_words`` is the example of the architecture
page: one file and one line of registration."""

from __future__ import annotations

import pytest
import torch

from tests.test_bad_endings import VOCABULARY, processor
from tests.test_captioner_model import END, START, tiny_decoder
from vision_attn.captioning.beam_search import beam_search, sample_captions
from vision_attn.captioning.extensions import PROCESSORS
from vision_attn.captioning.options import DecodingOptions
from vision_attn.data.vocabulary import SPECIALS
from vision_attn.tasks import CaptionerTask

FORBIDDEN = 4


def test_a_forbidden_word_is_never_said_by_beam_search_or_sampling() -> None:
    decoder = tiny_decoder(vocab_size=6).eval()
    with torch.no_grad():
        decoder.output_words.bias[FORBIDDEN] += 5.0  # the likeliest word at every step
    annotations = torch.randn(3, 9, 8)
    search = {"start_id": START, "end_id": END, "beam_size": 3, "max_length": 4}
    free = beam_search(decoder, annotations, **search)
    forbidden = beam_search(decoder, annotations, **search, processors=[processor("forbidden_words", (FORBIDDEN,))])
    assert any(FORBIDDEN in h.tokens for beams in free for h in beams)
    assert not any(FORBIDDEN in h.tokens for beams in forbidden for h in beams)
    torch.manual_seed(0)
    sampled = sample_captions(decoder.train(), annotations, per_image=50, start_id=START, end_id=END, max_length=4,
                              processors=[processor("forbidden_words", (FORBIDDEN,))])
    assert not (sampled.tokens == FORBIDDEN).any()
    sampled.log_probs.sum().backward()  # the policy stays differentiable


def test_forbidden_words_are_listed_by_a_config_and_checked() -> None:
    task = CaptionerTask(vocabulary=[*SPECIALS, "a", "red", "top"], image={"size": 96}, encoder={"width": 8},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         decoding={"processors": [{"name": "forbidden_words", "words": ["red", "blue"]}]})
    assert task.model.processors[0].ids.tolist() == [task.model.vocab.id("red")]  # "blue": not a word here
    decoded = task.model.eval().decode(torch.randn(2, 3, 96, 96))
    assert not any("red" in task.model.words(h) for h in decoded.hypotheses)
    assert task.hparams["decoding"]["processors"] == [{"name": "forbidden_words", "words": ["red", "blue"]}]
    for words, message in ((["<end>"], "<end> are special tokens"), (["a", "a"], "names a word twice")):
        with pytest.raises(ValueError, match=f"decoding.processors.forbidden_words: .*{message}"):
            DecodingOptions.coerce({"processors": [{"name": "forbidden_words", "words": words}]})


def test_unk_may_be_forbidden_and_is_then_never_said() -> None:
    """The paper's search may say <unk> (the word for one the vocabulary lacks); a recipe forbids it by listing it."""
    task = CaptionerTask(vocabulary=[*SPECIALS, "a", "red", "top"], image={"size": 96}, encoder={"width": 8},
                         decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16},
                         decoding={"processors": [{"name": "forbidden_words", "words": ["<unk>"]}]})
    unk = SPECIALS.index("<unk>")
    assert task.model.processors[0].ids.tolist() == [unk]
    with torch.no_grad():
        task.model.decoder.output_words.bias[unk] += 50.0  # the likeliest word at every step, but for the processor
    images = torch.randn(2, 3, 96, 96)
    decoded = task.model.eval().decode(images, all_beams=True)
    assert not any(unk in h.tokens for beams in decoded.beams for h in beams)
    # Without it, every step's <unk> costs nothing, so captions of any length tie on the cost of their <end>, and
    # which is best is up to rounding; among the beams, each image's finished captions, some say it.
    task.model.processors = torch.nn.ModuleList()
    for beams in task.model.decode(images, all_beams=True).beams:
        assert any(unk in h.tokens for h in beams)


def test_the_processors_list_is_checked_in_one_line() -> None:
    for processors, message in (([{"name": "no_such"}], "unknown extension 'no_such'; use one of blocked_endings"),
                                (["forbiden_words"], "unknown extension 'forbiden_words'; did you mean forbidden"),
                                ([{"words": ["a"]}], "each entry is a name or a mapping with a name"),
                                ([{"name": "blocked_endings", "word": ["a"]}], "unknown option word")):
        with pytest.raises(ValueError, match=message) as raised:
            DecodingOptions.coerce({"processors": processors})
        assert str(raised.value).startswith("decoding.processors") and "\n" not in str(raised.value)


def test_every_registered_extension_lives_in_its_own_module_of_the_extensions_package() -> None:
    """Adding one touches a new file and its registration, nothing else: every registered class is defined in
    ``vision_attn/captioning/extensions/``."""
    from vision_attn.captioning import extensions

    for registry in (extensions.ATTENTION_INPUTS, extensions.OUTPUT_TERMS, PROCESSORS, extensions.AUXILIARY,
                     extensions.REWARDS):
        for name, cls in registry.items():
            assert cls.__module__.startswith("vision_attn.captioning.extensions."), name
    assert VOCABULARY.tokens[FORBIDDEN] == "and"


def test_a_quoted_word_that_yaml_reads_as_true_stays_a_word_through_the_command_line(tmp_path) -> None:
    """"on", "no" and "yes" are words of captions: quoted in a config file, and in a value given on the command
    line, they reach the processor as words, not as YAML's true and false."""
    import yaml

    from tests.conftest import run_in_process, shipped

    config = tmp_path / "words.yaml"
    config.write_text('model:\n  init_args:\n    decoding:\n      processors:\n'
                      '        - {name: forbidden_words, words: ["on", "no"]}\n')
    words = {"name": "blocked_endings", "words": ["yes", "off"]}
    for extra in ([], ["--model.init_args.decoding.processors", '[{name: blocked_endings, words: ["yes", "off"]}]']):
        result = run_in_process("fit", *shipped("trainer/cpu.yaml", "tasks/captioner.yaml"), "--config", str(config),
                                *extra, "--print_config")
        assert result.returncode == 0, result.stderr[-1500:]
        processors = yaml.safe_load(result.stdout)["model"]["init_args"]["decoding"]["processors"]
        assert processors == ([words] if extra else [{"name": "forbidden_words", "words": ["on", "no"]}])
