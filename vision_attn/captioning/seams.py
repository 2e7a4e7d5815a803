"""The three seams through which the captioner grows beyond the paper, each an interface with a registry.

- **Attention inputs** (``AttentionInput``): what the attention score reads besides h_{t−1}, such as the coverage
  Σ_{s<t} α_s or the word just said. An input adds a term to the score's query, or a term per location.
- **Decoding processors** (``DecodingProcessor``, after HF transformers' ``LogitsProcessor``): an ordered list
  applied to each step's scores in beam search (log-probabilities) and in self-critical sampling (logits), such as
  blocked endings. A learnt one, part of the model's output and so applied in teacher forcing too, is an
  ``OutputTerm`` (the word counts).
- **Auxiliary objectives and reward terms** (``AuxiliaryTerm``, ``RewardTerm``): losses added to the training
  objective, each with its weight and what it logs, and terms added to the self-critical reward.

A config turns an extension on by listing it in its group: ``decoder.attention_inputs``, ``decoder.output_terms``,
``decoding.processors``, ``objective.auxiliary`` and ``self_critical.rewards``. An entry is the extension's name,
or a mapping with its ``name`` and its options (``{name: blocked_endings, words: [a, and]}``). The registries are
``vision_attn.captioning.extensions``; ``docs/architecture.md`` shows how to add one.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from torch import Tensor, nn

from vision_attn.option_groups import OptionGroup

Entry = str | dict[str, Any]  # how a config lists an extension: its name, or {name: ..., <its options>}


@dataclass(frozen=True)
class NoOptions(OptionGroup):
    """An extension without options."""


def refuse_unless(condition: bool, seam: str, message: str) -> None:
    """Raise ``ValueError("<seam>: <message>")`` unless ``condition``: a list's one-line refusal."""
    if not condition:
        raise ValueError(f"{seam}: {message}")


def entry_name(entry: Any, seam: str) -> str:
    """The name an extension entry gives, or a one-line refusal naming the seam."""
    name = entry.get("name") if isinstance(entry, Mapping) else entry
    refuse_unless(isinstance(name, str) and bool(name), seam,
                  f"each entry is a name or a mapping with a name, got {entry!r}")
    return name


def checked_entries(entries: Sequence[Any], registry: Mapping[str, type], seam: str) -> list[dict[str, Any]]:
    """``entries`` as plain mappings ``{name, **options}`` with every option filled in and checked against the
    extension's ``Options``: what a checkpoint keeps. Refuses an unknown name, an extension listed twice, or a
    bad option, in one line."""
    refuse_unless(isinstance(entries, list | tuple), seam, f"expected a list of extensions, got {entries!r}")
    plain, seen = [], set()
    for entry in entries:
        name = entry_name(entry, seam)
        close = difflib.get_close_matches(name, list(registry), n=1)
        refuse_unless(name in registry, seam, f"unknown extension {name!r}; " + (
            f"did you mean {close[0]}?" if close else f"use one of {', '.join(sorted(registry))}"))
        refuse_unless(name not in seen, seam, f"{name} is listed twice")
        seen.add(name)
        given = {key: value for key, value in entry.items() if key != "name"} if isinstance(entry, Mapping) else {}
        options_type = registry[name].Options
        try:
            options = options_type.coerce(given)
        except ValueError as error:
            raise ValueError(f"{seam}.{name}: {str(error).removeprefix(options_type.name + '.')}") from None
        plain.append({"name": name, **options.to_dict()})
    return plain


def built(entries: Sequence[Mapping[str, Any]], registry: Mapping[str, type], **context: Any) -> dict[str, Any]:
    """The extensions of checked ``entries`` by name, in their order, each built from its options and the
    ``context`` it needs."""
    return {entry["name"]: registry[entry["name"]](registry[entry["name"]].Options.coerce(
        {key: value for key, value in entry.items() if key != "name"}), **context) for entry in entries}


class LocationTerm(NamedTuple):
    """A location input's term: a scalar per location c_ti (B', L) and the learnt vector w (W, 1) that scales it
    into the score's location width; the score adds w c_ti at each location (in its own layout)."""

    values: Tensor
    weight: Tensor


