"""Beam search, greedy decoding and sampling for the attention decoder: the B images' k beams advance as one (B·k)
batch, each beam keeping its words, α and β, so a caption comes back with the attention behind each word."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.seams import DecodingProcessor, SearchStep


@dataclass
class Hypothesis:
    """A decoded caption: word ids without <start>/<end>, α (T, L), β (T,) and each head's α (T, K, L) per word;
    ``log_prob``, the model's (with <end>); ``score``, the search's (length-normalised, after the processors)."""

    tokens: list[int]
    alphas: Tensor
    betas: Tensor
    log_prob: float
    score: float
    head_alphas: Tensor | None = None


@torch.no_grad()
def beam_search(decoder: AttentionDecoder, annotations: Tensor, *, start_id: int, end_id: int, pad_id: int = 0,
                beam_size: int = 5, max_length: int = 20, min_length: int = 0, length_penalty: float = 0.0,
                processors: Sequence[DecodingProcessor] = ()) -> list[list[Hypothesis]]:
    """The ``beam_size`` best captions of each image of ``annotations`` (B, L, D), best first (size 1: greedy).

    A caption is at most ``max_length`` words, then <end>, and at least ``min_length`` (the benchmark sets it to
    ``max_length``: every search the same steps); <start> and <pad> are never emitted (<unk> may be). A score is
    the summed log-probability / length^``length_penalty`` (1: the mean per word, <end> counted), after the
    ``processors`` changed each step's log-probabilities in order. As in HF transformers, a caption that ends
    goes to a pool of the k best finished ones, which live beams that turn out worse never push out, and k beams
    stay live; without a length penalty the search stops once no live beam can beat the pool (scores only fall).
    Captions without a finite score are left out, but for the best when none has one (NaN scores): the caller
    refuses it.
    """
    if not 0 <= min_length <= max_length:
        raise ValueError(f"min_length must be between 0 and max_length ({max_length}), got {min_length}")
    batch, locations, _ = annotations.shape
    k, device = beam_size, annotations.device
    # The k beams of an image attend its one copy of a and W_a a (never expanded k times, never reordered);
    # only the recurrent state has a row per beam: (B, H) -> (B·k, H)
    image = decoder.encode(annotations)
    state = decoder.initial_state(annotations, per_image=k)
    words = torch.full((batch * k,), start_id, dtype=torch.long, device=device)
    # Only the first beam of each image is live at t = 0, so the k beams do not start as k copies.
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    model_log_probs = scores.clone()  # the model's own log-probabilities: the scores less the processors' changes
    # Each live beam's words, α, β (and each head's α, with a multihead score) so far: (B, k, t, ...)
    live = {"tokens": torch.zeros(batch, k, 0, dtype=torch.long, device=device),
            "alphas": torch.zeros(batch, k, 0, locations, device=device),
            "betas": torch.zeros(batch, k, 0, device=device)}
    # The pool of finished captions, best first: scores (length-normalised), the model's log-probabilities,
    # lengths (<end> included) and histories, padded to the live beams' length
    pool_scores = torch.full((batch, k), float("-inf"), device=device)
    pool_log_probs, pool_lengths = pool_scores.clone(), torch.ones(batch, k, device=device)
    pool = dict(live)
    images = torch.arange(batch, device=device)[:, None]  # with a (B, n) index, picks n beams of each image
    for t in range(max_length + 1):  # up to max_length words, then <end>
        logits, alpha, beta, new_state, _, heads = decoder.step(words, image, state)
        log_probs = logits.float().log_softmax(dim=-1)  # (B·k, V); fp32 under autocast too
        vocab = log_probs.shape[-1]
        log_probs[:, [start_id, pad_id]] = float("-inf")
        if t < min_length:
            log_probs[:, end_id] = float("-inf")
        if t == max_length:  # only <end> is left
            log_probs[:, torch.arange(vocab, device=device) != end_id] = float("-inf")
        step_scores = log_probs
        step = SearchStep(t, words, alpha, max_length, live["tokens"].reshape(batch * k, t),
                          live["alphas"].reshape(batch * k, t, locations))
        for processor in processors:
            step_scores = processor(step_scores, step)
        candidates = (scores.unsqueeze(-1) + step_scores.view(batch, k, vocab)).view(batch, k * vocab)
        top_scores, flat = candidates.topk(min(2 * k, k * vocab), dim=-1)  # (B, 2k): at most k end, k stay live
        parent, token = flat // vocab, flat % vocab
        top_log_probs = model_log_probs.gather(1, parent) + log_probs.view(batch, k * vocab).gather(1, flat)
        rows = (images * k + parent).view(-1)  # each candidate's parent beam in (B·k)
        step_history = {"tokens": token.reshape(-1), "alphas": alpha[rows], "betas": beta[rows]}
        if heads is not None:
            step_history["heads"] = heads[rows]
            if t == 0:
                live["heads"] = pool["heads"] = heads.new_zeros(batch, k, 0, *heads.shape[1:])
        grown = {name: torch.cat([live[name][images, parent], new.view(*parent.shape, 1, *new.shape[1:])], 2)
                 for name, new in step_history.items()}
        # The pool keeps its k best of the captions finished before and those that end now
        ends = token == end_id
        normalised = top_scores / float(t + 1) ** length_penalty if length_penalty else top_scores
        pool_scores, chosen = torch.cat([pool_scores, normalised.masked_fill(~ends, float("-inf"))], 1).topk(k, dim=1)
        pool = {name: torch.cat([torch.cat([pool[name], torch.zeros_like(history[:, :k, -1:])], 2), history], 1)
                [images, chosen] for name, history in grown.items()}
        pool_log_probs = torch.cat([pool_log_probs, top_log_probs], 1).gather(1, chosen)
        pool_lengths = torch.cat([pool_lengths, torch.full_like(top_scores, t + 1)], 1).gather(1, chosen)
        scores, kept = top_scores.masked_fill(ends, float("-inf")).topk(k, dim=1)  # live: the k best not ended
        live = {name: history[images, kept] for name, history in grown.items()}
        model_log_probs = top_log_probs.gather(1, kept)
        state = new_state.select((images * k + parent.gather(1, kept)).view(-1))
        words = token.gather(1, kept).view(-1)
        if (scores[:, 0] == float("-inf")).all() or (not length_penalty and (pool_scores[:, -1] >= scores[:, 0]).all()):
            break
    results: list[list[Hypothesis]] = []
    for b in range(batch):
        beams = []
        for j in range(k):
            keep = int(pool_lengths[b, j].item()) - 1  # every pooled caption ends on <end>: its words, α and β
            beams.append(Hypothesis(pool["tokens"][b, j, :keep].tolist(), pool["alphas"][b, j, :keep].cpu(),
                                    pool["betas"][b, j, :keep].cpu(),
                                    float(pool_log_probs[b, j]), float(pool_scores[b, j]),
                                    pool["heads"][b, j, :keep].cpu() if "heads" in pool else None))
        results.append([beam for beam in beams if math.isfinite(beam.score)] or beams[:1])
    return results


def greedy_decode(decoder: AttentionDecoder, annotations: Tensor, *, start_id: int, end_id: int, pad_id: int = 0,
                  max_length: int = 20) -> list[Hypothesis]:
    """The single most likely next word at each step (beam size 1)."""
    beams = beam_search(decoder, annotations, start_id=start_id, end_id=end_id, pad_id=pad_id, beam_size=1,
                        max_length=max_length)
    return [image_beams[0] for image_beams in beams]


@dataclass
class SampledCaptions:
    """Captions drawn from the decoder, with what self-critical training needs to score and learn from them."""

    tokens: Tensor  # (N, T) word ids, <end> included, <pad> after it
    log_probs: Tensor  # (N, T) log p(y_t | y_<t, a) of each drawn word; differentiable
    mask: Tensor  # (N, T) 1 for the words and <end>, 0 for the padding after <end>
    alphas: Tensor | None = None  # (N, T, L) α_t of each drawn word; differentiable


def sample_captions(decoder: AttentionDecoder, annotations: Tensor, *, per_image: int, start_id: int, end_id: int,
                    pad_id: int = 0, max_length: int = 20,
                    processors: Sequence[DecodingProcessor] = ()) -> SampledCaptions:
    """``per_image`` captions per image (rows adjacent, sharing its annotations) drawn from p(y_t | y_<t, a), keeping
    the autograd graph that REINFORCE differentiates: at most ``max_length`` words, then <end>, never <start> or
    <pad>, each step's logits changed first by the ``processors`` that apply to sampling. Hard attention draws
    s_t ~ Multinoulli(α_t) too, and a step's log-probability is the pair's, log p(s_t | a) + log p(y_t | s_t, ...):
    the reward trains where it looked as well as what it said.
    """
    image = decoder.encode(annotations)
    state = decoder.initial_state(annotations, per_image)
    hard = decoder.attention_mode == "hard"
    rows = annotations.shape[0] * per_image
    words = torch.full((rows,), start_id, dtype=torch.long, device=annotations.device)
    finished = torch.zeros(rows, dtype=torch.bool, device=annotations.device)
    tokens, log_probs, masks, alphas = [], [], [], []
    never = torch.tensor([start_id, pad_id], device=annotations.device)
    for t in range(max_length + 1):
        logits, alpha, _, state, location, _ = decoder.step(words, image, state, sample=hard)
        if t == max_length:  # the last step can only end the caption
            logits = torch.full_like(logits, float("-inf"))
            logits[:, end_id] = 0.0
        else:
            step = SearchStep(t, words, alpha, max_length)
            for processor in processors:
                if processor.sampling:
                    logits = processor(logits, step)
        step_log_probs = logits.float().index_fill(1, never, float("-inf")).log_softmax(dim=-1)  # the policy drawn from
        drawn = torch.multinomial(step_log_probs.detach().exp(), 1).squeeze(1)
        words = drawn.masked_fill(finished, pad_id)
        masks.append(~finished)
        tokens.append(words)
        step_log_prob = step_log_probs.gather(1, drawn.unsqueeze(1)).squeeze(1)
        if location is not None:  # + log p(s_t | a)
            step_log_prob = step_log_prob + alpha.gather(1, location.unsqueeze(1)).squeeze(1).clamp_min(1e-12).log()
        log_probs.append(step_log_prob)
        alphas.append(alpha)
        finished = finished | (drawn == end_id)
        if finished.all():
            break
    mask = torch.stack(masks, 1).to(annotations.dtype)
    return SampledCaptions(torch.stack(tokens, 1), torch.stack(log_probs, 1) * mask, mask, torch.stack(alphas, 1))
