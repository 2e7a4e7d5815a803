"""The captioning DataModule: COCO-format caption files (MS COCO itself, or the generated Fashion scenes)
and the Karpathy splits (``dataset_coco.json``) behind one LightningDataModule.

Normalisation runs on whole batches in ``on_after_batch_transfer``. The vocabulary comes from the training
split only and exists right after construction, so LightningCLI can link it into the model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import DataLoader, Dataset

from vision_attn.data.coco import (
    ROLES,
    CaptionBatch,
    CaptionedImage,
    CaptionEvalDataset,
    CaptionTrainDataset,
    EvalCaptionBatch,
    ObjectTargets,
    collate_captions,
    collate_references,
    read_coco_captions,
    read_karpathy,
    read_object_targets,
    read_objects,
)
from vision_attn.data.feature_cache import FeatureCache
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD, OnBadImage
from vision_attn.data.scenes import SPLIT_CODES, SceneStyle, make_scenes
from vision_attn.data.vocabulary import SPECIALS, Vocabulary
from vision_attn.datamodules.base import SplitDataModule
from vision_attn.errors import DatasetNotFoundError

log = logging.getLogger(__name__)


class CocoCaptionsDataModule(SplitDataModule):
    """Image captioning data in COCO captions format (default: the Fashion scenes) or Karpathy's splits.

    ``annotation_format="coco"`` reads ``root/captions_file_pattern`` with images in ``root/image_dir_pattern``
    (``{split}`` is the split name). ``"karpathy"`` reads ``karpathy_file`` (default ``root/dataset_coco.json``)
    with images under ``karpathy_image_root/<filepath>/<filename>`` (default root); its restval joins train.
    ``generate_scenes=True`` writes the Fashion scenes into ``root`` first when they are not there, each split
    in the style ``scenes_styles`` gives it (``{"train": {"layout": "mixed", "shade_jitter": 1.0}}``; SPEC §3's
    by default); scenes already there must have been drawn in that style.
    ``max_caption_length`` caps the words of a training caption; the default 24 keeps every Fashion scene
    caption whole (the longest has 23 words). ``group_captions`` makes a training item one image with all
    its captions (``batch_size`` then counts images): every caption is still seen each epoch, and the
    encoder runs once per image instead of once per caption. ``on_bad_image="skip"`` leaves unreadable
    images out with a warning naming each, and the count is reported at the end of the epoch; "error" stops.
    ``object_targets`` gives each training image its objects from the train split's instances file (their
    category, their colour where an attributes file names it, and their box): ``object_classes`` and
    ``object_colours`` then name what the model's object loss predicts (empty lists without it).
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
        attributes_file_pattern: str = "annotations/attributes_{split}.json",
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
        scenes_styles: dict[str, dict] | None = None,
        object_targets: bool = False,
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
                              ("instances_file_pattern", instances_file_pattern),
                              ("attributes_file_pattern", attributes_file_pattern)):
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
        self.attributes_file_pattern = attributes_file_pattern
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
            self._generate_scenes(scenes_counts, scenes_seed, scenes_styles)
        if vocab_file:
            self.vocab = Vocabulary.from_json(vocab_file)
        else:
            train_captions = [caption for record in self.records("train") for caption in record.captions]
            self.vocab = Vocabulary.build(train_captions, min_count=min_word_count)
            if len(self.vocab) == len(SPECIALS):
                raise ValueError(f"min_word_count {min_word_count} keeps no word of the {len(train_captions)} "
                                 f"{train_split} captions: a captioner needs words; lower it")
            log.info("vocabulary of %d tokens from the %s split (min count %d)", len(self.vocab), train_split,
                     min_word_count)
        self._objects: ObjectTargets | None = self._read_object_targets() if object_targets else None
        self.object_classes = list(self._objects.classes) if self._objects else []
        self.object_colours = list(self._objects.colours) if self._objects else []

    def _read_object_targets(self) -> ObjectTargets:
        """The training split's object targets, from its instances (and attributes) file."""
        if self.annotation_format != "coco":
            raise ValueError("object_targets needs annotation_format 'coco' with an instances file for the train "
                             "split (instances_file_pattern)")
        split = self.splits["train"]
        instances = self.root / self.instances_file_pattern.format(split=split)
        if not instances.is_file():
            raise DatasetNotFoundError(f"{instances}: no instances file for the {split} split, which "
                                       "object_targets reads")
        attributes = self.root / self.attributes_file_pattern.format(split=split)
        objects = read_object_targets(instances, attributes if attributes.is_file() else None)
        log.info("object targets of %d %s images: %d classes, %d colours", len(objects.per_image), split,
                 len(objects.classes), len(objects.colours))
        return objects

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

    def _generate_scenes(self, counts: dict[str, int] | None, seed: int, styles: dict[str, dict] | None) -> None:
        if self.annotation_format != "coco":
            raise ValueError("generate_scenes needs annotation_format 'coco' (the scenes are COCO-format files)")
        styles = {split: SceneStyle.of(style) for split, style in (styles or {}).items()}
        unknown = set(styles) - set(SPLIT_CODES)
        if unknown:
            raise ValueError(f"scenes_styles names split(s) {sorted(unknown)}; use {list(SPLIT_CODES)}")
        missing = [split for split in self.splits.values() if not self.captions_file(split).is_file()]
        if missing:
            log.info("no Fashion scenes in %s (missing %s): generating them", self.root,
                     ", ".join(str(self.captions_file(split)) for split in missing))
            for split, written in make_scenes(self.root, counts=counts, seed=seed, styles=styles).items():
                log.info("wrote %d %s scenes with %d captions", written["images"], split, written["captions"])
            return
        for split in self.splits.values():  # scenes already there: they must be the ones this config asks for
            found = json.loads(self.captions_file(split).read_text()).get("info", {}).get("style")
            wanted = styles.get(split, SceneStyle())
            if SceneStyle.of(found) != wanted:
                raise ValueError(f"the {split} scenes in {self.root} were drawn with style {SceneStyle.of(found)}, "
                                 f"but this config asks for {wanted}: use another root, or delete that one")

    def records(self, role: Literal["train", "val", "test"]) -> list[CaptionedImage]:
        """The captioned images of the split playing ``role``, read once and cached. Validation and test images
        carry their objects when the split has an instances file (``instances_file_pattern``)."""
        if role not in self._records:
            if self.annotation_format == "coco":
                split = self.splits[role]
                self._records[role] = read_coco_captions(self.captions_file(split), self.image_dir(split))
            else:
                self._records.update(read_karpathy(self.karpathy_file, self.karpathy_image_root))
                if not self._records[role]:
                    raise ValueError(f"{self.karpathy_file}: no images in the {role} split")
            instances = self.root / self.instances_file_pattern.format(split=self.splits[role])
            attributes = self.root / self.attributes_file_pattern.format(split=self.splits[role])
            if role != "train" and instances.is_file():
                boxes = read_objects(instances, attributes if attributes.is_file() else None)
                self._records[role] = [replace(record, objects=boxes.get(record.image_id, []))
                                       for record in self._records[role]]
        return self._records[role]

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = CaptionTrainDataset(self.records("train"), self.vocab, image_size=self.image_size,
                                                 max_caption_length=self.max_caption_length,
                                                 group_captions=self.group_captions, objects=self._objects,
                                                 **self.bad_image_options)
        if stage in (None, "fit", "validate") and self.val_set is None:
            self.val_set = CaptionEvalDataset(self.records("val"), image_size=self.image_size,
                                              **self.bad_image_options)
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = CaptionEvalDataset(self.records("test"), image_size=self.image_size,
                                               **self.bad_image_options)

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        # every caption (and every evaluation image) once per epoch: no batch is dropped
        return self._make_loader(dataset, train=train, collate_fn=collate_captions if train else collate_references)

    def on_after_batch_transfer(self, batch: CaptionBatch | EvalCaptionBatch,
                                dataloader_idx: int) -> CaptionBatch | EvalCaptionBatch:
        if batch is None:  # every image of the batch was unreadable and skipped
            return None
        self.count_train_batch()
        if batch.images.dtype != torch.uint8:  # features from a feature cache, not pixels
            return batch
        return batch._replace(images=self.normalize(batch.images))

    def use_feature_cache(self, role: Literal["train", "val", "test"], cache: FeatureCache | None) -> None:
        """Serve the ``role`` split's cached encoder features instead of its images (None: images again).
        The datasets must exist (``setup``); the cache must hold every image of the split, in ``records`` order."""
        dataset = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[role]
        if dataset is None:
            raise ValueError(f"the {role} split is not set up: call setup() first")
        if cache is not None and cache.count != len(self.records(role)):
            raise ValueError(f"a feature cache of {cache.count} images for the {len(self.records(role))} of {role}")
        dataset.features = cache
