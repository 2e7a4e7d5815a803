"""Captioning data: COCO-format caption files (MS COCO itself, or the generated Fashion scenes) and the
Karpathy splits (``dataset_coco.json``), behind one LightningDataModule.

Training yields one (image, caption) item per caption, so an epoch sees every caption once; validation and
test yield one item per image with all its reference captions. Images are decoded to RGB whatever their
mode and resized to ``image_size`` squares; normalisation runs on whole batches in
``on_after_batch_transfer``. The vocabulary comes from the training split only and exists right after
construction, so LightningCLI can link ``data.vocab_size`` into the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from PIL import Image
from pycocotools.coco import COCO
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vision_attn.captioning.vocabulary import Vocabulary, has_words
from vision_attn.data.base import SplitDataModule
from vision_attn.data.fashion_mnist import DatasetNotFoundError
from vision_attn.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.images import BadImageCounter, OnBadImage, load_or_skip, open_image, to_tensor
from vision_attn.data.scenes import make_scenes

log = logging.getLogger(__name__)

ROLES = ("train", "val", "test")
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}  # restval joins train


@dataclass(frozen=True)
class CaptionedImage:
    """One image with its reference captions as written."""

    image_id: int | str
    path: Path
    captions: list[str]


class CaptionBatch(NamedTuple):
    """A training batch: images (B, 3, H, W), captions (N, T) = <start> w1..wn <end> <pad>.., lengths (N,)
    counting <start> and <end>. Caption n belongs to image ``caption_images[n]``; None means caption n to
    image n (N = B)."""

    images: Tensor
    captions: Tensor
    lengths: Tensor
    caption_images: Tensor | None = None


class EvalCaptionBatch(NamedTuple):
    """A validation/test batch, one entry per image: images (B, 3, H, W), ids, raw reference captions."""

    images: Tensor
    image_ids: list[int | str]
    references: list[list[str]]


def resolve_inside(root: Path, relative: str, *, source: Path) -> Path:
    """``root / relative``, refusing names from ``source`` that would leave ``root`` ("../..", absolute)."""
    if not isinstance(relative, str) or not relative:
        raise ValueError(f"{source}: image file name {relative!r} is not a non-empty string")
    base = os.path.abspath(root)  # normalised, symlinks kept (image folders are often links)
    candidate = os.path.normpath(os.path.join(base, relative))
    if os.path.isabs(relative) or os.path.commonpath([base, candidate]) != base or candidate == base:
        raise ValueError(f"{source}: image path '{relative}' points outside the image folder {root}; "
                         "file names must be relative paths inside it")
    return Path(candidate)


def load_coco(path: Path, what: str) -> COCO:
    """A pycocotools index of a COCO JSON file, with its progress prints silenced and errors named."""
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: {what} file not found")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return COCO(str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None
    except (AssertionError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a COCO {what} file (problem: {type(error).__name__} {error})") from None


def read_coco_captions(captions_file: Path, image_dir: Path) -> list[CaptionedImage]:
    """The captioned images of a COCO captions file, in the file's order; images without captions are left out."""
    coco = load_coco(captions_file, "captions")
    if not image_dir.is_dir():
        raise DatasetNotFoundError(f"{image_dir}: image folder not found (the images of {captions_file})")
    seen: set = set()
    for entry in coco.dataset.get("images", []):
        if entry["id"] in seen:
            raise ValueError(f"{captions_file}: image id {entry['id']!r} appears twice in 'images'; ids must be unique")
        seen.add(entry["id"])
    orphans = set(coco.imgToAnns) - set(coco.imgs)
    if orphans:
        raise ValueError(f"{captions_file}: captions refer to {len(orphans)} image ids missing from 'images' "
                         f"(e.g. {sorted(orphans, key=str)[0]})")
    records, wordless = [], []
    for image_id in coco.imgs:  # the file's order
        captions = [annotation.get("caption") for annotation in coco.imgToAnns.get(image_id, [])]
        if not all(isinstance(caption, str) for caption in captions):
            raise ValueError(f"{captions_file}: an annotation of image {image_id} has no 'caption' string")
        if not all(map(has_words, captions)):  # empty or punctuation-only captions teach nothing
            wordless += [(image_id, caption) for caption in captions if not has_words(caption)]
            captions = [caption for caption in captions if has_words(caption)]
        if not captions:
            continue
        path = resolve_inside(image_dir, coco.imgs[image_id].get("file_name"), source=captions_file)
        records.append(CaptionedImage(image_id, path, captions))
    if wordless:
        log.warning("%s: %d captions without any word left out (e.g. %r of image %s)", captions_file, len(wordless),
                    wordless[0][1], wordless[0][0])
    if not records:
        raise ValueError(f"{captions_file}: holds no captioned images")
    skipped = len(coco.imgs) - len(records)
    if skipped:
        log.info("%s: %d images without captions left out", captions_file, skipped)
    return records


