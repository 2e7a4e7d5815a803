"""Show, Attend and Tell as one network (Xu et al. 2015): image → annotation vectors → words with α and β.

``Captioner`` joins the encoder (§3.1.1) and the attention decoder (§3.1.2, §4) with its vocabulary, input size,
normalisation and decoding settings, all in a training checkpoint: ``from_checkpoint`` captions without Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from vision_attn.captioning.beam_search import Hypothesis, beam_search
from vision_attn.captioning.decoder import AttentionDecoder, DecoderOutput
from vision_attn.captioning.encoder import AnnotationEncoder
from vision_attn.captioning.extensions import PROCESSORS
from vision_attn.captioning.options import DecoderOptions, DecodingOptions, EncoderOptions
from vision_attn.captioning.seams import built_one
from vision_attn.checkpoint import CAPTIONER, load_weights, read_model_checkpoint
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary, tokenize
from vision_attn.errors import CheckpointError
from vision_attn.option_groups import ImageFormat


class Decoded(NamedTuple):
    """The best caption of each image, the grid (Gh, Gw) its α rows cover, and with ``all_beams`` every beam."""

    hypotheses: list[Hypothesis]
    grid: tuple[int, int]
    beams: list[list[Hypothesis]] | None = None


def _adjacent_equal_groups(caption_images: Tensor, images: int) -> bool:
    # whether captions come as r adjacent rows per image (0,0,1,1,2,2...): the decoder then shares the annotations
    if len(caption_images) % images:
        return False
    expected = torch.arange(images, device=caption_images.device).repeat_interleave(len(caption_images) // images)
    return bool(torch.equal(caption_images, expected))


class Captioner(nn.Module):
    """Encoder + attention decoder, with the vocabulary (specials first), the ``ImageFormat`` of its input (squashed
    to a square, normalised; ImageNet's statistics by default) and the groups of ``options.py``; ``decoding`` is
    ``decode``'s search, with its ``processors`` in order."""

    def __init__(self, *, vocabulary: Sequence[str], image: ImageFormat | Mapping[str, Any] | None = None,
                 encoder: EncoderOptions | Mapping[str, Any] | None = None,
                 decoder: DecoderOptions | Mapping[str, Any] | None = None,
                 decoding: DecodingOptions | Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if not vocabulary:
            raise ValueError("vocabulary is empty: link it from the DataModule (the CLI does) or pass the tokens")
        image, self.decoding = ImageFormat.coerce(image), DecodingOptions.coerce(decoding)
        self.vocab = Vocabulary(list(vocabulary))
        self.image_size = image.size
        self.mean, self.std = image.normalisation(IMAGENET_MEAN, IMAGENET_STD)
        self.encoder = AnnotationEncoder(encoder, image_size=image.size)
        self._check_pretraining_normalisation()
        self.decoder = AttentionDecoder(vocab_size=len(self.vocab), annotation_dim=self.encoder.annotation_dim,
                                        options=decoder)
        self.processors = nn.ModuleList(built_one(e, PROCESSORS, vocab=self.vocab) for e in self.decoding.processors)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        loaded: Mapping[str, Any] | None = None) -> Captioner:
        """The captioner of a ``vision-attn fit`` checkpoint, in eval mode on ``device``."""
        saved = read_model_checkpoint(path, kind=CAPTIONER, loaded=loaded)
        try:
            captioner = cls(**{key: saved.hparams.get(key) for key in ("image", "encoder", "decoder", "decoding")},
                            vocabulary=saved.hparams.get("vocabulary") or [])
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: its hyper-parameters do not fit a captioner ({error})") from None
        return load_weights(captioner, saved.state_dict, source=path).to(device).eval()

    def _check_pretraining_normalisation(self) -> None:
        """Refuse, in one line, an encoder pretrained on images normalised otherwise than this captioner's."""
        learnt = self.encoder.pretrained_with.get("image") or {}
        for name, ours in (("mean", self.mean), ("std", self.std)):
            theirs = learnt.get(name)
            if theirs is not None and not torch.allclose(torch.tensor(theirs, dtype=torch.float64),
                                                         torch.tensor(ours, dtype=torch.float64)):
                raise CheckpointError(f"{self.encoder.options.pretrained}: the encoder was pretrained on images "
                                      f"normalised with {name} {list(theirs)}, but this captioner's {name} is "
                                      f"{list(ours)}")

    @property
    def image_format(self) -> ImageFormat:
        """How an image becomes this captioner's input: its size and normalisation, three channels."""
        return ImageFormat(size=self.image_size, channels=3, mean=list(self.mean), std=list(self.std))

    @property
    def device(self) -> torch.device:
        """The device the captioner's weights are on."""
        return next(self.parameters()).device

    def forward(self, images: Tensor, captions: Tensor, caption_images: Tensor | None = None, *,
                features: bool = False) -> DecoderOutput:
        """Teacher-forced outputs, caption n of image ``caption_images[n]`` (default n); ``features``: the images are
        the encoder's frozen part's output (a feature cache)."""
        annotations, _ = self.encoder.encode(images, features=features)  # each image once, however many captions
        return self.teacher_forced(annotations, captions, caption_images)

    def teacher_forced(self, annotations: Tensor, captions: Tensor,
                       caption_images: Tensor | None = None) -> DecoderOutput:
        """``forward`` from the images' annotation vectors (B, L, D)."""
        if caption_images is not None and not _adjacent_equal_groups(caption_images, len(annotations)):
            annotations = annotations[caption_images]  # uneven groups: a copy per caption, (B, L, D) -> (N, L, D)
        return self.decoder(annotations, captions)

    def encode_captions(self, captions: Sequence[str]) -> Tensor:
        """Captions as padded ids (N, T+1) = <start> w1..wn <end> <pad>.., at most ``decoding.max_length`` words."""
        encoded = [self.vocab.encode(tokenize(caption), self.decoding.max_length) for caption in captions]
        width = max(len(ids) for ids in encoded)
        return torch.tensor([ids + [PAD_ID] * (width - len(ids)) for ids in encoded], device=self.device)

    def decode(self, images: Tensor, *, beam_size: int | None = None, all_beams: bool = False,
               features: bool = False) -> Decoded:
        """Beam search's best caption of each normalised image (B, 3, S, S) with α/β per word (``all_beams``: every
        beam); ``features``: the images are the encoder's frozen part's output."""
        annotations, grid = self.encoder.encode(images, features=features)
        beams = beam_search(self.decoder, annotations, start_id=START_ID, end_id=END_ID, pad_id=PAD_ID,
                            beam_size=beam_size or self.decoding.beam_size, max_length=self.decoding.max_length,
                            length_penalty=self.decoding.length_penalty, processors=list(self.processors))
        return Decoded([image_beams[0] for image_beams in beams], grid, beams if all_beams else None)

    def words(self, hypothesis: Hypothesis) -> list[str]:
        """The words of a decoded caption, one per α row (``<unk>`` kept)."""
        tokens = self.vocab.tokens  # a copy of the list: taken once
        return [tokens[i] for i in hypothesis.tokens]
