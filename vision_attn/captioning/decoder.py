"""The LSTM decoder of "Show, Attend and Tell" (Xu et al. 2015, arXiv 1502.03044, §3.1.2 and §4).

At step t the decoder attends over the annotation vectors a_1..a_L with h_{t−1}, gates the context with a scalar
β_t, and feeds [E y_{t-1}; z_t] to an LSTM; the deep output layer turns E y_{t-1}, h_t and z_t into word scores.
Soft attention (§4.2) takes the expectation Σ_i α_ti a_i; hard attention (§4.1) samples s_t ~ Multinoulli(α_t),
trained with REINFORCE (``reinforce.py``); with probability ``hard_expectation_prob`` a training batch takes the
expected context instead, as the paper allows.

At its defaults this is the paper's decoder; attention inputs and output terms plug in through ``seams.py``.
W_a a_i does not depend on t, so it is computed once per image (``encode``); the deep output runs once over all
steps after the recurrence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.captioning import fast_lstm
from vision_attn.captioning.extensions import ATTENTION_INPUTS, OUTPUT_TERMS
from vision_attn.captioning.fast_additive import additive_scores, doubled_keys
from vision_attn.captioning.options import DecoderOptions
from vision_attn.captioning.product_attention import PRODUCT_SCORES
from vision_attn.captioning.seams import Attended, AttentionScore, ScoreWidths, built, queries_per_image


class AdditiveAttention(AttentionScore):
    """The paper's score (eq. 4, after Bahdanau et al. 2015): e_ti = w·tanh(W_a a_i + W_h h_{t−1}), α_t = softmax(e_t).
    W_a a_i is computed once per image (``keys``); the r queries of an image share it, never copied."""

    heads = 1

    def __init__(self, annotation_dim: int, query_dim: int, attention_dim: int, *, heads: int = 1) -> None:
        super().__init__()  # one α per query: ``heads`` is the multihead score's
        self.annotation_proj = nn.Linear(annotation_dim, attention_dim)  # W_a
        self.query_proj = nn.Linear(query_dim, attention_dim)  # W_h
        self.score = nn.Linear(attention_dim, 1)  # w
        self.widths = ScoreWidths(attention_dim, attention_dim)

    def keys(self, annotations: Tensor) -> Tensor:
        """W_a a_i for all i, doubled for the fast form (fast_additive.py): (B, L, D) -> (B, L, A)."""
        return doubled_keys(self.annotation_proj(annotations))

    def forward(self, keys: Tensor, query: Tensor, query_terms: Any = (), location_terms: Any = ()) -> Attended:
        """α (B·r, L) for r queries per image (B·r, H); query row n belongs to image n // r."""
        batch, locations, width = keys.shape
        per_image = queries_per_image(keys, query)
        projected = self.query_proj(query)  # W_h h_{t−1}, (B·r, A)
        for term in query_terms:  # + W_y E y_{t−1}, ...
            projected = projected + term
        projected = projected.view(batch, per_image, 1, width)  # (B, r, 1, A)
        for values, weight in location_terms:  # + w_c c_ti, ...: the query term becomes per location, (B, r, L, A)
            projected = projected + F.linear(values.view(batch, per_image, locations, 1), weight)
        # e_ti = w·tanh(W_a a_i + W_h h_{t−1}): additive_scores computes exactly this, faster (fast_additive.py)
        scores = additive_scores(keys.unsqueeze(1), projected, self.score)  # (B, r, L)
        return Attended(scores.view(batch * per_image, locations).softmax(dim=-1))  # α_t = softmax(e_t)


ATTENTION_SCORES: dict[str, Callable[..., AttentionScore]] = {"additive": AdditiveAttention, **PRODUCT_SCORES}