def read_karpathy(karpathy_file: Path, image_root: Path) -> dict[str, list[CaptionedImage]]:
    """The Karpathy splits of ``dataset_coco.json`` as {"train", "val", "test"}; restval joins train."""
    if not karpathy_file.is_file():
        raise DatasetNotFoundError(f"{karpathy_file}: Karpathy split file (dataset_coco.json) not found")
    try:
        entries = json.loads(karpathy_file.read_text())["images"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{karpathy_file}: not a readable JSON file ({error})") from None
    except (KeyError, TypeError):
        raise ValueError(f"{karpathy_file}: expected a Karpathy split file with an 'images' list") from None
    if not image_root.is_dir():
        raise DatasetNotFoundError(f"{image_root}: image folder not found (the images of {karpathy_file})")
    splits: dict[str, list[CaptionedImage]] = {role: [] for role in ROLES}
    wordless = 0
    for index, entry in enumerate(entries):
        where = f"{karpathy_file}: images[{index}]"
        try:
            split, filename, sentences = entry["split"], entry["filename"], entry["sentences"]
            image_id = entry.get("cocoid", entry.get("imgid", filename))
            captions = [s["raw"] if "raw" in s else " ".join(s["tokens"]) for s in sentences]
        except (KeyError, TypeError) as error:
            raise ValueError(f"{where}: missing or malformed field {error} (need split, filename, "
                             "sentences[].raw or sentences[].tokens)") from None
        if split not in KARPATHY_SPLITS:
            raise ValueError(f"{where}: unknown split {split!r}; expected one of {sorted(KARPATHY_SPLITS)}")
        path = resolve_inside(image_root, os.path.join(entry.get("filepath", ""), filename), source=karpathy_file)
        wordless += sum(not has_words(caption) for caption in captions)
        captions = [caption for caption in captions if has_words(caption)]
        if captions:
            splits[KARPATHY_SPLITS[split]].append(CaptionedImage(image_id, path, captions))
    if wordless:
        log.warning("%s: %d captions without any word left out", karpathy_file, wordless)
    return splits


def load_caption_image(path: Path, image_size: int) -> Tensor:
    """An image file as RGB uint8 (3, image_size, image_size), squashed to the square so nothing is cut off."""
    image = open_image(path, mode="RGB", max_side=image_size)
    if image.size != (image_size, image_size):
        image = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
    return to_tensor(image)


class CaptionTrainDataset(Dataset):
    """One item per caption: (image uint8 (3, S, S), caption ids padded to the longest caption, length).

    With ``group_captions`` one item per image instead: (image, all its captions (n, T), their lengths (n,)),
    so the encoder sees each image once per epoch while the decoder still sees every caption.
    """

    def __init__(self, records: list[CaptionedImage], vocab: Vocabulary, *, max_caption_length: int,
                 image_size: int, group_captions: bool = False, on_bad_image: OnBadImage = "skip",
                 bad_images: BadImageCounter | None = None) -> None:
        self.group_captions = group_captions
        self.on_bad_image = on_bad_image
        self.bad_images = bad_images
        counts = torch.tensor([len(record.captions) for record in records])
        self.caption_starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])  # (images + 1,)
        self.paths = [record.path for record in records]
        self.image_size = image_size
        self.image_index = torch.tensor([index for index, record in enumerate(records)
                                         for _ in record.captions], dtype=torch.int64)  # (N,)
        captions, self.lengths = vocab.encode_batch([c for record in records for c in record.captions],
                                                    max_caption_length)
        if vocab.truncated:
            log.warning("%d training captions are longer than max_caption_length=%d words and were cut to it",
                        vocab.truncated, max_caption_length)
        self.captions = captions.to(torch.int32)  # (N, T), half the memory of int64 on COCO's 600k captions

    def __len__(self) -> int:
        return len(self.paths) if self.group_captions else len(self.lengths)

    def _image(self, image_index: int) -> Tensor | None:
        path = self.paths[image_index]
        return load_or_skip(lambda: load_caption_image(path, self.image_size), self.on_bad_image, self.bad_images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """The item, or None for an unreadable image under the "skip" policy (the collate drops it)."""
        if self.group_captions:
            start, end = int(self.caption_starts[index]), int(self.caption_starts[index + 1])
            image = self._image(index)
            return None if image is None else (image, self.captions[start:end], self.lengths[start:end])
        image = self._image(int(self.image_index[index]))
        return None if image is None else (image, self.captions[index], self.lengths[index])


class CaptionEvalDataset(Dataset):
    """One item per image: (image uint8 (3, S, S), image id, raw reference captions)."""

    def __init__(self, records: list[CaptionedImage], *, image_size: int, on_bad_image: OnBadImage = "skip",
                 bad_images: BadImageCounter | None = None) -> None:
        self.records = records
        self.image_size = image_size
        self.on_bad_image = on_bad_image
        self.bad_images = bad_images

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[Tensor, int | str, list[str]] | None:
        record = self.records[index]
        image = load_or_skip(lambda: load_caption_image(record.path, self.image_size), self.on_bad_image,
                             self.bad_images)
        return None if image is None else (image, record.image_id, record.captions)


def collate_captions(items: list[tuple[Tensor, Tensor, Tensor] | None]) -> CaptionBatch | None:
    """Stack training items, trimming the caption padding to the batch's longest caption; skipped (None)
    items are left out, and a batch with nothing readable is None."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images, captions, lengths = zip(*items, strict=True)
    if captions[0].ndim == 2:  # grouped: every caption of each image
        counts = torch.tensor([len(group) for group in lengths])
        lengths = torch.cat(lengths)  # (N,)
        captions = torch.cat(captions)[:, : int(lengths.max())].long()  # (N, T)
        caption_images = torch.repeat_interleave(torch.arange(len(images)), counts)  # (N,)
        return CaptionBatch(torch.stack(images), captions, lengths, caption_images)
    lengths = torch.stack(lengths)  # (B,)
    captions = torch.stack(captions)[:, : int(lengths.max())].long()  # (B, T)
    return CaptionBatch(torch.stack(images), captions, lengths)


def collate_references(items: list[tuple[Tensor, int | str, list[str]] | None]) -> EvalCaptionBatch | None:
    """Stack evaluation items; ids and references stay Python lists. Skipped (None) items are left out."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images, image_ids, references = zip(*items, strict=True)
    return EvalCaptionBatch(torch.stack(images), list(image_ids), list(references))


class CocoCaptionsDataModule(SplitDataModule):
    """Image captioning data in COCO captions format (default: the Fashion scenes) or Karpathy's splits.

    ``annotation_format="coco"`` reads ``root/captions_file_pattern`` with images in ``root/image_dir_pattern``
    (``{split}`` is the split name). ``"karpathy"`` reads ``karpathy_file`` (default ``root/dataset_coco.json``)
    with images under ``karpathy_image_root/<filepath>/<filename>`` (default root); its restval joins train.
    ``generate_scenes=True`` writes the Fashion scenes into ``root`` first when they are not there.
    ``max_caption_length`` caps the words of a training caption; the default 24 keeps every Fashion scene
    caption whole (the longest has 23 words). ``group_captions`` makes a training item one image with all
    its captions (``batch_size`` then counts images): every caption is still seen each epoch, and the
    encoder runs once per image instead of once per caption. ``on_bad_image="skip"`` leaves unreadable
    images out with a warning naming each, and the count is reported at the end of the epoch; "error" stops.
    """

    def __init__(
        self,
        root: str = "data/fashion_scenes",
        *,
        annotation_format: Literal["coco", "karpathy"] = "coco",
        train_split: str = "train",
        val_split: str = "val",
        test_split: str = "test",
        captions_file_pattern: str = "annotations/captions_{split}.json",
        image_dir_pattern: str = "images/{split}",
        instances_file_pattern: str = "annotations/instances_{split}.json",
        karpathy_file: str | None = None,
        karpathy_image_root: str | None = None,
        image_size: int = 96,
        min_word_count: int = 1,
        max_caption_length: int = 24,
        vocab_file: str | None = None,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        group_captions: bool = False,
        generate_scenes: bool = False,
        scenes_counts: dict[str, int] | None = None,
        scenes_seed: int = 0,
        on_bad_image: OnBadImage = "skip",
    ) -> None:
        super().__init__()
        self.set_bad_image_policy(on_bad_image)
        for name, value in (("image_size", image_size), ("min_word_count", min_word_count),
                            ("max_caption_length", max_caption_length), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if annotation_format not in ("coco", "karpathy"):
            raise ValueError(f"annotation_format must be 'coco' or 'karpathy', got {annotation_format!r}")
        for name, pattern in (("captions_file_pattern", captions_file_pattern),
                              ("image_dir_pattern", image_dir_pattern),
                              ("instances_file_pattern", instances_file_pattern)):
            try:
                pattern.format(split="train")
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"{name} '{pattern}' may only contain the placeholder {{split}}") from None
        self.root = Path(root)
        self.annotation_format = annotation_format
        self.splits = {"train": train_split, "val": val_split, "test": test_split}
        if annotation_format == "karpathy":
            for role, split in self.splits.items():
                if split not in ROLES:
                    raise ValueError(f"{role}_split '{split}' is not a Karpathy split; use one of {list(ROLES)} "
                                     "(restval is always part of train)")
        self.captions_file_pattern = captions_file_pattern
        self.image_dir_pattern = image_dir_pattern
        self.instances_file_pattern = instances_file_pattern
        self.karpathy_file = Path(karpathy_file) if karpathy_file else self.root / "dataset_coco.json"
        self.karpathy_image_root = Path(karpathy_image_root) if karpathy_image_root else self.root
        self.image_size = image_size
        self.max_caption_length = max_caption_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.group_captions = group_captions
        self.mean = list(mean) if mean is not None else list(IMAGENET_MEAN)
        self.std = list(std) if std is not None else list(IMAGENET_STD)
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 values each (RGB), got {self.mean} and {self.std}")
        self._records: dict[str, list[CaptionedImage]] = {}
        self.train_set: CaptionTrainDataset | None = None
        self.val_set: CaptionEvalDataset | None = None
        self.test_set: CaptionEvalDataset | None = None
        if generate_scenes:
            self._generate_scenes(scenes_counts, scenes_seed)
        if vocab_file:
            self.vocab = Vocabulary.from_json(vocab_file)
        else:
            train_captions = [caption for record in self.records("train") for caption in record.captions]
            self.vocab = Vocabulary.build(train_captions, min_count=min_word_count)
            log.info("vocabulary of %d tokens from the %s split (min count %d)", len(self.vocab), train_split,
                     min_word_count)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def vocab_tokens(self) -> list[str]:
        """The vocabulary as a plain token list (specials first), for the CLI to link into the model."""
        return self.vocab.tokens

    def save_vocab(self, path: str | Path) -> None:
        """Write the vocabulary as JSON (``vocab_file`` reads it back)."""
        self.vocab.to_json(path)

    def captions_file(self, split: str) -> Path:
        return self.root / self.captions_file_pattern.format(split=split)

    def image_dir(self, split: str) -> Path:
        return self.root / self.image_dir_pattern.format(split=split)

    def _generate_scenes(self, counts: dict[str, int] | None, seed: int) -> None:
        if self.annotation_format != "coco":
            raise ValueError("generate_scenes needs annotation_format 'coco' (the scenes are COCO-format files)")
        missing = [split for split in self.splits.values() if not self.captions_file(split).is_file()]
        if missing:
            log.info("no Fashion scenes in %s (missing %s): generating them", self.root,
                     ", ".join(str(self.captions_file(split)) for split in missing))
            for split, written in make_scenes(self.root, counts=counts, seed=seed).items():
                log.info("wrote %d %s scenes with %d captions", written["images"], split, written["captions"])

    def records(self, role: Literal["train", "val", "test"]) -> list[CaptionedImage]:
        """The captioned images of the split playing ``role``, read once and cached."""
        if role not in self._records:
            if self.annotation_format == "coco":
                split = self.splits[role]
                self._records[role] = read_coco_captions(self.captions_file(split), self.image_dir(split))
            else:
                self._records.update(read_karpathy(self.karpathy_file, self.karpathy_image_root))
                if not self._records[role]:
                    raise ValueError(f"{self.karpathy_file}: no images in the {role} split")
        return self._records[role]

    def boxes(self, split: str) -> dict[int | str, list[tuple[str, list[float]]]]:
        """Per image id, the (class name, [x, y, w, h]) of each object of a split with an instances file."""
        path = self.root / self.instances_file_pattern.format(split=split)
        coco = load_coco(path, "instances")
        names = {category["id"]: category["name"] for category in coco.cats.values()}
        try:
            return {image_id: [(names[a["category_id"]], [float(v) for v in a["bbox"]])
                               for a in coco.imgToAnns.get(image_id, [])]
                    for image_id in coco.imgs}
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: an annotation lacks a known category_id or a bbox ({error})") from None

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = CaptionTrainDataset(self.records("train"), self.vocab, image_size=self.image_size,
                                                 max_caption_length=self.max_caption_length,
                                                 group_captions=self.group_captions, **self.bad_image_options)
        if stage in (None, "fit", "validate") and self.val_set is None:
            self.val_set = CaptionEvalDataset(self.records("val"), image_size=self.image_size,
                                              **self.bad_image_options)
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = CaptionEvalDataset(self.records("test"), image_size=self.image_size,
                                               **self.bad_image_options)

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        return self._make_loader(
            dataset,
            train=train,
            batch_size=self.batch_size if train else self.eval_batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_captions if train else collate_references,
            drop_last=False,  # every caption (and every evaluation image) once per epoch
        )

    def on_after_batch_transfer(self, batch: CaptionBatch | EvalCaptionBatch,
                                dataloader_idx: int) -> CaptionBatch | EvalCaptionBatch:
        if batch is None:  # every image of the batch was unreadable and skipped
            return None
        self.count_train_batch()
        return batch._replace(images=self.normalize(batch.images))
