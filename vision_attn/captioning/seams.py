"""The three seams through which the captioner grows beyond the paper, each an interface with a registry.

- **Attention inputs** (``AttentionInput``): what the score reads besides h_{t−1} (the coverage Σ_{s<t} α_s, the
  word just said), as a term of its query or a term per location.
- **Decoding processors** (``DecodingProcessor``, after HF transformers' ``LogitsProcessor``): an ordered list
  applied to each step's scores in beam search (log-probabilities) and self-critical sampling (logits), such as
  blocked endings. A learnt one, part of the model and so applied in teacher forcing too, is an ``OutputTerm``.
- **Auxiliary objectives and reward terms** (``AuxiliaryTerm``, ``RewardTerm``): weighted losses added to the
  training objective, with what they log, and terms added to the self-critical reward.

A config lists an extension in ``decoder.attention_inputs``, ``decoder.output_terms``, ``decoding.processors``,
``objective.auxiliary`` or ``self_critical.rewards``, by name or as ``{name: blocked_endings, words: [a, and]}``.
The registries are ``vision_attn.captioning.extensions``; ``docs/architecture.md`` shows how to add one.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from torch import Tensor, nn

from vision_attn.option_groups import OptionGroup, finite, require

# How a config lists an extension: its name, or {name: ..., <its options>}. The options' types are spelt out: typed
# Any, jsonargparse reads a quoted word such as "on" or "no" of a config file as YAML again, as true or false.
Entry = str | dict[str, bool | int | float | str | list[str] | None]


@dataclass(frozen=True)
class NoOptions(OptionGroup):
    """An extension without options."""


@dataclass(frozen=True)
class WeightedOptions(OptionGroup):
    """A weighted term's options."""

    weight: float = 1.0
    """the term's weight in the objective"""

    def check(self) -> None:
        """Refuse a negative or non-finite weight."""
        require(finite(self.weight) and self.weight >= 0, self.name, f"weight must be 0 or more, got {self.weight}")


def refuse_unless(condition: bool, seam: str, message: str) -> None:
    """Raise ``ValueError("<seam>: <message>")`` unless ``condition``."""
    if not condition:
        raise ValueError(f"{seam}: {message}")


def checked_entries(entries: Sequence[Any], registry: Mapping[str, type], seam: str, *,
                    repeatable: bool = False) -> list[dict[str, Any]]:
    """``entries`` as ``{name, **options}`` with every option filled in and checked (what a checkpoint keeps); an
    unknown name, a name listed twice (unless ``repeatable``: the processors, each entry its own rule) or a bad
    option is refused in one line."""
    refuse_unless(isinstance(entries, list | tuple), seam, f"expected a list of extensions, got {entries!r}")
    plain: list[dict[str, Any]] = []
    for entry in entries:
        name = entry.get("name") if isinstance(entry, Mapping) else entry
        refuse_unless(isinstance(name, str) and bool(name), seam,
                      f"each entry is a name or a mapping with a name, got {entry!r}")
        close = difflib.get_close_matches(name, list(registry), n=1)
        refuse_unless(name in registry, seam, f"unknown extension {name!r}; " + (
            f"did you mean {close[0]}?" if close else f"use one of {', '.join(sorted(registry))}"))
        refuse_unless(repeatable or all(name != done["name"] for done in plain), seam, f"{name} is listed twice")
        given = {key: value for key, value in entry.items() if key != "name"} if isinstance(entry, Mapping) else {}
        options_type = registry[name].Options
        try:
            options = options_type.coerce(given)
        except ValueError as error:
            raise ValueError(f"{seam}.{name}: {str(error).removeprefix(options_type.name + '.')}") from None
        plain.append({"name": name, **options.to_dict()})
    return plain


def built(entries: Sequence[Mapping[str, Any]], registry: Mapping[str, type], **context: Any) -> dict[str, Any]:
    """The extensions of checked ``entries`` by name, in order, each built from its options and ``context``."""
    return {entry["name"]: built_one(entry, registry, **context) for entry in entries}


def built_one(entry: Mapping[str, Any], registry: Mapping[str, type], **context: Any) -> Any:
    """The extension of one checked entry, built from its options and ``context``."""
    options = registry[entry["name"]].Options.coerce({key: value for key, value in entry.items() if key != "name"})
    return registry[entry["name"]](options, **context)


class LocationTerm(NamedTuple):
    """A location input's term: c_ti (B', L) and the learnt w (W, 1); the score adds w c_ti at each location."""

    values: Tensor
    weight: Tensor


class AttentionInput(nn.Module):
    """What the score reads besides h_{t−1}: ``kind`` "query" adds a (B', W_q) ``term`` to the projected query,
    "location" a ``LocationTerm`` at each location. A stateful input carries a tensor per row (``start``, then
    ``advance`` with α_t), which beam search reorders with the beams. Built from its options, the score's
    ``ScoreWidths`` and the word embedding's width."""

    Options: ClassVar[type[OptionGroup]] = NoOptions
    kind: ClassVar[str] = "query"

    def start(self, rows: int, locations: int, like: Tensor) -> Tensor | None:
        """The carried tensor at t = 1 for ``rows`` rows (None: the input carries nothing)."""
        return None

    def term(self, carried: Tensor | None, word: Tensor | None) -> Tensor | LocationTerm:
        """The term the score adds, from the carried tensor and E y_{t−1} (B', m; None when the caller has none)."""
        raise NotImplementedError

    def advance(self, carried: Tensor | None, alpha: Tensor) -> Tensor | None:
        """The carried tensor after step t, whose attention was α_t (B', L)."""
        return carried


