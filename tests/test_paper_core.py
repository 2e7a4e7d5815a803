"""The paper at the core: the captioner's core option groups are small, and with their defaults the captioner is
Xu et al. 2015; what goes beyond it is listed, never flagged. The paper's recipe (configs/captioner/
fashion_scenes_paper.yaml, over the Fashion scenes recipe) builds the model the defaults build."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tests.conftest import shipped
from vision_attn.captioning.options import (
    DecoderOptions,
    DecodingOptions,
    EncoderOptions,
    ObjectiveOptions,
    SelfCriticalOptions,
)
from vision_attn.cli import main
from vision_attn.data.vocabulary import SPECIALS
from vision_attn.tasks import CaptionerTask

CORE = {"encoder": EncoderOptions, "decoder": DecoderOptions, "decoding": DecodingOptions,
        "objective": ObjectiveOptions, "self_critical": SelfCriticalOptions}
EXTENSION_LISTS = {"attention_inputs", "output_terms", "processors", "auxiliary", "rewards"}
# What a recipe sizes to its data and machine, which the paper leaves to the experimenter
SIZES = {"decoder": {"embed_dim", "hidden_dim", "attention_dim", "dropout"}, "decoding": {"beam_size", "max_length"},
         "self_critical": {"samples"}}


def test_the_core_groups_hold_at_most_thirty_options_and_list_the_extensions_apart() -> None:
    core = [(name, field.name) for name, group in CORE.items() for field in dataclasses.fields(group)
            if field.name not in EXTENSION_LISTS]
    assert len(core) <= 30, core
    lists = {field.name for group in CORE.values() for field in dataclasses.fields(group)} & EXTENSION_LISTS
    assert lists == EXTENSION_LISTS
    for name, group in CORE.items():
        for field in dataclasses.fields(group):
            if field.name in EXTENSION_LISTS:
                assert getattr(group(), field.name) == [], f"{name}.{field.name}: the paper lists no extension"


def test_the_papers_recipe_is_the_defaults(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["fit", *shipped("trainer/cpu.yaml", "tasks/captioner.yaml", "captioner/fashion_scenes.yaml",
                              "captioner/fashion_scenes_paper.yaml"), "--print_config"])
    assert done.value.code in (0, None)
    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    for name, group in CORE.items():
        default = group().to_dict()
        for key, value in model[name].items():
            if name != "encoder" and key not in SIZES.get(name, ()):
                assert value == default[key], f"{name}.{key}: the paper's recipe sets {value!r}, the default is " \
                                              f"{default[key]!r}"
    vocabulary = [*SPECIALS, "a", "red", "top"]
    sized = {name: {key: model[name][key] for key in SIZES.get(name, ())} for name in CORE}
    encoder = {**model["encoder"], "pretrained": None}
    paper = CaptionerTask(vocabulary=vocabulary, encoder=encoder, **{name: model[name] for name in CORE
                                                                    if name != "encoder"})
    defaults = CaptionerTask(vocabulary=vocabulary, encoder=encoder, **{k: v for k, v in sized.items() if v})
    shapes = {name: tuple(tensor.shape) for name, tensor in paper.state_dict().items()}
    assert shapes == {name: tuple(tensor.shape) for name, tensor in defaults.state_dict().items()}
    assert not any(part in name for name in shapes for part in ("attention_inputs", "output_terms", "auxiliary"))
    assert not len(paper.model.processors) and not paper.self_critical.terms
