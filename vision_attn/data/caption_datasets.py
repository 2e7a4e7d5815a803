"""The captioning datasets and their batches, over the captioned images ``coco.py`` reads: one training item per
caption (or per image with all its captions), one evaluation item per image with its references and objects. With
a feature cache an item holds the frozen encoder part's cached output instead of pixels (``features``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vision_attn.data.coco import CaptionedImage, ObjectTargets, SceneObject, load_caption_image
from vision_attn.data.feature_cache import FeatureCache
from vision_attn.data.images import BadImageCounter, OnBadImage, load_or_skip
from vision_attn.data.vocabulary import Vocabulary, word_ids

log = logging.getLogger(__name__)


class CaptionItem(NamedTuple):
    """A training item: the image uint8 (3, S, S), its caption ids (T,) and length (grouped: (n, T) and (n,)), and
    its object targets (K, 6) where the dataset has them."""

    image: Tensor
    captions: Tensor
    lengths: Tensor
    objects: Tensor | None = None


class EvalCaptionItem(NamedTuple):
    """An evaluation item: the image uint8 (3, S, S), its id, references, objects or None, and file."""

    image: Tensor
    image_id: int | str
    references: list[str]
    objects: list[SceneObject] | None
    file_name: str = ""


class CaptionBatch(NamedTuple):
    """A training batch: images (B, 3, H, W) (or cached ``features``), captions (N, T) = <start> w1..wn <end>
    <pad>.., lengths (N,) counting <start> and <end>; caption n is of image ``caption_images[n]`` (None: image n)."""

    images: Tensor
    captions: Tensor
    lengths: Tensor
    caption_images: Tensor | None = None
    objects: Tensor | None = None  # (B, K, 6) object targets of each image, rows of class −1 pad (ObjectTargets)
    features: bool = False  # ``images`` are cached encoder features (fp16), not pixels (uint8)

    def word_ids_per_image(self) -> list[list[list[int]]]:
        """Each image's captions as word ids (no <start>, <end>, <pad>): its references, in a grouped batch."""
        images = self.caption_images.tolist() if self.caption_images is not None else range(len(self.captions))
        references: list[list[list[int]]] = [[] for _ in range(len(self.images))]
        for image, caption in zip(images, self.captions.tolist(), strict=True):
            references[image].append(word_ids(caption))
        return references


class EvalCaptionBatch(NamedTuple):
    """A validation/test batch: images (B, 3, H, W) (or cached ``features``), ids, references, objects and files."""

    images: Tensor
    image_ids: list[int | str]
    references: list[list[str]]
    objects: list[list[SceneObject] | None]
    file_names: tuple[str, ...] = ()
    features: bool = False


class _CaptionImages(Dataset):  # what both caption datasets read an image with: its file, or its cached features

    features: FeatureCache | None = None  # set by the DataModule when a frozen encoder's output is cached

    def __init__(self, *, image_size: int, on_bad_image: OnBadImage, bad_images: BadImageCounter | None) -> None:
        self.image_size, self.on_bad_image, self.bad_images = image_size, on_bad_image, bad_images

    def _image(self, image_index: int, path: Path) -> Tensor | None:
        if self.features is not None:
            return self.features[image_index]
        return load_or_skip(lambda: load_caption_image(path, self.image_size), self.on_bad_image, self.bad_images)


class CaptionTrainDataset(_CaptionImages):
    """One item per caption, or with ``group_captions`` one per image with all its captions (the encoder then sees
    each image once per epoch while the decoder still sees every caption)."""

    def __init__(self, records: list[CaptionedImage], vocab: Vocabulary, *, max_caption_length: int,
                 image_size: int, group_captions: bool = False, on_bad_image: OnBadImage = "skip",
                 bad_images: BadImageCounter | None = None, objects: ObjectTargets | None = None) -> None:
        super().__init__(image_size=image_size, on_bad_image=on_bad_image, bad_images=bad_images)
        self.group_captions = group_captions
        empty = torch.zeros(0, 6)  # an image the instances file has no object of
        self.objects = None if objects is None else [objects.per_image.get(r.image_id, empty) for r in records]
        counts = torch.tensor([len(record.captions) for record in records], dtype=torch.int64)
        self.caption_starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])  # (images + 1,)
        self.paths = [record.path for record in records]
        self.image_index = torch.repeat_interleave(torch.arange(len(records)), counts)  # (N,)
        captions, self.lengths = vocab.encode_batch([c for record in records for c in record.captions],
                                                    max_caption_length)
        if vocab.truncated:
            log.warning("%d training captions are longer than max_caption_length=%d words and were cut to it",
                        vocab.truncated, max_caption_length)
        self.captions = captions.to(torch.int32)  # (N, T), half the memory of int64 on COCO's 600k captions

    def __len__(self) -> int:
        return len(self.paths) if self.group_captions else len(self.lengths)

    def __getitem__(self, index: int) -> CaptionItem | None:
        """The item, or None for an unreadable image under the "skip" policy (the collate drops it)."""
        if self.group_captions:
            image_index, captions = index, slice(int(self.caption_starts[index]), int(self.caption_starts[index + 1]))
        else:
            image_index, captions = int(self.image_index[index]), index
        image = self._image(image_index, self.paths[image_index])
        objects = None if self.objects is None else self.objects[image_index]
        return None if image is None else CaptionItem(image, self.captions[captions], self.lengths[captions], objects)


class CaptionEvalDataset(_CaptionImages):
    """One item per image: (image uint8 (3, S, S), image id, raw reference captions, objects or None)."""

    def __init__(self, records: list[CaptionedImage], *, image_size: int, on_bad_image: OnBadImage = "skip",
                 bad_images: BadImageCounter | None = None) -> None:
        super().__init__(image_size=image_size, on_bad_image=on_bad_image, bad_images=bad_images)
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> EvalCaptionItem | None:
        record = self.records[index]
        image = self._image(index, record.path)
        return None if image is None else EvalCaptionItem(image, record.image_id, record.captions, record.objects,
                                                          str(record.path))


def collate_captions(items: list[CaptionItem | None]) -> CaptionBatch | None:
    """Stack training items, padding trimmed to the longest caption; skipped (None) items are left out."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images, captions, lengths, objects = zip(*items, strict=True)
    grouped = captions[0].ndim == 2  # every caption of each image, (n, T) per item
    counts = torch.tensor([len(group) for group in lengths]) if grouped else None
    join = torch.cat if grouped else torch.stack
    lengths = join(lengths)  # (N,)
    captions = join(captions)[:, : int(lengths.max())].long()  # (N, T)
    caption_images = torch.repeat_interleave(torch.arange(len(images)), counts) if grouped else None  # (N,)
    return CaptionBatch(torch.stack(images), captions, lengths, caption_images,
                        None if objects[0] is None else pad_objects(objects), features=images[0].dtype != torch.uint8)


def pad_objects(objects: Sequence[Tensor]) -> Tensor:
    """Each image's object targets (K_b, 6) as one (B, max K_b, 6) tensor, padded with rows of class −1."""
    padded = torch.full((len(objects), max(1, max(len(rows) for rows in objects)), 6), -1.0)
    for index, rows in enumerate(objects):
        padded[index, : len(rows)] = rows
    return padded


def collate_references(items: list[EvalCaptionItem | None]) -> EvalCaptionBatch | None:
    """Stack evaluation items (ids, references and objects as lists); skipped (None) items are left out."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images, image_ids, references, objects, file_names = zip(*items, strict=True)
    return EvalCaptionBatch(torch.stack(images), list(image_ids), list(references), list(objects), file_names,
                            features=images[0].dtype != torch.uint8)
