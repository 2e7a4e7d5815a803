"""Show, Attend and Tell as one network (Xu et al. 2015): image → annotation vectors → words with α and β.

``Captioner`` joins the encoder (§3.1.1) and the attention decoder (§3.1.2, §4) with what it needs to read
an image and speak words: its vocabulary, input size and normalisation, and its decoding settings. A
training checkpoint holds all of it, so ``Captioner.from_checkpoint`` captions on its own, without Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from vision_attn.captioning.beam_search import Hypothesis, beam_search
from vision_attn.captioning.decoder import AttentionDecoder, AttentionMode, DecoderOutput
from vision_attn.captioning.encoder import AnnotationEncoder
from vision_attn.checkpoint import CAPTIONER, build_model, read_model_checkpoint
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary, tokenize


class Decoded(NamedTuple):
    """The best caption of each image, and the annotation grid (Gh, Gw) its α rows cover; with ``all_beams``
    every beam of each image, best first."""

    hypotheses: list[Hypothesis]
    grid: tuple[int, int]
    beams: list[list[Hypothesis]] | None = None


def _adjacent_equal_groups(caption_images: Tensor, images: int) -> bool:
    """Whether captions come as r adjacent rows per image for every image (0,0,1,1,2,2...): the decoder
    then shares each image's annotations among its captions instead of copying them."""
    if len(caption_images) % images:
        return False
    expected = torch.arange(images, device=caption_images.device).repeat_interleave(len(caption_images) // images)
    return bool(torch.equal(caption_images, expected))


class Captioner(nn.Module):
    """Encoder + attention decoder, with the vocabulary, preprocessing and decoding settings of a trained model.

    ``vocabulary`` is the token list (specials first). ``image_size``, ``mean`` and ``std`` say how an image
    becomes the network input (squashed to a square, then normalised; ImageNet statistics by default).
    ``beam_size``, ``max_decode_length`` and ``length_penalty`` are the default search of ``decode``.
    """

    def __init__(
        self,
        *,
        vocabulary: Sequence[str],
        backbone: str = "small",
        encoder_width: int = 32,
        encoder_stride: int = 16,
        grid_size: int | None = None,
        pretrained_encoder: str | None = None,
        vit: dict | None = None,
        trainable_stages: int = -1,
        embed_dim: int = 512,
        hidden_dim: int = 512,
        attention_dim: int = 512,
        dropout: float = 0.5,
        attention_mode: AttentionMode = "soft",
        initial_gate: float = 0.5,
        coverage: bool = False,
        attend_with_word: bool = False,
        word_counts: bool = False,
        word_count_context: bool = False,
        attention_score: str = "additive",
        attention_heads: int = 4,
        hard_expectation_prob: float = 0.5,
        beam_size: int = 3,
        max_decode_length: int = 20,
        length_penalty: float = 0.0,
        image_size: int = 224,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        if not vocabulary:
            raise ValueError("vocabulary is empty: link it from the DataModule (the CLI does) or pass the tokens")
        self.vocab = Vocabulary(list(vocabulary))
        self.image_size = image_size
        self.mean = list(mean) if mean else list(IMAGENET_MEAN)
        self.std = list(std) if std else list(IMAGENET_STD)
        self.beam_size, self.max_decode_length, self.length_penalty = beam_size, max_decode_length, length_penalty
        self.encoder = AnnotationEncoder(backbone=backbone, width=encoder_width, grid_size=grid_size,
                                         pretrained=pretrained_encoder, trainable_stages=trainable_stages,
                                         small_stride=encoder_stride, image_size=image_size, vit=vit,
                                         channels_last=channels_last)
        self.decoder = AttentionDecoder(
            vocab_size=len(self.vocab), annotation_dim=self.encoder.annotation_dim, embed_dim=embed_dim,
            hidden_dim=hidden_dim, attention_dim=attention_dim, dropout=dropout, attention_mode=attention_mode,
            hard_expectation_prob=hard_expectation_prob, initial_gate=initial_gate, coverage=coverage,
            attend_with_word=attend_with_word, word_counts=word_counts, attention_score=attention_score,
            attention_heads=attention_heads, word_count_context=word_count_context,
        )

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        loaded: Mapping[str, Any] | None = None) -> Captioner:
        """The captioner of a ``vision-attn fit`` checkpoint, in eval mode on ``device``."""
        return build_model(cls, read_model_checkpoint(path, kind=CAPTIONER, loaded=loaded), source=path) \
            .to(device).eval()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, images: Tensor, captions: Tensor, caption_images: Tensor | None = None) -> DecoderOutput:
        """Teacher-forced outputs; caption n is of image ``caption_images[n]`` (default: of image n)."""
        annotations, _ = self.encoder(images)  # each image encoded once, however many captions it has
        return self.teacher_forced(annotations, captions, caption_images)

    def teacher_forced(self, annotations: Tensor, captions: Tensor,
                       caption_images: Tensor | None = None) -> DecoderOutput:
        """``forward`` from the images' annotation vectors (B, L, D)."""
        if caption_images is not None and not _adjacent_equal_groups(caption_images, len(annotations)):
            annotations = annotations[caption_images]  # uneven groups: a copy per caption, (B, L, D) -> (N, L, D)
        return self.decoder(annotations, captions)

    def encode_captions(self, captions: Sequence[str]) -> Tensor:
        """Captions as padded ids (N, T+1) = <start> w1..wn <end> <pad>.., at most ``max_decode_length`` words."""
        encoded = [self.vocab.encode(tokenize(caption), self.max_decode_length) for caption in captions]
        width = max(len(ids) for ids in encoded)
        return torch.tensor([ids + [PAD_ID] * (width - len(ids)) for ids in encoded], device=self.device)

    def decode(self, images: Tensor, *, beam_size: int | None = None, all_beams: bool = False) -> Decoded:
        """The best caption of each normalised image (B, 3, S, S) by beam search, with its α/β per word (and
        every beam with ``all_beams``)."""
        annotations, grid = self.encoder(images)
        beams = beam_search(
            self.decoder, annotations, start_id=START_ID, end_id=END_ID, pad_id=PAD_ID,
            beam_size=beam_size or self.beam_size, max_length=self.max_decode_length,
            length_penalty=self.length_penalty,
        )
        return Decoded([image_beams[0] for image_beams in beams], grid, beams if all_beams else None)

    def words(self, hypothesis: Hypothesis) -> list[str]:
        """The words of a decoded caption, one per α row (``<unk>`` kept)."""
        tokens = self.vocab.tokens
        return [tokens[i] for i in hypothesis.tokens]
