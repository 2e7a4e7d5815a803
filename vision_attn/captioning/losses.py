"""Training objectives of "Show, Attend and Tell" (Xu et al. 2015, eqs. 9-12 and 14)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.boxes import box_cell_weights
from vision_attn.data.vocabulary import PAD_ID


class TokenLikelihood(NamedTuple):
    """Teacher-forced likelihood of a batch of captions: ``loss``, the mean −log p(y_t) over real tokens (the
    objective); ``per_caption`` −log p(y | a) (B,); ``mask`` (B, T), 1 on real tokens (<end> included); and
    ``tokens``, their count (at least 1)."""

    loss: Tensor
    per_caption: Tensor
    mask: Tensor
    tokens: Tensor


def token_likelihood(logits: Tensor, captions: Tensor) -> TokenLikelihood:
    """The likelihood terms of ``logits`` (B, T, V) predicting ``captions[:, 1:]`` of (B, T+1) padded ids."""
    targets = captions[:, 1:]
    mask = (targets != PAD_ID).to(logits.dtype)  # (B, T): real tokens, <end> included
    tokens = mask.sum().clamp_min(1)
    nll = caption_nll(logits, targets, mask)  # (B,)
    return TokenLikelihood(nll.sum() / tokens, nll, mask, tokens)


def caption_nll(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Per-caption negative log-likelihood −log p(y | a), (B,), over real tokens only (``mask`` (B, T))."""
    token_nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, V, T) -> (B, T)
    return (token_nll * mask).sum(dim=1)


