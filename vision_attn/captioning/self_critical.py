"""Self-critical sequence training (Rennie et al. 2017): REINFORCE on the caption metric. Each of an image's
``samples`` captions is rewarded by its CIDEr-D against the references plus the ``self_critical.rewards`` terms,
less the mean reward of its siblings. ``SelfCriticalOptions`` (``options.py``) sets it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from vision_attn.captioning.beam_search import sample_captions
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.extensions import REWARDS
from vision_attn.captioning.options import SelfCriticalOptions
from vision_attn.captioning.seams import DecodingProcessor, built
from vision_attn.data.caption_datasets import CaptionBatch
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary, tokenize, word_ids
from vision_attn.metrics import CiderD


def self_critical_loss(log_probs: Tensor, mask: Tensor, rewards: Tensor, per_image: int) -> Tensor:
    """The self-critical loss per sampled caption (N,), whose gradient is −(r(w^s) − b) ∇ log p(w^s | a): ``rewards``
    (N,) of ``per_image`` adjacent samples per image, b the mean reward of the image's other samples (Luo 2020):
    no extra decoding pass, and a sample rises only when it beats its siblings."""
    if per_image < 2:
        raise ValueError(f"the self-critical baseline needs at least 2 samples per image, got {per_image}")
    grouped = rewards.detach().view(-1, per_image)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (per_image - 1)  # mean of the other samples
    advantage = (grouped - baseline).view(-1)
    return -advantage * (log_probs * mask).sum(dim=1)


class SampledTerms(NamedTuple):
    """A self-critical step: the loss (per token), the rewards (N,), and the samples' tokens (N, T), α (N, T, L) and
    images (N,), for the auxiliary terms."""

    loss: Tensor
    rewards: Tensor
    tokens: Tensor
    alphas: Tensor
    sample_images: Tensor


class SelfCriticalObjective:
    """The self-critical loss of a batch of grouped captions, once ``use_references`` gave it CIDEr-D's references."""

    def __init__(self, options: SelfCriticalOptions, vocab: Vocabulary, max_length: int) -> None:
        self.options, self.vocab, self.max_length = options, vocab, max_length
        self.terms = list(built(options.rewards, REWARDS).values())
        self.reward: CiderD | None = None

    def use_references(self, references: Sequence[Sequence[str]]) -> None:
        """Set the CIDEr-D reward, on word ids (at most ``max_length`` words), with the document frequencies of the
        training split's captions, one list per image."""
        self.reward = CiderD([[word_ids(self.vocab.encode(tokenize(caption), self.max_length)) for caption in captions]
                              for captions in references])

    def rewards(self, candidates: list[list[int]], references: list[list[list[int]]]) -> list[float]:
        """r = CIDEr-D + Σ_k weight_k × term_k, over the reward terms in their listed order."""
        scores = self.reward(candidates, references)
        for term in self.terms:
            if term.options.weight:
                scores = [score + term.options.weight * term.value(candidate, refs)
                          for score, candidate, refs in zip(scores, candidates, references, strict=True)]
        return scores

    def __call__(self, decoder: AttentionDecoder, annotations: Tensor, batch: CaptionBatch,
                 processors: Sequence[DecodingProcessor] = ()) -> SampledTerms:
        """The loss per sampled token of n captions per image (changed by the ``processors`` that apply to sampling),
        rewarded against the image's references in the batch and compared with their siblings' mean."""
        if batch.caption_images is None:
            raise ValueError("self-critical training needs every reference of an image in its batch: set the "
                             "DataModule's group_captions: true")
        if self.reward is None:
            raise RuntimeError("self-critical training needs the training references first (use_references)")
        per_image = self.options.samples
        sampled = sample_captions(decoder, annotations, per_image=per_image, start_id=START_ID, end_id=END_ID,
                                  pad_id=PAD_ID, max_length=self.max_length, processors=processors)
        references = batch.word_ids_per_image()
        candidates = [word_ids(caption) for caption in sampled.tokens.tolist()]
        scores = self.rewards(candidates, [references[n // per_image] for n in range(len(candidates))])
        rewards = torch.tensor(scores, dtype=sampled.log_probs.dtype, device=sampled.log_probs.device)
        loss = self_critical_loss(sampled.log_probs, sampled.mask, rewards, per_image).sum()
        sample_images = torch.arange(len(annotations), device=annotations.device).repeat_interleave(per_image)
        return SampledTerms(loss / sampled.mask.sum().clamp_min(1), rewards, sampled.tokens, sampled.alphas,
                            sample_images)