@dataclass
class DecoderState:
    """What the recurrence carries from one step to the next: h_{t−1}, c_{t−1} (B, H), and what each attention
    input and output term carries (by name: the coverage Σ_{s<t} α_s, the word counts n_t)."""

    hidden: Tensor
    cell: Tensor
    carried: dict[str, Tensor] = field(default_factory=dict)

    def select(self, index: Tensor) -> DecoderState:
        """The state of rows ``index`` (e.g. the surviving beams)."""
        return DecoderState(self.hidden[index], self.cell[index],
                            {name: value[index] for name, value in self.carried.items()})


@dataclass
class EncodedImage:
    """Per-image tensors computed once and reused at every step: a (B, L, D) and the score's keys (W_a a)."""

    annotations: Tensor
    keys: Tensor


@dataclass
class DecoderOutput:
    """Teacher-forced outputs for a batch of captions of T steps."""

    logits: Tensor  # (B, T, V)
    alphas: Tensor  # α (B, T, L): the attention used to emit word t
    betas: Tensor  # β (B, T)
    location_log_probs: Tensor | None = None  # log p(s_t | a) (B, T), hard attention only
    location_entropy: Tensor | None = None  # H[α_t] (B, T), hard attention only


class AttendedContext(NamedTuple):
    """The gated context z_t (B', D), α_t (B', L), β_t (B',), the sampled location s_t (B',) when hard attention
    samples (else None), and each head's α (B', K, L) with a multihead score (else None)."""

    context: Tensor
    alpha: Tensor
    beta: Tensor
    location: Tensor | None
    heads: Tensor | None = None


class DecoderStep(NamedTuple):
    """One decoding step: word logits (B', V), α_t, β_t, the new state, s_t when sampled, each head's α."""

    logits: Tensor
    alpha: Tensor
    beta: Tensor
    state: DecoderState
    location: Tensor | None = None
    heads: Tensor | None = None