class AttentionInput(nn.Module):
    """What the attention score reads besides h_{t−1}. ``kind`` "query": ``term`` is (B', W_q), added to the
    score's projected query; "location": ``term`` is a ``LocationTerm``, added at each location. A stateful input
    carries a tensor across steps: ``start`` gives it, ``advance`` updates it with α_t; the decoder keeps it per row, so
    beam search reorders it with the beams. Built from its options and the score's widths (``ScoreWidths``) and
    the word embedding's width."""

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
    """What an attention score gives at step t: α_t (B', L), and each head's α (B', K, L) with a multihead score
    (α_t is then their mean; else None)."""

    alpha: Tensor
    heads: Tensor | None = None


def queries_per_image(keys: Tensor, query: Tensor) -> int:
    """r, the queries of each image (rows of an image adjacent), or a one-line refusal when they do not divide."""
    if query.shape[0] % keys.shape[0]:
        raise ValueError(f"{query.shape[0]} queries for {keys.shape[0]} images: expected a multiple")
    return query.shape[0] // keys.shape[0]


class AttentionScore(nn.Module):
    """e_ti = f_att(a_i, h_{t−1}) and α_t = softmax(e_t), for r queries per image (rows of an image adjacent, as the
    beams of a search). ``keys`` computes what depends on the image alone once per image; ``forward`` scores every
    step, adding the attention inputs' terms (``AttentionInput``) in ``widths``."""

    widths: ScoreWidths

    def keys(self, annotations: Tensor) -> Tensor:
        """What the score precomputes per image from a (B, L, D): W_a a_i, or the keys k_i of a product score."""
        raise NotImplementedError

    def forward(self, keys: Tensor, query: Tensor, query_terms: Sequence[Tensor] = (),
                location_terms: Sequence[LocationTerm] = ()) -> Attended:
        """α over the L locations for the queries h_{t−1} (B·r, H) of B images' ``keys``."""
        raise NotImplementedError


class OutputTerm(nn.Module):
    """A learnt term of the word scores, part of the model: the decoder adds it at every step of teacher forcing and
    of decoding. A stateful term carries a tensor per row (``start``, ``advance`` with each input word). Built from
    its options, the vocabulary size and the LSTM's width."""

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
    """What a decoding processor may read at step t: the words just input (N,), α_t (N, L), the words emitted so far
    (N, t) and their α (N, t, L) when the search keeps them (beam search; None in sampling), and the most words a
    caption may have. Rows are the beams or samples."""

    t: int
    words: Tensor
    alpha: Tensor
    max_length: int
    history_tokens: Tensor | None = None
    history_alphas: Tensor | None = None


class DecodingProcessor(nn.Module):
    """A change to each step's word scores (N, V) when captions are decoded: log-probabilities in beam search, logits
    in self-critical sampling. Returns new scores (never changes them in place: sampling differentiates them).
    ``sampling`` False: beam search only. Built from its options and the vocabulary (``Vocabulary``)."""

    Options: ClassVar[type[OptionGroup]] = NoOptions
    sampling: ClassVar[bool] = True

    def forward(self, scores: Tensor, step: SearchStep) -> Tensor:
        """The step's scores with this processor's change."""
        raise NotImplementedError


@dataclass
class TrainingStep:
    """What an auxiliary term may read in a training step: the images' annotation vectors (B, L, D) on their grid;
    the references, ``captions`` (N, T+1) of image ``caption_images`` (None: caption n of image n); the batch's
    objects (B, K, 6) when the DataModule gives them; and what the decoder said: its tokens (N', T), their α
    (N', T, L), and whose image each row is (None: row n of image n). In teacher forcing the tokens are the
    references' words; in self-critical training, the samples'."""

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
    """A loss added to the training objective, weighted by its ``weight`` option; it may hold heads over the
    annotation vectors (trained beside the decoder; inference never runs them). Built from its options and the
    keywords it needs of ``objects`` (``ObjectNames``), ``vocab``, ``annotation_dim``, ``pretrained`` (the encoder's
    first weights) and ``pretrained_with`` (their hyper-parameters). Returns None when the batch lacks what it reads
    (validation has no objects)."""

    Options: ClassVar[type[OptionGroup]] = NoOptions

    def forward(self, step: TrainingStep) -> TermResult | None:
        """This term's weighted loss for a training step, with what it logs."""
        raise NotImplementedError


class RewardTerm:
    """A term added to the self-critical reward, ``weight`` × ``value(candidate, references)`` on word ids."""

    Options: ClassVar[type[OptionGroup]] = NoOptions

    def __init__(self, options: OptionGroup) -> None:
        self.options = options

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """The term for one sampled caption against its image's references (before the weight)."""
        raise NotImplementedError