def doubly_stochastic_penalty(alphas: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (1 − Σ_t α_ti)², (B,): pushes every location to receive attention over the caption (eq. 14)."""
    return attention_shortfall(alphas, mask).sum(dim=1)


def attention_shortfall(alphas: Tensor, mask: Tensor) -> Tensor:
    """(1 − Σ_t α_ti)² per caption and location, (B, L), summing α over real steps only (``mask`` (B, T))."""
    attention_per_location = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # Σ_t α_ti, (B, L)
    return (1.0 - attention_per_location) ** 2


LossNormalisation = Literal["paper", "token"]
LOSS_NORMALISATIONS = ("paper", "token")


class LikelihoodObjective(NamedTuple):
    """The likelihood term, the doubly stochastic penalty (before λ; None when λ = 0), and ``caption_scale``, what
    a sum over the batch's captions is divided by at this normalisation (the captions, or the tokens)."""

    nll: Tensor
    penalty: Tensor | None
    caption_scale: Tensor | int


def check_loss_normalisation(normalisation: str) -> None:
    if normalisation not in LOSS_NORMALISATIONS:
        raise ValueError(f"loss_normalisation must be one of {', '.join(LOSS_NORMALISATIONS)}, got {normalisation!r}")


def likelihood_objective(likelihood: TokenLikelihood, alphas: Tensor, doubly_stochastic_weight: float,
                         normalisation: LossNormalisation = "paper") -> LikelihoodObjective:
    """The negative log-likelihood term and the doubly stochastic penalty (eq. 14, before λ; None when λ = 0).

    ``paper``, the scale of the authors' code (arctic-captions, ``capgen.py``), where λ is ``alpha_c``::

        cost = (masked_cost).sum(0)       # -log p(y_t) summed over each caption's steps
        cost = cost.mean()                # ... and averaged over the captions of the batch
        alpha_reg = alpha_c * ((1.-alphas.sum(0))**2).sum(0).mean()   # alphas: (T, B, L)

    i.e. NLL = (1/B) Σ_b Σ_t −log p(y_bt) and penalty = (1/L) Σ_i Σ_b (1 − Σ_t α_bti)²: summed over the
    batch's captions and averaged over the L locations, so λ weighs it as much per caption at any L (and, as
    there, in proportion to the per-device batch). ``token``, this project's first normalisation: NLL averaged
    over the batch's tokens, penalty (1/B) Σ_b Σ_i (1 − Σ_t α_bti)², which at L = 196 and ~12 words is ~170 per
    caption against an NLL of ~2.5 per token.
    """
    check_loss_normalisation(normalisation)
    paper = normalisation == "paper"
    scale = len(likelihood.per_caption) if paper else likelihood.tokens
    nll = likelihood.per_caption.mean() if paper else likelihood.loss
    if not doubly_stochastic_weight:
        return LikelihoodObjective(nll, None, scale)
    shortfall = attention_shortfall(alphas, likelihood.mask)  # (B, L)
    penalty = shortfall.mean(dim=1).sum() if paper else shortfall.sum(dim=1).mean()
    return LikelihoodObjective(nll, penalty, scale)


def reinforce_surrogate(
    sequence_log_likelihood: Tensor,
    location_log_probs: Tensor,
    location_entropy: Tensor,
    mask: Tensor,
    *,
    baseline: float,
    reinforce_weight: float = 1.0,
    entropy_weight: float = 0.01,
) -> Tensor:
    """Hard attention's REINFORCE surrogate (eq. 12), (B,); its gradient is the paper's estimate.

    log p(y | s, a) is the reward for the sampled locations s; ``baseline`` is its moving average b, and
    the entropy bonus λ_e H[s] keeps the sampling exploratory.
    """
    advantage = (sequence_log_likelihood - baseline).detach()  # (log p(y|s,a) − b)
    location_log_likelihood = (location_log_probs * mask).sum(dim=1)  # Σ_t log p(s_t | a)
    entropy = (location_entropy * mask).sum(dim=1)
    return reinforce_weight * advantage * location_log_likelihood + entropy_weight * entropy


def concept_targets(captions: Tensor, caption_images: Tensor | None, images: int, vocab_size: int,
                    ignore: Tensor) -> Tensor:
    """The words of each image's captions as a multi-hot (B, V): 1 where some caption of the image has the
    word. ``captions`` (N, T) are ids, caption n of image ``caption_images[n]`` (default n); the ids in
    ``ignore`` (<pad>, <start>, <end>) are never targets."""
    rows = caption_images if caption_images is not None else torch.arange(len(captions), device=captions.device)
    targets = captions.new_zeros(images, vocab_size, dtype=torch.float32)
    targets[rows.unsqueeze(1).expand_as(captions), captions] = 1.0
    targets[:, ignore] = 0.0
    return targets


def concept_loss(location_logits: Tensor, targets: Tensor, ignore: Tensor) -> Tensor:
    """Multiple-instance learning of the caption words from the image's locations (Fang et al. 2015): with
    s_iw the score of word w at location i, p_w = 1 − Π_i (1 − σ(s_iw)) (noisy-OR), and the loss is the binary
    cross-entropy of p_w against whether some caption has w, averaged over the words and images.

    ``location_logits`` is (B, L, V). Some location must light up for every word that is there, and none for
    the words that are not, so the annotation vectors learn to say what is where.
    """
    # −log Π_i (1 − σ(s_iw)) = −log(1 − p_w), in fp32 under autocast too (a sum of L terms, then log(1 − e^−x))
    none_total = F.softplus(location_logits.float()).sum(dim=1)
    log_absent = -none_total
    log_present = torch.log(-torch.expm1(-none_total.clamp_min(1e-6)))  # log p_w
    per_word = -(targets * log_present + (1 - targets) * log_absent)  # (B, V)
    keep = torch.ones(per_word.shape[1], dtype=torch.bool, device=per_word.device)
    keep[ignore] = False
    return per_word[:, keep].mean()


class ObjectLoss(NamedTuple):
    """The object loss (its class term plus its colour term) and the class accuracy, over the batch's objects."""

    loss: Tensor
    accuracy: Tensor
    objects: int


def object_loss(annotations: Tensor, grid: tuple[int, int], objects: Tensor, class_head: torch.nn.Module,
                colour_head: torch.nn.Module | None = None) -> ObjectLoss:
    """Each object's class (and colour) from the annotation vectors under its box: with w_ki the share of object
    k's box in cell i, a_k = Σ_i w_ki a_i, and the loss is the cross-entropy of softmax(W a_k + b) against its
    class, plus that of its colour where it has one (as an object detector's region features are trained,
    Anderson et al. 2018, on the boxes the training split holds).

    ``annotations`` (B, L, D) over ``grid``; ``objects`` (B, K, 6) rows [class, colour, x0, y0, x1, y1] with
    class −1 for padding and colour −1 where unknown (``data.coco.ObjectTargets``)."""
    classes, colours = objects[..., 0].long(), objects[..., 1].long()  # (B, K)
    present = classes >= 0
    if not present.any():
        zero = annotations.sum() * 0.0
        return ObjectLoss(zero, zero.detach(), 0)
    weights = box_cell_weights(objects[..., 2:].to(annotations.dtype), grid)  # (B, K, L)
    pooled = torch.bmm(weights, annotations)[present]  # a_k = Σ_i w_ki a_i, (B, K, D) -> (N, D)
    class_logits = class_head(pooled)
    loss = F.cross_entropy(class_logits.float(), classes[present])
    accuracy = (class_logits.argmax(-1) == classes[present]).float().mean()
    coloured = colours[present] >= 0
    if colour_head is not None and coloured.any():
        loss = loss + F.cross_entropy(colour_head(pooled[coloured]).float(), colours[present][coloured])
    return ObjectLoss(loss, accuracy, int(present.sum()))


def grounding_targets(tokens: Tensor, objects: Tensor, grid: tuple[int, int], class_word_ids: Tensor,
                      colour_word_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Where each word that names an object should look: its object's box as cell weights. A word names object k
    when it is k's class word, or k's colour word just before that class word ("a *red* *sneaker*").

    ``tokens`` (N, T) are the words emitted at each step (``captions[:, 1:]`` in teacher forcing); ``objects``
    (N, K, 6) the object rows of each caption's image (``data.coco.ObjectTargets``, class −1 for padding);
    ``class_word_ids`` (C,) the vocabulary id of each object class's word (−1: not one word of the vocabulary);
    ``colour_word_ids`` likewise per colour. Returns the target weights (N, T, L) and the mask of the words that
    name an object (N, T)."""
    classes, colours = objects[..., 0].long(), objects[..., 1].long()  # (N, K)
    present = classes >= 0
    object_words = torch.where(present, class_word_ids[classes.clamp_min(0)], -1)  # (N, K); −1 never matches
    named = (tokens.unsqueeze(-1) == object_words.unsqueeze(1)) & (object_words.unsqueeze(1) >= 0)  # (N, T, K)
    if colour_word_ids is not None and len(colour_word_ids):
        colour_words = torch.where(present & (colours >= 0), colour_word_ids[colours.clamp_min(0)], -1)  # (N, K)
        before = torch.zeros_like(named)
        before[:, :-1] = named[:, 1:]  # the step before a class word of object k ...
        said = (tokens.unsqueeze(-1) == colour_words.unsqueeze(1)) & (colour_words.unsqueeze(1) >= 0)
        named = named | (before & said)  # ... that says k's colour
    weights = box_cell_weights(objects[..., 2:], grid) * present.unsqueeze(-1)  # (N, K, L)
    target = torch.bmm(named.to(weights.dtype), weights)  # (N, T, L)
    mask = named.any(-1)
    return target / target.sum(-1, keepdim=True).clamp_min(1e-12), mask


def grounding_loss(alphas: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Supervised attention (Liu et al. 2017, "Attention correctness"): at each step whose word names an object,
    the cross-entropy −Σ_i w_ti log α_ti of α_t against that object's box weights w_t, averaged over those steps.
    The attention then covers the object it names, so the context z_t reads the whole object."""
    steps = mask.sum()
    if not steps:
        return alphas.sum() * 0.0
    cross_entropy = -(target * alphas.float().clamp_min(1e-12).log()).sum(-1)  # (N, T)
    return (cross_entropy * mask).sum() / steps


def excess_words(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> int:
    """How often the candidate repeats a word more than any reference does: Σ_w max(0, c(w) − max(1, max_r
    c_r(w))). A word used once never counts. "a coat next to a bag and a bag" against references with two "a"s
    and one "bag" each counts 2 (the third "a" and the second "bag")."""
    most: Counter = Counter()
    for reference in references:
        for word, count in Counter(reference).items():
            most[word] = max(most[word], count)
    return sum(max(0, count - max(1, most[word])) for word, count in Counter(candidate).items())


def consensus_recall(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
    """The fraction of the consensus words, those every reference uses, that the candidate uses: |C ∩ w| / |C|,
    C = ∩_r set(r). On Fashion scenes C holds each object's colour and class word (every caption names them
    all); on COCO, the words all five annotators chose. 1.0 when the references share no word."""
    if not references:
        return 1.0
    consensus = set(references[0]).intersection(*map(set, references[1:]))
    return len(consensus.intersection(candidate)) / len(consensus) if consensus else 1.0


def self_critical_loss(log_probs: Tensor, mask: Tensor, rewards: Tensor, per_image: int) -> Tensor:
    """Self-critical sequence training (Rennie et al. 2017), per sampled caption (N,); its gradient is
    −(r(w^s) − b) ∇ log p(w^s | a), REINFORCE on the caption metric.

    ``rewards`` (N,) score ``per_image`` adjacent samples of each image. The baseline b of a sample is the
    mean reward of its image's other samples (Luo 2020's variant of the greedy caption's reward): no extra
    decoding pass, and a sample is pushed up only when it beats its siblings.
    """
    if per_image < 2:
        raise ValueError(f"the self-critical baseline needs at least 2 samples per image, got {per_image}")
    grouped = rewards.detach().view(-1, per_image)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (per_image - 1)  # mean of the other samples
    advantage = (grouped - baseline).view(-1)
    return -advantage * (log_probs * mask).sum(dim=1)


def check_self_critical_options(from_epoch: int | None, samples: int, from_time: float | None = None) -> None:
    """Refuse self-critical settings that cannot train, at start-up rather than at the first self-critical step."""
    if from_time is not None and not 0 <= from_time < 1:
        raise ValueError(f"self_critical_from_time is a fraction of the time budget, from 0 to below 1, got "
                         f"{from_time}")
    if from_epoch is None and from_time is None:
        return
    if from_epoch is not None and from_epoch < 0:
        raise ValueError(f"self_critical_from_epoch must be an epoch number (0 or more), got {from_epoch}")
    if samples < 2:
        raise ValueError(f"self_critical_samples must be at least 2 (the baseline is the mean reward of an image's "
                         f"other samples), got {samples}")