class AttentionDecoder(nn.Module):
    """The decoder of ``options`` (``DecoderOptions``, or its fields as keyword arguments) over annotation vectors of
    ``annotation_dim`` dimensions, speaking a vocabulary of ``vocab_size`` words."""

    def __init__(self, *, vocab_size: int, annotation_dim: int, options: DecoderOptions | None = None,
                 **fields: Any) -> None:
        super().__init__()
        self.options = options = DecoderOptions.merged(options, **fields)
        self.attention_mode, self.hard_expectation_prob = options.attention_mode, options.hard_expectation_prob
        self.embedding = nn.Embedding(vocab_size, options.embed_dim)  # E
        self.attention = ATTENTION_SCORES[options.attention_score](  # e_ti = f_att(a_i, h_{t−1})
            annotation_dim, options.hidden_dim, options.attention_dim, heads=options.attention_heads)
        self.attention_inputs = nn.ModuleDict(built(options.attention_inputs, ATTENTION_INPUTS,
                                                    widths=self.attention.widths, embed_dim=options.embed_dim))
        self.gate = nn.Linear(options.hidden_dim, 1) if options.gate else None  # w_β
        if self.gate is not None:  # β starts at ``initial_gate``: an open gate reads words off the context early
            nn.init.constant_(self.gate.bias, torch.logit(torch.tensor(options.initial_gate)).item())
        self.init_hidden = nn.Linear(annotation_dim, options.hidden_dim)  # f_init,h
        self.init_cell = nn.Linear(annotation_dim, options.hidden_dim)  # f_init,c
        self.lstm = nn.LSTMCell(options.embed_dim + annotation_dim, options.hidden_dim)
        self.output_hidden = nn.Linear(options.hidden_dim, options.embed_dim)  # L_h
        self.output_context = nn.Linear(annotation_dim, options.embed_dim)  # L_z
        self.output_dropout = nn.Dropout(options.dropout)
        self.output_words = nn.Linear(options.embed_dim, vocab_size)  # L_o
        self.output_terms = nn.ModuleDict(built(options.output_terms, OUTPUT_TERMS, vocab_size=vocab_size,
                                                hidden_dim=options.hidden_dim))

    def encode(self, annotations: Tensor) -> EncodedImage:
        """Precompute the score's keys for all locations: (B, L, D) -> (B, L, A)."""
        return EncodedImage(annotations, self.attention.keys(annotations))

    def initial_state(self, annotations: Tensor, per_image: int = 1) -> DecoderState:
        """h_0, c_0 of each image, repeated for its ``per_image`` adjacent rows (its beams or captions): (B·r, H)."""
        mean_annotation = annotations.mean(dim=1)  # (1/L) Σ_i a_i, (B, D)
        hidden = torch.tanh(self.init_hidden(mean_annotation))  # h_0 = tanh(f_init,h(mean a))
        cell = torch.tanh(self.init_cell(mean_annotation))  # c_0 = tanh(f_init,c(mean a))
        if per_image > 1:
            hidden, cell = hidden.repeat_interleave(per_image, dim=0), cell.repeat_interleave(per_image, dim=0)
        carried = {name: start for name, extension in self.attention_inputs.items()
                   if (start := extension.start(len(hidden), annotations.shape[1], annotations)) is not None}
        carried |= {name: start for name, term in self.output_terms.items()
                    if (start := term.start(len(hidden), annotations)) is not None}
        return DecoderState(hidden, cell, carried)

    def context(self, image: EncodedImage, state: DecoderState, word: Tensor | None = None, *,
                sample: bool = False) -> AttendedContext:
        """The gated context z_t (B', D) with its attention, from h_{t−1} and what the attention inputs read (the
        word E y_{t−1} among them); s_t when hard attention samples. The state may hold r rows per image (B' = B·r):
        all r attend the image's one copy of the annotations."""
        terms: dict[str, list[Tensor]] = {"query": [], "location": []}
        for name, extension in self.attention_inputs.items():
            terms[extension.kind].append(extension.term(state.carried.get(name), word))
        alpha, heads = self.attention(image.keys, state.hidden, terms["query"], terms["location"])  # α_t
        if self.gate is not None:
            beta = torch.sigmoid(self.gate(state.hidden))  # β_t = σ(w_β·h_{t-1}), (B', 1)
        else:
            beta = state.hidden.new_ones(len(state.hidden), 1)  # no gate: z_t = Σ_i α_ti a_i
        location = None
        if self.attention_mode == "hard" and sample:
            location = torch.multinomial(alpha, 1).squeeze(1)  # s_t ~ Multinoulli(α_t), (B',)
            weights = nn.functional.one_hot(location, alpha.shape[1]).to(alpha.dtype)
        elif self.attention_mode == "hard" and not self.training:
            weights = nn.functional.one_hot(alpha.argmax(dim=1), alpha.shape[1]).to(alpha.dtype)  # the likeliest a_i
        else:
            weights = alpha
        batch, locations, dim = image.annotations.shape
        if heads is not None and weights is alpha:  # head k reads the k-th slice of a_i: [Σ_i α^k_ti a^k_i]_k
            count = heads.shape[1]
            slices = image.annotations.view(batch, locations, count, dim // count).transpose(1, 2)  # (B, K, L, D/K)
            per_head = heads.view(batch, -1, count, locations).transpose(1, 2)  # (B, K, r, L)
            attended = torch.matmul(per_head, slices).permute(0, 2, 1, 3).reshape(-1, dim)  # (B', D)
        else:  # Σ_i α_ti a_i for the r queries of each image against its one copy of a: (B, r, L) @ (B, L, D)
            attended = torch.bmm(weights.view(batch, -1, locations), image.annotations).view(-1, dim)  # (B', D)
        return AttendedContext(beta * attended, alpha, beta.squeeze(1), location, heads)  # z_t = β_t Σ_i α_ti a_i

    def advance(self, state: DecoderState, hidden: Tensor, cell: Tensor, alpha: Tensor, words: Tensor) -> DecoderState:
        """The state after step t: h_t, c_t, and what the inputs and terms carry after α_t and the input words."""
        carried = {name: extension.advance(state.carried.get(name), alpha)
                   for name, extension in self.attention_inputs.items() if name in state.carried}
        carried |= {name: term.advance(state.carried.get(name), words)
                    for name, term in self.output_terms.items() if name in state.carried}
        return DecoderState(hidden, cell, carried)

    def deep_output(self, embedded_word: Tensor, hidden: Tensor, context: Tensor) -> Tensor:
        """Word logits, p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t)); on (B, ·) for one step or (B, T, ·)."""
        combined = embedded_word + self.output_hidden(hidden) + self.output_context(context)
        return self.output_words(self.output_dropout(combined))

    def _recur(self, embedded: Tensor, word: Tensor, image: EncodedImage, state: DecoderState, sample: bool,
               lstm: fast_lstm.TeacherForcedLSTM | None = None) -> tuple[AttendedContext, DecoderState]:
        # z_t from h_{t−1}, then h_t, c_t = LSTM([E y_{t-1}; z_t], (h_{t−1}, c_{t−1})) (``lstm``: the same, faster)
        attended = self.context(image, state, embedded, sample=sample)
        previous = (state.hidden, state.cell)
        hidden, cell = (lstm.step(attended.context, previous) if lstm is not None
                        else self.lstm(torch.cat([embedded, attended.context], dim=1), previous))
        return attended, self.advance(state, hidden, cell, attended.alpha, word)

    def step(self, word: Tensor, image: EncodedImage, state: DecoderState, *, sample: bool = False) -> DecoderStep:
        """One decoding step from the previous words (B',); ``sample``: hard attention draws s_t ~ α_t."""
        embedded = self.embedding(word)
        attended, state = self._recur(embedded, word, image, state, sample)
        logits = self.deep_output(embedded, state.hidden, attended.context)
        for name, term in self.output_terms.items():
            logits = term.step(logits, state.hidden, state.carried.get(name))
        return DecoderStep(logits, attended.alpha, attended.beta, state, attended.location, attended.heads)

    def forward(self, annotations: Tensor, captions: Tensor) -> DecoderOutput:
        """Teacher forcing over ``captions`` (B', T+1) = <start> w_1 .. w_n <end> <pad>..; predicts captions[:, 1:].
        ``annotations`` (B, L, D), B' = B·r: an image's r captions are adjacent rows sharing its a and W_a a."""
        if captions.shape[0] % annotations.shape[0]:
            raise ValueError(f"{captions.shape[0]} captions for {annotations.shape[0]} images: expected a multiple")
        image = self.encode(annotations)
        state = self.initial_state(annotations, captions.shape[0] // annotations.shape[0])
        inputs = captions[:, :-1]
        embedded = self.embedding(inputs)  # E y_{t-1} for every step, (B', T, m)
        sample = self.attention_mode == "hard" and self.training
        if sample and torch.rand(()) < self.hard_expectation_prob:
            sample = False  # this batch trains on the expected context (the paper's mix of soft and hard)
        lstm = fast_lstm.TeacherForcedLSTM(self.lstm, embedded) if fast_lstm.applies(embedded, self.lstm) else None
        steps = []
        for t in range(inputs.shape[1]):
            attended, state = self._recur(embedded[:, t], inputs[:, t], image, state, sample, lstm)
            steps.append((state.hidden, attended.context, attended.alpha, attended.beta, attended.location))
        hiddens, contexts, alphas, betas, locations = zip(*steps, strict=True)
        hidden_all = torch.stack(hiddens, 1)  # (B', T, H)
        logits = self.deep_output(embedded, hidden_all, torch.stack(contexts, 1))  # one projection for all t
        for term in self.output_terms.values():
            logits = term.teacher_forced(logits, hidden_all, inputs)
        output = DecoderOutput(logits=logits, alphas=torch.stack(alphas, 1), betas=torch.stack(betas, 1))
        if sample:
            chosen = torch.stack(locations, 1)  # (B', T)
            log_alphas = output.alphas.clamp_min(1e-12).log()
            output.location_log_probs = log_alphas.gather(2, chosen.unsqueeze(-1)).squeeze(-1)  # log p(s_t | a)
            output.location_entropy = -(output.alphas * log_alphas).sum(-1)  # H[α_t]
        return output
