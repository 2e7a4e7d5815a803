"""The LSTM decoder of "Show, Attend and Tell" (Xu et al. 2015, arXiv 1502.03044, §3.1.2 and §4).

At step t the decoder attends over the annotation vectors a_1..a_L with its previous hidden state,
gates the context with a scalar β_t, and feeds [E y_{t-1}; z_t] to an LSTM; the deep output layer turns
E y_{t-1}, h_t and z_t into word scores.

Soft attention (§4.2) takes the expectation Σ_i α_ti a_i. Hard attention (§4.1) samples one location
s_t ~ Multinoulli(α_t) and is trained with REINFORCE (see ``losses.py``); with probability
``hard_expectation_prob`` a training sequence uses the expected context instead, as the paper allows.

Speed: W_a a_i does not depend on t, so it is computed once per image (``encode``), not at every step;
the deep output and the vocabulary projection run once over all steps after the recurrence.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from vision_attn.attention import annotation_attention
from vision_attn.captioning.options import DecoderOptions


@dataclass
class DecoderState:
    """What the recurrence carries from one step to the next."""

    hidden: Tensor  # h_{t-1} (B, H)
    cell: Tensor  # c_{t-1} (B, H)
    coverage: Tensor | None = None  # Σ_{s<t} α_s (B, L), when the attention reads its coverage
    word_counts: Tensor | None = None  # n_w: how often each word has been input so far (B, V), with word_counts

    def select(self, index: Tensor) -> DecoderState:
        """The state of rows ``index`` (e.g. the surviving beams)."""
        return DecoderState(self.hidden[index], self.cell[index],
                            None if self.coverage is None else self.coverage[index],
                            None if self.word_counts is None else self.word_counts[index])


@dataclass
class EncodedImage:
    """Per-image tensors computed once and reused at every step."""

    annotations: Tensor  # a (B, L, D)
    projected: Tensor  # W_a a (B, L, A): what the score precomputes per image (the keys k_i of a product score)


@dataclass
class DecoderOutput:
    """Teacher-forced outputs for a batch of captions of T steps."""

    logits: Tensor  # (B, T, V)
    alphas: Tensor  # α (B, T, L): the attention used to emit word t
    betas: Tensor  # β (B, T)
    location_log_probs: Tensor | None = None  # log p(s_t | a) (B, T), hard attention only
    location_entropy: Tensor | None = None  # H[α_t] (B, T), hard attention only


class AttendedContext(NamedTuple):
    """What attention gives at step t: the gated context z_t (B, D), α_t (B, L), β_t (B,), the sampled
    location s_t (B,) when hard attention samples (else None), and each head's α (B, K, L) with a multihead
    score (else None; α_t is then their mean)."""

    context: Tensor
    alpha: Tensor
    beta: Tensor
    location: Tensor | None
    heads: Tensor | None = None


class DecoderStep(NamedTuple):
    """One decoding step: word logits (B, V), α_t (B, L), β_t (B,), the new recurrent state, the sampled
    location s_t (B,) when hard attention samples (else None), and each head's α (B, K, L) with a multihead
    score (else None)."""

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
        self.attention_mode = options.attention_mode
        self.hard_expectation_prob = options.hard_expectation_prob
        self.embedding = nn.Embedding(vocab_size, options.embed_dim)  # E
        # e_ti = f_att(a_i, h_{t-1}): the paper's additive score, or a product score (attention.py)
        self.attention = annotation_attention(options.attention_score, annotation_dim, options.hidden_dim,
                                              options.attention_dim, heads=options.attention_heads,
                                              coverage=options.coverage,
                                              word_dim=options.embed_dim if options.attend_with_word else 0)
        self.gate = nn.Linear(options.hidden_dim, 1) if options.gate else None  # w_β
        if self.gate is not None:  # β starts near ``initial_gate``: an open gate reads words off the context early
            nn.init.constant_(self.gate.bias, torch.logit(torch.tensor(options.initial_gate)).item())
        self.init_hidden = nn.Linear(annotation_dim, options.hidden_dim)  # f_init,h
        self.init_cell = nn.Linear(annotation_dim, options.hidden_dim)  # f_init,c
        self.lstm = nn.LSTMCell(options.embed_dim + annotation_dim, options.hidden_dim)
        self.output_hidden = nn.Linear(options.hidden_dim, options.embed_dim)  # L_h
        self.output_context = nn.Linear(annotation_dim, options.embed_dim)  # L_z
        self.output_dropout = nn.Dropout(options.dropout)
        self.output_words = nn.Linear(options.embed_dim, vocab_size)  # L_o
        # ρ: what each word's having been said already adds to its score (0 at the start: the paper's output)
        self.repeat_weight = nn.Parameter(torch.zeros(vocab_size)) if options.word_counts else None
        # ρ_t = ρ + U h_t with word_count_context: whether a word may be said again depends on where the sentence
        # is ("the red coat" may name the coat again, "and a red coat" may not); U = 0 at the start: ρ_t = ρ
        self.repeat_context = None
        if options.word_count_context:
            self.repeat_context = nn.Linear(options.hidden_dim, vocab_size)
            nn.init.zeros_(self.repeat_context.weight)
            nn.init.zeros_(self.repeat_context.bias)

    def encode(self, annotations: Tensor) -> EncodedImage:
        """Precompute W_a a_i for all locations: (B, L, D) -> (B, L, A)."""
        return EncodedImage(annotations, self.attention.project_annotations(annotations))

    def initial_state(self, annotations: Tensor, per_image: int = 1) -> DecoderState:
        """h_0, c_0 of each image, repeated for its ``per_image`` adjacent rows (its beams or captions): (B·r, H)."""
        mean_annotation = annotations.mean(dim=1)  # (1/L) Σ_i a_i, (B, D)
        hidden = torch.tanh(self.init_hidden(mean_annotation))  # h_0 = tanh(f_init,h(mean a))
        cell = torch.tanh(self.init_cell(mean_annotation))  # c_0 = tanh(f_init,c(mean a))
        if per_image > 1:
            hidden, cell = hidden.repeat_interleave(per_image, dim=0), cell.repeat_interleave(per_image, dim=0)
        coverage = counts = None
        if self.attention.coverage_proj is not None:  # c_1 = 0: nothing attended yet
            coverage = annotations.new_zeros(hidden.shape[0], annotations.shape[1])
        if self.repeat_weight is not None:  # nothing said yet
            counts = annotations.new_zeros(hidden.shape[0], len(self.repeat_weight))
        return DecoderState(hidden, cell, coverage, counts)

    def context(self, image: EncodedImage, state: DecoderState, *, sample: bool = False,
                word: Tensor | None = None) -> AttendedContext:
        """The gated context vector z_t (B', D) with its attention, and s_t when hard attention samples.

        The state may hold r rows per image (B' = B·r, rows of one image adjacent, as the beams of a
        search): all r attend the image's one copy of the annotations. ``word`` is E y_{t-1} (B', m), which
        the attention reads when built with ``attend_with_word``.
        """
        # α_t = softmax(w·tanh(W_a a_i + W_h h_{t-1} [+ w_c c_ti] [+ W_y E y_{t-1}])) for the paper's score
        alpha = self.attention(image.projected, state.hidden, state.coverage, word)
        heads = None
        if alpha.dim() == 3:  # multihead: α_t^k per head (B', K, L); α_t is their mean
            heads, alpha = alpha, alpha.mean(dim=1)
        if self.gate is not None:
            beta = torch.sigmoid(self.gate(state.hidden))  # β_t = σ(w_β·h_{t-1}), (B, 1)
        else:
            beta = state.hidden.new_ones(len(state.hidden), 1)  # no gate: z_t = Σ_i α_ti a_i
        location = None
        if self.attention_mode == "hard" and sample:
            location = torch.multinomial(alpha, 1).squeeze(1)  # s_t ~ Multinoulli(α_t), (B,)
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
        else:  # Σ_i α_ti a_i for the r = B'/B queries of each image against its one copy of a: (B, r, L) @ (B, L, D)
            attended = torch.bmm(weights.view(batch, -1, locations), image.annotations).view(-1, dim)  # (B', D)
        return AttendedContext(beta * attended, alpha, beta.squeeze(1), location, heads)  # z_t = β_t Σ_i α_ti a_i

    def recur(self, embedded_word: Tensor, context: Tensor, state: DecoderState,
              alpha: Tensor | None = None) -> DecoderState:
        """The LSTM's next state h_t, c_t from [E y_{t-1}; z_t], and the coverage c_{t+1} = c_t + α_t when kept."""
        hidden, cell = self.lstm(torch.cat([embedded_word, context], dim=1), (state.hidden, state.cell))
        coverage = None if state.coverage is None else state.coverage + alpha  # c_{t+1} = c_t + α_t
        return DecoderState(hidden, cell, coverage, state.word_counts)  # h_t, c_t = LSTM([E y_{t-1}; z_t], ...)

    def deep_output(self, embedded_word: Tensor, hidden: Tensor, context: Tensor,
                    word_counts: Tensor | None = None) -> Tensor:
        """Word logits; works on (B, ·) for one step and on (B, T, ·) for all steps at once. ``word_counts``
        (B[, T], V) is n_t, how often each word has been said before step t, read with ``word_counts``."""
        combined = embedded_word + self.output_hidden(hidden) + self.output_context(context)
        logits = self.output_words(self.output_dropout(combined))  # p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))
        if self.repeat_weight is not None:
            rho = self.repeat_weight
            if self.repeat_context is not None:
                rho = rho + self.repeat_context(hidden)  # ρ_t = ρ + U h_t
            logits = logits + rho * word_counts  # ... + ρ ⊙ n_t
        return logits

    def count_words(self, words: Tensor, counts: Tensor | None) -> Tensor | None:
        """n_{t+1} = n_t + onehot(y_t): the counts after input words ``words`` (B,); None without word_counts."""
        if counts is None:
            return None
        return counts.scatter_add(1, words.unsqueeze(1), counts.new_ones(len(words), 1))

    def step(self, word: Tensor, image: EncodedImage, state: DecoderState, *, sample: bool = False) -> DecoderStep:
        """One decoding step from the previous words (B,); ``sample``: hard attention draws s_t ~ α_t."""
        embedded = self.embedding(word)
        attended = self.context(image, state, sample=sample, word=embedded)
        state = self.recur(embedded, attended.context, state, attended.alpha)
        state.word_counts = self.count_words(word, state.word_counts)
        logits = self.deep_output(embedded, state.hidden, attended.context, state.word_counts)
        return DecoderStep(logits, attended.alpha, attended.beta, state, attended.location, attended.heads)

    def forward(self, annotations: Tensor, captions: Tensor) -> DecoderOutput:
        """Teacher forcing over ``captions`` (B', T+1) = <start> w_1 .. w_n <end> <pad>..; predicts captions[:, 1:].

        ``annotations`` is (B, L, D) with B' = B·r: the r captions of an image are adjacent rows and share
        its annotations (and W_a a), which are computed and read once.
        """
        if captions.shape[0] % annotations.shape[0]:
            raise ValueError(f"{captions.shape[0]} captions for {annotations.shape[0]} images: expected a multiple")
        per_image = captions.shape[0] // annotations.shape[0]
        image = self.encode(annotations)
        state = self.initial_state(annotations, per_image)
        inputs = captions[:, :-1]
        embedded = self.embedding(inputs)  # E y_{t-1} for every step, (B, T, m)
        sample = self.attention_mode == "hard" and self.training
        if sample and torch.rand(()) < self.hard_expectation_prob:
            sample = False  # this batch trains on the expected context (the paper's mix of soft and hard)
        hiddens, contexts, alphas, betas, locations = [], [], [], [], []
        for t in range(inputs.shape[1]):
            attended = self.context(image, state, sample=sample, word=embedded[:, t])
            state = self.recur(embedded[:, t], attended.context, state, attended.alpha)
            hiddens.append(state.hidden)
            contexts.append(attended.context)
            alphas.append(attended.alpha)
            betas.append(attended.beta)
            locations.append(attended.location)
        hidden_all, context_all = torch.stack(hiddens, 1), torch.stack(contexts, 1)  # (B, T, H), (B, T, D)
        counts = None
        if self.repeat_weight is not None:  # n_t: the words input up to step t, (B, T) -> (B, T, V)
            counts = nn.functional.one_hot(inputs, len(self.repeat_weight)).to(hidden_all.dtype).cumsum(1)
        output = DecoderOutput(
            logits=self.deep_output(embedded, hidden_all, context_all, counts),  # (B, T, V), one projection for all t
            alphas=torch.stack(alphas, 1),  # (B, T, L)
            betas=torch.stack(betas, 1),  # (B, T)
        )
        if sample:
            chosen = torch.stack(locations, 1)  # (B, T)
            log_alphas = output.alphas.clamp_min(1e-12).log()
            output.location_log_probs = log_alphas.gather(2, chosen.unsqueeze(-1)).squeeze(-1)  # log p(s_t | a)
            output.location_entropy = -(output.alphas * log_alphas).sum(-1)  # H[α_t]
        return output