class ScoreWidths(NamedTuple):
    """The widths an attention score adds its inputs' terms in: the query's, and a location term's."""

    query: int
    location: int


class Attended(NamedTuple):
    """A score's α_t (B', L), and each head's α (B', K, L) with a multihead score (α_t is their mean; else None)."""

    alpha: Tensor
    heads: Tensor | None = None


def queries_per_image(keys: Tensor, query: Tensor) -> int:
    """r, the queries of each image (rows of an image adjacent), or a one-line refusal when they do not divide."""
    if query.shape[0] % keys.shape[0]:
        raise ValueError(f"{query.shape[0]} queries for {keys.shape[0]} images: expected a multiple")
    return query.shape[0] // keys.shape[0]


class AttentionScore(nn.Module):
    """e_ti = f_att(a_i, h_{t−1}), α_t = softmax(e_t), for r queries per image (rows of an image adjacent): ``keys``
    once per image, ``forward`` every step, adding the ``AttentionInput`` terms in ``widths``."""

    widths: ScoreWidths

    def keys(self, annotations: Tensor) -> Tensor:
        """What the score precomputes per image from a (B, L, D): W_a a_i, or the keys k_i of a product score."""
        raise NotImplementedError

    def forward(self, keys: Tensor, query: Tensor, query_terms: Sequence[Tensor] = (),
                location_terms: Sequence[LocationTerm] = ()) -> Attended:
        """α over the L locations for the queries h_{t−1} (B·r, H) of B images' ``keys``."""
        raise NotImplementedError


class OutputTerm(nn.Module):
    """A learnt term of the word scores, added at every step of teacher forcing and of decoding; a stateful one
    carries a tensor per row (``start``, ``advance`` with each input word). Built from its options, the vocabulary
    size and the LSTM's width."""

    Options: ClassVar[type[OptionGroup]] = NoOptions

    def start(self, rows: int, like: Tensor) -> Tensor | None:
        """The carried tensor before the first word, for ``rows`` rows."""
        return None

    def advance(self, carried: Tensor | None, words: Tensor) -> Tensor | None:
        """The carried tensor once the input words (B',) are read."""
        return carried

    def step(self, logits: Tensor, hidden: Tensor, carried: Tensor | None) -> Tensor:
        """One step's word logits (B', V) with the term, given h_t (B', H)."""
        raise NotImplementedError

    def teacher_forced(self, logits: Tensor, hidden: Tensor, inputs: Tensor) -> Tensor:
        """Every step's logits (B, T, V) with the term, given h_t (B, T, H) and the input words (B, T)."""
        raise NotImplementedError


@dataclass
class SearchStep:
    """What a decoding processor reads at step t (rows: beams or samples): the input words (N,), α_t (N, L), the
    most words a caption may have, and in beam search the words emitted so far (N, t) with their α (N, t, L)."""

    t: int
    words: Tensor
    alpha: Tensor
    max_length: int
    history_tokens: Tensor | None = None
    history_alphas: Tensor | None = None


class DecodingProcessor(nn.Module):
    """A change to each step's word scores (N, V) in decoding: log-probabilities in beam search, logits in
    self-critical sampling; never in place (sampling differentiates them), and never raising a score (beam search
    stops once no live beam can beat its finished captions). ``sampling`` False: beam search only. Built from its
    options and the ``Vocabulary``."""

    Options: ClassVar[type[OptionGroup]] = NoOptions
    sampling: ClassVar[bool] = True

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The step's scores with this processor's change."""
        raise NotImplementedError


@dataclass
class TrainingStep:
    """What an auxiliary term reads in a training step: the annotations (B, L, D) on their grid; the references
    ``captions`` (N, T+1) of image ``caption_images`` (None: caption n of image n); the objects (B, K, 6) when the
    DataModule gives them; the decoder's tokens (N', T) with their α (N', T, L) and images ``token_images`` (None:
    row n of image n): the references' words in teacher forcing, the samples' in self-critical training."""

    annotations: Tensor
    grid: tuple[int, int]
    captions: Tensor
    caption_images: Tensor | None
    objects: Tensor | None
    tokens: Tensor
    alphas: Tensor
    token_images: Tensor | None


class TermResult(NamedTuple):
    """An auxiliary term's weighted loss, and what to log: name -> (value, how many items it averages)."""

    loss: Tensor
    logs: dict[str, tuple[Tensor, int]]


class AuxiliaryTerm(nn.Module):
    """A loss added to the training objective, weighted by its ``weight`` option; its heads, if any, train beside
    the decoder and never run in inference. Built from its options and the keywords it needs of ``objects``
    (``ObjectNames``), ``vocab``, ``annotation_dim``, ``pretrained`` and ``pretrained_with``."""

    Options: ClassVar[type[OptionGroup]] = WeightedOptions

    def forward(self, step: TrainingStep) -> TermResult | None:
        """The weighted loss and its logs (None when the batch lacks what the term reads: validation's objects)."""
        raise NotImplementedError


class RewardTerm:
    """A term added to the self-critical reward, ``weight`` × ``value(candidate, references)`` on word ids."""

    Options: ClassVar[type[OptionGroup]] = WeightedOptions

    def __init__(self, options: OptionGroup) -> None:
        self.options = options

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """The term for one sampled caption against its image's references (before the weight)."""
        raise NotImplementedError