def compile_decoder(decoder: AttentionDecoder, mode: str | None = None, *, backend: str = "inductor") -> None:
    """Run ``decoder``'s teacher-forced loop (``forward``) and its ``step`` (beam search, sampling) through
    torch.compile in ``mode``, in place: the same parameters, state dict and numbers, with the T small steps of
    the loop fused into fewer kernels (and, in reduce-overhead, replayed as CUDA graphs). ``backend`` is
    torch.compile's (another than inductor checks the graph capture alone, as the tests do)."""
    options = {"mode": mode} if backend == "inductor" else {}
    for name in ("forward", "step"):  # the methods, compiled, on the instance
        eager = getattr(decoder, name)
        compiled = torch.compile(eager, backend=backend, **options)
        setattr(decoder, name, _eager_on_cpu(eager, compiled) if backend == "inductor" else compiled)


def _eager_on_cpu(eager: Callable, compiled: Callable) -> Callable:
    """``compiled`` on an accelerator, ``eager`` on CPU tensors: inductor's C++ code for this decoder gave NaN,
    wrong beams and heap corruption on CPUs (torch 2.14.1; scripts/compiled_decoder_check.py shows it), while its
    GPU code equals eager (checked on an H100). Said once per process."""
    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = next((value for value in args if isinstance(value, Tensor)), None)
        if first is not None and first.device.type == "cpu":
            _say_eager_on_cpu()
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)
    return call


@functools.cache
def _say_eager_on_cpu() -> None:
    logging.getLogger(__name__).warning(
        "decoder.compile: the decoder runs eager on the CPU (inductor's CPU code for it computes wrong numbers in "
        "this torch); it is compiled on GPUs")
